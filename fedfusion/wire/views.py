"""A Flower ``ArrayRecord``'s tensors read in place, without a copy.

Flower holds the round's global model as an ``ArrayRecord`` whose every ``Array`` keeps its values as ``.npy`` bytes;
``ArrayRecord.to_torch_state_dict()`` parses each into a fresh copy. The server reads that record every round
(building the clients' payloads, scoring the target, checkpointing) while Flower's loop keeps the record itself alive,
so a copy costs a whole second target in the server's memory (621 MiB for SmolLM2-135M in float32) for the whole
round. :func:`record_tensors` gives tensors over the record's own bytes instead.

Those tensors are **read-only by contract**: Python's ``bytes`` are immutable and Flower may hash or resend them, so
nothing may write into them (torch cannot enforce it). Code that needs to change a value makes its own tensor, as the
fold does (``SelectiveAverager`` sums into its own storage).
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import numpy.lib.format as npy_format
import torch
from flwr.app import ArrayRecord
from flwr.app.message.array import Array
from flwr.common.constant import SType

_HEADERS = {(1, 0): npy_format.read_array_header_1_0, (2, 0): npy_format.read_array_header_2_0}


def array_tensor(array: Array) -> torch.Tensor:
    """``array``'s values as a tensor over its ``.npy`` bytes (no copy); a copy where the bytes cannot be read in
    place (not numpy-serialised, another ``.npy`` version, Fortran order, or an object dtype)."""
    if array.stype == SType.NUMPY:
        header = io.BytesIO(array.data)
        read = _HEADERS.get(npy_format.read_magic(header))
        shape, fortran, dtype = read(header) if read is not None else ((), True, np.dtype(object))
        if not fortran and not dtype.hasobject:
            values = np.frombuffer(array.data, dtype=dtype, count=int(np.prod(shape)), offset=header.tell())
            with warnings.catch_warnings():  # a tensor over immutable bytes: read-only by this module's contract
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(values.reshape(shape))
    return torch.from_numpy(array.numpy())


def record_tensors(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """The record's tensors by name, each over the record's own bytes (:func:`array_tensor`): read, never write."""
    return {name: array_tensor(array) for name, array in record.items()}
