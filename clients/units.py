"""Client role for the exact (units) mode: compute the GEMM tiles a message carries.

A units message is not a training round: the server keeps the target and the optimizer and sends this node
operand blocks and the products it wants (``fedfusion.units.messages``' wire format); the node computes them
with :class:`fedfusion.units.DeviceRuntime` and answers the result tiles. Weight blocks it received stay in its
cache and weight-gradient tiles in its running sums (the ClientApp keeps both in Flower's ``context.state``
between messages) so the server sends each weight block once per version and gets each weight-gradient tile
once per step. The role is reached through ``@app.train("units")``, not ``train()``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fedfusion.units.accumulate import RunningSums
from fedfusion.units.messages import DeviceRuntime


def compute(payload: bytes, cache: dict[str, torch.Tensor], sums: RunningSums, stall_s: float = 0.0) -> bytes | None:
    """The reply to one units message, ``cache`` updated in place (newer weight versions replace older ones) and
    ``sums`` too (the running sums of weight-gradient tiles, ``fedfusion.units.accumulate``); None when the message
    names a weight block the cache lacks or emits a sum that misses a micro-batch (this node lost its state: the
    server resends the weights and recomputes its sums). ``stall_s`` > 0 is an injected fault: sleep that long
    first (a device gone silent past its deadline)."""
    if stall_s > 0:
        time.sleep(stall_s)
    runtime = DeviceRuntime()
    runtime.cache, runtime.sums = cache, sums
    try:
        return runtime(payload)
    except KeyError:  # a held weight block missing (compute_units looks blocks up by wire key), or MissingSum
        return None


def num_examples(spec: Any, partition: int) -> int:
    """A units node trains on no data of its own (the server holds the text): it counts none."""
    return 0


def train(received: Any, spec: Any, partition: int, accelerator: str) -> Any:
    raise ValueError("the units role answers message type 'train.units' (fedfusion.client_app.units), not 'train'")


def evaluate(received: Any, spec: Any, partition: int, accelerator: str) -> Any:
    raise ValueError("the units role evaluates nothing: the server scores its own target")
