"""Full-forward slices: a device holds the whole target, frozen (and quantised on the wire), and trains only a
window of its coordinates with the exact gradient of the whole target's loss.

A window is a :class:`~fedfusion.models.slicing.SlicePlan` (the units it covers on each axis), the same object width
slicing uses, so the server's extraction, checks and selective average serve both modes unchanged: a client
replies the window's values as a sub-model state (``extract(trained, config, plan)``). What differs is the
forward pass: a width slice runs its own small network, whose gradient is not the target's (what 1/8 of the
units learn in their own context does not add up in the whole), while a full-forward window runs the target.

:class:`WindowModel` keeps the window as its only parameters (so the optimizer's state is the window's, as on a
device) and writes them into the frozen target on each forward pass (autograd flows through the scatter), so
the frozen coordinates never move, whatever the optimizer's weight decay. No Flower import.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
from torch.func import functional_call
from transformers import PretrainedConfig, PreTrainedModel

from fedfusion.models.build import config_aliases, model_from_state
from fedfusion.models.families import family_of
from fedfusion.models.low_rank import LowRankModel
from fedfusion.models.slicing import SlicePlan, scatter, sliced_shape, tensor_slices
from fedfusion.wire.specs import WindowSpec

State = dict[str, torch.Tensor]
FROZEN = "frozen/"  # the key prefix of the frozen target in a full-forward payload (the window's keys have none)


class WindowModel(torch.nn.Module):
    """The target ``frozen`` with the plan's window trainable: ``window`` holds the window's values by sub-model
    name (as :func:`~fedfusion.models.slicing.extract` gives them, HeteroFL scaler off)."""

    def __init__(self, config: PretrainedConfig, frozen: State, window: State, plan: SlicePlan) -> None:
        super().__init__()
        aliases = config_aliases(config)
        self._target = [model_from_state(config, frozen).requires_grad_(False)]  # a list: not a submodule
        slices = tensor_slices([n for n in frozen if n not in aliases], config, plan)
        self._where = {name: (sl.sub_name, sl.index) for name, sl in slices.items()}
        self._frozen = {name: frozen[name] for name in slices}
        self._keys = {sub: f"w{i}" for i, (sub, _) in enumerate(self._where.values())}
        self.window = torch.nn.ParameterDict({self._keys[sub]: torch.nn.Parameter(window[sub].detach().clone().float())
                                              for sub, _ in self._where.values()})

    def train(self, mode: bool = True) -> WindowModel:
        self._target[0].train(mode)  # dropout, where the target has any, follows the wrapper
        return super().train(mode)

    @property
    def device(self) -> torch.device:
        return self._target[0].device

    def forward(self, **inputs: Any) -> Any:
        params = {}
        for name, (sub, index) in self._where.items():
            full = self._frozen[name].clone()
            scatter(full, index, self.window[self._keys[sub]], accumulate=False)
            params[name] = full
        return functional_call(self._target[0], params, args=(), kwargs=inputs, tie_weights=True, strict=False)

    def trained(self) -> State:
        """The window's trained values, by sub-model name: the client's reply."""
        return {sub: self.window[key].detach().clone() for sub, key in self._keys.items()}

    def target(self) -> PreTrainedModel:
        """The frozen target (for counting and evaluation)."""
        return self._target[0]


def place(frozen: State, window: State, config: PretrainedConfig, plan: SlicePlan) -> State:
    """``frozen`` (e.g. the dequantised target a device received) with the window's exact values written in."""
    out = {k: v.clone() for k, v in frozen.items()}
    for name, sl in tensor_slices(list(frozen), config, plan).items():
        if sl.sub_name in window:
            scatter(out[name], sl.index, window[sl.sub_name].to(out[name].dtype), accumulate=False)
    return out


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


def from_payload(config: PretrainedConfig, received: State, spec: WindowSpec, seed: int) -> WindowModel | LowRankModel:
    """The model a device trains from a full-forward payload (decoded): the frozen target under :data:`FROZEN`
    keys with the window's exact values written in, the window trainable; with ``spec.rank`` r, a rank-r update
    (its ``A`` drawn from ``seed``) of every matrix the payload does not carry exactly, and those it carries."""
    frozen = {k.removeprefix(FROZEN): v for k, v in received.items() if k.startswith(FROZEN)}
    window = {k: v for k, v in received.items() if not k.startswith(FROZEN)}
    if not frozen:
        raise ValueError(f"a full-forward payload carries the frozen target under {FROZEN!r} keys; none arrived")
    if spec.rank:
        factored = [n for n, v in frozen.items() if v.dim() == 2 and n not in window]
        return LowRankModel(config, {**frozen, **window}, factored, window, spec.rank, seed)
    plan = window_plan(spec)
    return WindowModel(config, place(frozen, window, config, plan), window, plan)
