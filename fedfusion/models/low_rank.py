"""Low-rank full-forward windows: a device holds the whole target frozen and trains a rank-r update ``B @ A`` of
every weight matrix (and the small tensors exactly), with the exact gradient of the target's loss.

A unit window (:mod:`fedfusion.models.full_forward`) moves 1/k of the coordinates per round; this moves every
matrix, in a rank-r subspace the device picks afresh each round (``A`` random from the round's seed, ``B`` zero:
the device starts from the target's own function, as LoRA does). The server adds each device's ``B @ A`` to the
exact float32 target, so the fold is the average of the devices' full updates (FLoRA-exact, no cross terms of
averaged factors), and across rounds the target's change has any rank (merged every round, as ReLoRA does).
A device holds the frozen target in its narrow format plus ``r x (in + out)`` values per matrix, with their
gradients and optimizer state. No Flower import.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from transformers import PretrainedConfig

from fedfusion.models.build import config_aliases
from fedfusion.models.frozen import FrozenTargetModel, Slot, as_packed, frozen_target
from fedfusion.models.slicing import on_unit_axis
from fedfusion.wire.finite import all_finite
from fedfusion.wire.quantize import Packed

State = dict[str, torch.Tensor]
FACTOR_A, FACTOR_B = ".lowrank_A", ".lowrank_B"  # reply key suffixes: ``name + FACTOR_A`` is (r, in), B (out, r)


def split(config: PretrainedConfig, state: State, shared: bool) -> tuple[list[str], list[str]]:
    """(matrices trained as rank-r updates, tensors trained exactly) of a target ``state`` (tied aliases left
    out): norms and biases are exact; so are the matrices on no unit axis (embeddings, an untied head) when
    ``shared``."""
    aliases = config_aliases(config)
    factored: list[str] = []
    exact: list[str] = []
    for name, value in state.items():
        if name in aliases or not value.is_floating_point():
            continue
        (factored if value.dim() == 2 and (not shared or on_unit_axis(config, name)) else exact).append(name)
    return factored, exact


def factor_params(state: State, factored: list[str], rank: int) -> int:
    """Values of the rank-``rank`` factors of ``factored`` (a device's trainable values, with the exact ones)."""
    return sum(rank * (state[n].shape[0] + state[n].shape[1]) for n in factored)


class LowRankModel(FrozenTargetModel):
    """The target ``frozen`` (its matrices kept as they travelled: :mod:`fedfusion.models.frozen`) plus a trainable
    rank-``rank`` update of each of ``factored`` and the trainable ``exact`` tensors (their starting values as
    received). ``A`` starts random (seeded), ``B`` at zero."""

    def __init__(self, config: PretrainedConfig, frozen: Mapping[str, Packed | torch.Tensor], factored: list[str],
                 exact: State, rank: int, seed: int) -> None:
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        packed = as_packed(frozen)
        super().__init__(config, frozen_target(config, packed))
        gen = torch.Generator().manual_seed(seed)
        self._names = {name: f"m{i}" for i, name in enumerate(factored)}
        self.A = torch.nn.ParameterDict()
        self.B = torch.nn.ParameterDict()
        for name, key in self._names.items():
            out_dim, in_dim = packed[name].shape
            bound = 1 / math.sqrt(in_dim)  # LoRA's A: uniform in +-1/sqrt(fan_in)
            self.A[key] = torch.nn.Parameter((torch.rand(min(rank, in_dim, out_dim), in_dim, generator=gen) * 2 - 1) * bound)
            self.B[key] = torch.nn.Parameter(torch.zeros(out_dim, self.A[key].shape[0]))
            self.add(name, Slot(self.A, key), Slot(self.B, key))
        self._exact = {name: f"e{i}" for i, name in enumerate(exact)}
        self.exact = torch.nn.ParameterDict({key: torch.nn.Parameter(exact[name].detach().clone().float())
                                             for name, key in self._exact.items()})
        for name, key in self._exact.items():
            self.write(name, Slot(self.exact, key), (None,) * self.exact[key].dim())

    def trained(self) -> State:
        """The reply: each matrix's factors under ``name + FACTOR_A / FACTOR_B`` and the exact tensors' values."""
        out = {}
        for name, key in self._names.items():
            out[name + FACTOR_A] = self.A[key].detach().clone()
            out[name + FACTOR_B] = self.B[key].detach().clone()
        out.update({name: self.exact[key].detach().clone() for name, key in self._exact.items()})
        return out


def densify(reply: State, target: State, factored: list[str], exact: list[str], rank: int) -> State:
    """The target-shaped state a low-rank reply means: ``target + B @ A`` for each factored matrix, the exact
    tensors as replied, every other tensor as in ``target``. ValueError naming the key for a missing or unexpected
    key, a wrong shape or a non-finite value."""
    expected = {n + s for n in factored for s in (FACTOR_A, FACTOR_B)} | set(exact)
    missing, extra = sorted(expected - set(reply)), sorted(set(reply) - expected)
    if missing or extra:
        raise ValueError(f"low-rank reply: missing {missing[:3]}, unexpected {extra[:3]}")
    out = dict(target)
    for name in factored:
        A, B = reply[name + FACTOR_A].float(), reply[name + FACTOR_B].float()
        out_dim, in_dim = target[name].shape
        r = min(rank, in_dim, out_dim)
        if tuple(A.shape) != (r, in_dim) or tuple(B.shape) != (out_dim, r):
            raise ValueError(f"low-rank reply {name}: factors {tuple(B.shape)} @ {tuple(A.shape)}, expected "
                             f"({out_dim}, {r}) @ ({r}, {in_dim})")
        out[name] = target[name] + B @ A
    for name in exact:
        if reply[name].shape != target[name].shape:
            raise ValueError(f"low-rank reply {name}: shape {tuple(reply[name].shape)}, expected {tuple(target[name].shape)}")
        out[name] = reply[name].float()
    bad = [n for n in factored + exact if not all_finite(out[n])]
    if bad:
        raise ValueError(f"low-rank reply: non-finite values in {bad[:3]}")
    return out
