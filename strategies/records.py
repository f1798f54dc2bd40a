"""The Flower records of one round: the payloads' records, each tensor serialised once (:class:`RoundRecords`), and
the global record's tensors read in place (:func:`record_tensors`).

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
from collections.abc import Mapping

import numpy as np
import numpy.lib.format as npy_format
import torch
from flwr.app import Array, ArrayRecord
from flwr.common.constant import SType


class RoundRecords:
    """Each sampled client's ArrayRecord from its payload's arrays, every tensor object serialised once a round.

    A method hands several clients the very same tensor where they get the same values (the frozen target of a
    full-forward window, quantised once a round; the slice that clients of one plan share): its Flower Array (the npy
    bytes) is made once and every record that holds it shares those bytes (Flower keeps an Array's ``data`` as given),
    where converting each payload on its own made one copy per client. Once serialised, a tensor is let go by every
    state still waiting for its record, so the round's tensors are freed as their bytes are made instead of all
    living until the last record is built.

    ``states`` (node -> a payload's arrays) are the builder's own from then on: it replaces their tensors as it goes.
    Tensors are known by identity, which is unique among live objects only; every tensor of ``states`` is alive when
    they are given, and one is only looked up while a state still holds it."""

    def __init__(self, states: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        self.states: dict[int, dict[str, torch.Tensor | Array]] = {node: dict(state) for node, state in states.items()}
        self.holders: dict[int, list[tuple[int, str]]] = {}  # tensor id -> the (node, key) entries holding it
        for node, state in self.states.items():
            for key, tensor in state.items():
                self.holders.setdefault(id(tensor), []).append((node, key))

    def record(self, node: int, extra: Mapping[str, torch.Tensor] | None = None) -> ArrayRecord:
        """``node``'s record: its payload's arrays in order (each shared Array's bytes, a new Array object per record
        as Flower's own ``ArrayRecord(array_dict)`` makes them), plus ``extra``, arrays of this client only (secure
        aggregation's), serialised as they are."""
        record, state = ArrayRecord(), self.states.pop(node)
        for key in list(state):  # each entry let go as it is made: a tensor is freed once its bytes are
            value = state.pop(key)
            array = value if isinstance(value, Array) else self._serialise(value)
            record[key] = Array(dtype=array.dtype, shape=array.shape, stype=array.stype, data=array.data)
        for key, tensor in (extra or {}).items():
            record[key] = Array(tensor)
        return record

    def _serialise(self, tensor: torch.Tensor) -> Array:
        """``tensor``'s Array, put in its place in every state still waiting for its record."""
        array = Array(tensor)
        for node, key in self.holders.pop(id(tensor)):
            if node in self.states:
                self.states[node][key] = array
        return array


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
