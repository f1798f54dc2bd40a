"""Client role for the exact (units) mode: compute the GEMM tiles a message carries.

A units message is not a training round: the server keeps the target and the optimizer and sends this node
operand blocks and the products it wants (``fedfusion.units.messages``' wire format); the node computes them
with :class:`fedfusion.units.DeviceRuntime` and answers the result tiles. Weight blocks it received stay in its
cache and weight-gradient tiles in its running sums (its :class:`Node` state) between messages, so the server sends
each weight block once per version and gets each weight-gradient tile once per step. The role answers its own
message type (:data:`fedfusion.wire.specs.ACTIONS`: ``train.units``) through :func:`answer`, not ``train()``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedfusion.units.accumulate import RunningSums
from fedfusion.units.messages import DeviceRuntime
from fedfusion.wire.specs import UNITS_ERROR, UNITS_PAYLOAD, UNITS_RECORD, UnitsSpec


def _tensors(record: Any) -> dict[str, torch.Tensor]:
    """A ``context.state`` ArrayRecord as tensors (nothing when the node has none yet)."""
    return {k: torch.from_numpy(a.numpy()) for k, a in record.items()} if isinstance(record, ArrayRecord) else {}


def _record(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({k: Array(v.numpy()) for k, v in tensors.items()})


@dataclass
class Node:
    """What a units node keeps between messages: its weight blocks (newer versions replace older ones) and the
    running sums of its weight-gradient tiles (``fedfusion.units.accumulate``)."""

    CACHE: ClassVar[str] = "units-cache"
    SUMS: ClassVar[str] = "units-sums"
    cache: dict[str, torch.Tensor] = field(default_factory=dict)
    sums: RunningSums = field(default_factory=RunningSums)

    @classmethod
    def load(cls, records: RecordDict) -> Self:
        return cls(_tensors(records.get(cls.CACHE)), RunningSums.from_arrays(_tensors(records.get(cls.SUMS))))

    def save(self, records: RecordDict) -> None:
        records[self.CACHE] = _record(self.cache)
        records[self.SUMS] = _record(self.sums.to_arrays())


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


def answer(msg: Message, context: Context) -> Message:
    """Compute the GEMM tiles of the payload's bytes with the node's weight cache and running sums and reply the
    result bytes; a message that needs a weight block the cache lacks, or a sum the node lost, gets a
    ``units-error`` reply (the node's state cleared) and the server sends the weights again and recomputes the
    sums."""
    config = msg.content.config_records.get("config")
    spec = UnitsSpec.from_config_if_any(config) if config is not None else None
    payload = msg.content.array_records[UNITS_RECORD][UNITS_PAYLOAD].numpy().tobytes()
    node = Node.load(context.state)
    reply = compute(payload, node.cache, node.sums, spec.stall_s if spec else 0.0)
    if reply is None:
        Node().save(context.state)
        return Message(RecordDict({UNITS_ERROR: ConfigRecord({"reason": "weight block or running sum not on this "
                                                                        "node"})}), reply_to=msg)
    node.save(context.state)
    return Message(RecordDict({UNITS_RECORD: ArrayRecord({UNITS_PAYLOAD: Array(np.frombuffer(reply, np.uint8))})}),
                   reply_to=msg)


def num_examples(spec: Any, partition: int) -> int:
    """A units node trains on no data of its own (the server holds the text): it counts none."""
    return 0


def train(received: Any, spec: Any, partition: int, accelerator: str, node: Any = None) -> Any:
    raise ValueError("the units role answers message type 'train.units' (fedfusion.clients.units.answer), not 'train'")


def evaluate(received: Any, spec: Any, partition: int, accelerator: str) -> Any:
    raise ValueError("the units role evaluates nothing: the server scores its own target")
