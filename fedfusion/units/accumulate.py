"""On-device accumulation of weight-gradient tiles across a step's micro-batches.

A step of ``M`` micro-batches computes each weight's gradient ``dW = sum_m dY_m^T X_m``. Without accumulation every
micro-batch's tile travels back (``M`` uploads of ``|W|`` per step); with it, the device that holds a tile keeps
the running sum and uploads it once, with the step's last micro-batch to reach that weight (the *emit*). The
server fixes each weight's tiling (tile ranges and holders) at the first micro-batch that reaches it, so every
micro-batch adds to the same sums, and keeps every micro-batch's operands until the emit: Freivalds' check of
the sum is the check of one product over the concatenated inner dimension, ``[dY_0; ..; dY_M-1]^T [X_0; ..]``,
and a sum whose holder died, erred or failed the check is recomputed elsewhere from those operands, one plain
unit per micro-batch (the server sums them in micro-batch order).

``RunningSums`` is the device side: a sum folds the micro-batches' products in micro-batch order (a product that
arrives early waits for its predecessors), so a tile's sum is what ``backward()`` accumulates on the server.
``StepSum`` is the server side of one weight's sum in one step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fedfusion.units.plan import Tile


class MissingSum(KeyError):
    """An emit found a sum without every micro-batch's product (the device lost its state): an error reply."""


@dataclass
class _Sum:
    total: torch.Tensor | None = None
    folded: int = 0  # micro-batches 0 .. folded-1 are in ``total``
    early: dict[int, torch.Tensor] = field(default_factory=dict)  # products waiting for a predecessor


class RunningSums:
    """A device's running sums by key (``dW3@7[0:64,0:32,0:16]``: weight, version, tile); a key of an older
    weight version drops that weight's sums (the step they belonged to is over)."""

    def __init__(self) -> None:
        self.sums: dict[str, _Sum] = {}

    def add(self, key: str, micro: int, product: torch.Tensor) -> None:
        """Add micro-batch ``micro``'s product to sum ``key``, folding in micro-batch order."""
        stem = key.split("@", 1)[0] + "@"
        version = key.split("[", 1)[0]
        for old in [k for k in self.sums if k.startswith(stem) and k.split("[", 1)[0] != version]:
            del self.sums[old]
        s = self.sums.setdefault(key, _Sum())
        s.early[micro] = product
        while s.folded in s.early:
            part = s.early.pop(s.folded)
            s.total = part if s.total is None else s.total + part
            s.folded += 1

    def emit(self, key: str, count: int) -> torch.Tensor:
        """The sum of micro-batches ``0 .. count-1`` (dropped from the device); ``MissingSum`` when one is missing."""
        s = self.sums.get(key)
        if s is None or s.folded != count or s.early or s.total is None:
            raise MissingSum(key)
        del self.sums[key]
        return s.total

    def to_arrays(self) -> dict[str, torch.Tensor]:
        """Flat tensors for a node's ``context.state`` (Flower keeps arrays, not objects)."""
        out: dict[str, torch.Tensor] = {}
        for key, s in self.sums.items():
            out[f"{key}#folded"] = torch.tensor(s.folded)
            if s.total is not None:
                out[f"{key}#total"] = s.total
            out.update({f"{key}#{m}": t for m, t in s.early.items()})
        return out

    @classmethod
    def from_arrays(cls, arrays: dict[str, torch.Tensor]) -> RunningSums:
        sums = cls()
        for name, t in arrays.items():
            key, part = name.rsplit("#", 1)
            s = sums.sums.setdefault(key, _Sum())
            if part == "folded":
                s.folded = int(t)
            elif part == "total":
                s.total = t
            else:
                s.early[int(part)] = t
        return sums


def sum_key(name: str, tile: Tile) -> str:
    """The wire key of one tile's running sum of weight ``name`` (``W3@7``: weight and version)."""
    return f"d{name}[{tile.i0}:{tile.i1},{tile.j0}:{tile.j1},{tile.k0}:{tile.k1}]"


@dataclass
class StepSum:
    """The server's side of one weight's gradient summed over a step's ``count`` micro-batches.

    ``tiles`` (GEMM index 0) is the tiling fixed at the first micro-batch, each tile's device the holder of its
    sum; ``operands`` keeps each micro-batch's ``(A, B)`` (logical, ``A @ B`` its product) until the emit;
    ``lost`` the tile positions whose holder's sum is gone (recomputed in full at the emit)."""

    name: str
    count: int
    tiles: list[Tile]
    operands: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    arrived: int = 0  # micro-batches that reached this weight
    finished: int = 0  # of them, those whose contributions are acknowledged or lost
    lost: set[int] = field(default_factory=set)

    def key(self, pos: int) -> str:
        return sum_key(self.name, self.tiles[pos])

    def blocks(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The logical blocks of tile ``pos`` over every micro-batch, concatenated along the inner dimension, so
        their product is the tile's sum (what Freivalds checks)."""
        t = self.tiles[pos]
        ms = sorted(self.operands)
        return (torch.cat([self.operands[m][0][t.i0:t.i1, t.k0:t.k1] for m in ms], 1),
                torch.cat([self.operands[m][1][t.k0:t.k1, t.j0:t.j1] for m in ms], 0))

    def whole(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole product's operands concatenated along the inner dimension (its product: the step's sum)."""
        ms = sorted(self.operands)
        return torch.cat([self.operands[m][0] for m in ms], 1), torch.cat([self.operands[m][1] for m in ms], 0)

    def server_sum(self) -> torch.Tensor:
        """The sum computed on the server, micro-batch by micro-batch (no device left, or none caught alone)."""
        total: torch.Tensor | None = None
        for m in sorted(self.operands):
            a, b = self.operands[m]
            total = a @ b if total is None else total + a @ b
        assert total is not None
        return total
