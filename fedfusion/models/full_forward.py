"""Full-forward slices: a device holds the whole target, frozen (and as narrow as it travelled), and trains only a
window of its coordinates with the exact gradient of the whole target's loss.

A window is a :class:`~fedfusion.models.slicing.SlicePlan` (the units it covers on each axis), the same object width
slicing uses, so the server's extraction, checks and selective average serve both modes unchanged: a client
replies the window's values as a sub-model state (``extract(trained, config, plan)``). What differs is the
forward pass: a width slice runs its own small network, whose gradient is not the target's (what 1/8 of the
units learn in their own context does not add up in the whole), while a full-forward window runs the target.

:class:`WindowModel` keeps the window as its only parameters (so the optimizer's state is the window's, as on a
device) and writes them into the frozen target's matrices as each layer runs (:mod:`fedfusion.models.frozen`:
the matrices stay int8/int4/float16 as they travelled, one layer at a time float32), so the frozen coordinates
never move, whatever the optimizer's weight decay. No Flower import.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

import torch
from transformers import PretrainedConfig

from fedfusion.models.build import config_aliases
from fedfusion.models.families import family_of
from fedfusion.models.frozen import FrozenTargetModel, as_packed, frozen_target
from fedfusion.models.low_rank import LowRankModel
from fedfusion.models.slicing import SlicePlan, sliced_shape, tensor_slices
from fedfusion.wire.keys import FROZEN
from fedfusion.wire.quantize import Packed, unpack
from fedfusion.wire.specs import WindowSpec

State = dict[str, torch.Tensor]


class WindowModel(FrozenTargetModel):
    """The target ``frozen`` (its matrices kept as they travelled: :mod:`fedfusion.models.frozen`) with the plan's
    window trainable: ``window`` holds the window's values by sub-model name (as
    :func:`~fedfusion.models.slicing.extract` gives them, HeteroFL scaler off)."""

    def __init__(self, config: PretrainedConfig, frozen: Mapping[str, Packed | torch.Tensor], window: State,
                 plan: SlicePlan) -> None:
        packed = as_packed(frozen)
        super().__init__(config, frozen_target(config, packed))
        aliases = config_aliases(config)
        slices = tensor_slices([n for n in packed if n not in aliases], config, plan)
        self._keys = {sl.sub_name: f"w{i}" for i, sl in enumerate(slices.values())}
        self.window = torch.nn.ParameterDict({self._keys[sl.sub_name]: torch.nn.Parameter(
            window[sl.sub_name].detach().clone().float()) for sl in slices.values()})
        for name, sl in slices.items():
            self.write(name, self.window[self._keys[sl.sub_name]], sl.index)

    def trained(self) -> State:
        """The window's trained values, by sub-model name: the client's reply."""
        return {sub: self.window[key].detach().clone() for sub, key in self._keys.items()}


def window_params(config: PretrainedConfig, state: State, plan: SlicePlan) -> int:
    """Trainable values of the window (tied aliases counted once)."""
    aliases = config_aliases(config)
    slices = tensor_slices([n for n in state if n not in aliases], config, plan)
    return sum(math.prod(sliced_shape(state[name].shape, sl.index)) for name, sl in slices.items())


def window_axes(config: PretrainedConfig, axes: tuple[str, ...] | None) -> tuple[str, ...]:
    """The axes a full-forward window slices: ``axes`` (default: the family's) without ``hidden``; a window is a set
    of units (heads, neurons, layers) and the residual stream stays whole in it."""
    return tuple(a for a in (axes or family_of(config).default_axes) if a != "hidden")


def with_core(window: SlicePlan, core: SlicePlan) -> SlicePlan:
    """``window`` plus ``core``'s units on every unit axis the window slices (an axis the window holds whole stays
    whole): a window that always trains the units every device held before growth, and a rolling share of the rest."""
    def union(mine: tuple[int, ...] | None, theirs: tuple[int, ...] | None) -> tuple[int, ...] | None:
        return mine if mine is None or theirs is None else tuple(sorted(set(mine) | set(theirs)))

    return replace(window, attn_units=union(window.attn_units, core.attn_units),
                   neurons=union(window.neurons, core.neurons), layers=union(window.layers, core.layers),
                   channels=union(window.channels, core.channels))


def window_plan(spec: WindowSpec) -> SlicePlan:
    """The window a message's :class:`~fedfusion.wire.specs.WindowSpec` names, as a plan of the target (no scaler:
    the target runs whole)."""
    return SlicePlan.from_assignment(spec.units, scale=False, shared=spec.shared)


def from_payload(config: PretrainedConfig, received: Mapping[str, torch.Tensor], spec: WindowSpec,
                 seed: int) -> WindowModel | LowRankModel:
    """The model a device trains from a full-forward payload: the frozen target under :data:`FROZEN` keys, kept as
    it travelled (:func:`~fedfusion.wire.quantize.decode` with ``keep=FROZEN``; float tensors there are taken as
    they are), and the window's exact values (decoded), which it trains; with ``spec.rank`` r, a rank-r update (its
    ``A`` drawn from ``seed``) of every matrix the payload does not carry exactly, and those it carries."""
    frozen = unpack({k.removeprefix(FROZEN): v for k, v in received.items() if k.startswith(FROZEN)})
    window = {k: v for k, v in received.items() if not k.startswith(FROZEN)}
    if not frozen:
        raise ValueError(f"a full-forward payload carries the frozen target under {FROZEN!r} keys; none arrived")
    if spec.rank:
        factored = [n for n, p in frozen.items() if len(p.shape) == 2 and n not in window]
        return LowRankModel(config, frozen, factored, window, spec.rank, seed)
    return WindowModel(config, frozen, window, window_plan(spec))
