"""The Flower records of one round's payloads, each tensor serialised once (:class:`RoundRecords`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from flwr.app import Array, ArrayRecord


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
