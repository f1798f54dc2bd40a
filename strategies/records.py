"""The Flower records of one round's payloads, each tensor serialised once (:class:`RoundRecords`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

import torch
from flwr.app import Array, ArrayRecord


class RoundRecords:
    """Each sampled client's ArrayRecord from its payload's arrays, every tensor object serialised once a round.

    A method hands several clients the very same tensor where they get the same values (the frozen target of a
    full-forward window, quantised once a round; a slice that clients of one plan share): its Flower Array (the npy
    bytes) is made once, and every record that holds it shares those bytes, where converting each payload on its own
    makes one copy per client (Flower keeps an Array's ``data`` as given, not copied). A shared Array is kept here only
    until the last record that holds it is built. Tensors are known by identity, which is unique among live objects
    only: the payloads ``states`` belong to must stay alive until their records are built (each tensor's count is
    taken here, when all of them are)."""

    def __init__(self, states: Iterable[Mapping[str, torch.Tensor]]) -> None:
        self.left = Counter(id(t) for state in states for t in state.values())  # records still to build, per tensor
        self.shared: dict[int, tuple[torch.Tensor, Array]] = {}  # the tensor is kept too, so its id stays its own

    def record(self, state: Mapping[str, torch.Tensor], extra: Mapping[str, torch.Tensor] | None = None) -> ArrayRecord:
        """The record of one of the payloads' ``state`` (its entries in order), plus ``extra``: arrays of this client
        only (secure aggregation's), serialised as they are."""
        record = ArrayRecord()
        for key, tensor in state.items():
            record[key] = self._array(tensor)
        for key, tensor in (extra or {}).items():
            record[key] = Array(tensor)
        return record

    def _array(self, tensor: torch.Tensor) -> Array:
        """A new Array of ``tensor`` sharing the bytes of the one made for it before, if any (one Array object per
        record, as Flower's own ``ArrayRecord(array_dict)`` makes them)."""
        ident = id(tensor)
        made = self.shared.pop(ident, None)
        array = made[1] if made is not None else Array(tensor)
        self.left[ident] -= 1
        if self.left[ident] > 0:
            self.shared[ident] = (tensor, array)
        return Array(dtype=array.dtype, shape=array.shape, stype=array.stype, data=array.data)
