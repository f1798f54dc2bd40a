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
from typing import Any

import torch
from transformers import PretrainedConfig

from fedfusion.models.build import config_aliases, full_state, tied_aliases
from fedfusion.models.families import family_of
from fedfusion.models.frozen import FrozenTargetModel, Slot, as_packed, frozen_target
from fedfusion.models.low_rank import LowRankModel
from fedfusion.models.slicing import SlicePlan, sliced_shape, sub_config, tensor_slices
from fedfusion.wire.keys import FROZEN
from fedfusion.wire.quantize import Packed, unpack
from fedfusion.wire.specs import WindowSpec

State = dict[str, torch.Tensor]


class WindowModel(FrozenTargetModel):
    """The target ``frozen`` (its matrices kept as they travelled: :mod:`fedfusion.models.frozen`) with the plan's
    window trainable: ``window`` holds the window's values by sub-model name (as
    :func:`~fedfusion.models.slicing.extract` gives them, HeteroFL scaler off).

    With ``core`` (a grown plan inside the window: the small model every device held before growth), the core's
    coordinates train in the small model's own forward pass (:meth:`core_loss`, exactly a smallest-only client's
    step) and the full forward reads them without gradient: the rest of the window learns what the target adds to
    the small model, which stays what smallest-only training makes of it."""

    def __init__(self, config: PretrainedConfig, frozen: Mapping[str, Packed | torch.Tensor], window: State,
                 plan: SlicePlan, core: SlicePlan | None = None) -> None:
        packed = as_packed(frozen)
        super().__init__(config, frozen_target(config, packed))
        aliases = config_aliases(config)
        names = [n for n in packed if n not in aliases]
        slices = tensor_slices(names, config, plan)
        self._keys = {sl.sub_name: f"w{i}" for i, sl in enumerate(slices.values())}
        self.window = torch.nn.ParameterDict({self._keys[sl.sub_name]: torch.nn.Parameter(
            window[sl.sub_name].detach().clone().float()) for sl in slices.values()})
        self._core: list[tuple[str, str, tuple[torch.Tensor | None, ...], float]] = []
        fixed: dict[str, torch.Tensor] = {}
        if core is not None:
            self._small = [family_of(config).build(sub_config(config, core)).requires_grad_(False)]
            for name, sl in tensor_slices(names, config, core).items():
                if name not in slices:
                    raise ValueError(f"core: {name} is not part of the window (a core needs a shared window)")
                value = self.window[self._keys[slices[name].sub_name]]
                at = _positions(slices[name].index, sl.index)
                self._core.append((sl.sub_name, self._keys[slices[name].sub_name], at, sl.scale))
                fixed[name] = _mask(value.shape, at)
            want = set(self._small[0].state_dict()) - set(tied_aliases(self._small[0]))
            if want != {sub for sub, *_ in self._core}:
                raise ValueError(f"core: the window does not hold the small model's {sorted(want ^ {s for s, *_ in self._core})[:3]}")
        for name, sl in slices.items():
            self.write(name, Slot(self.window, self._keys[sl.sub_name]), sl.index, fixed.get(name))

    def core_loss(self, batch: torch.Tensor) -> torch.Tensor:
        """The small model's next-token loss on ``batch``, its tensors read from the core's coordinates of the
        window (so its gradient trains them, and only it). ValueError without a core."""
        if not self._core:
            raise ValueError("core_loss: this window has no core")
        small = self._small[0]
        if next(small.parameters()).device != self.device:  # moved once (inside torch.func a move would crash)
            small = self._small[0] = small.to(self.device)
        tensors = {sub: _take(self.window[key], at) * scale for sub, key, at, scale in self._core}
        tensors = full_state(tensors, tied_aliases(small))
        batch = batch.to(self.device)
        logits = torch.func.functional_call(small, tensors, args=(), kwargs={"input_ids": batch[:, :-1]}).logits
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def core_masks(self) -> dict[str, torch.Tensor]:
        """Per window parameter (by its key in :attr:`window`) holding core values: where they sit."""
        return {key: _mask(self.window[key].shape, at) for _, key, at, _ in self._core}

    @property
    def has_core(self) -> bool:
        """Whether the window holds a core that trains in the small model's forward pass."""
        return bool(self._core)

    def core_params(self) -> int:
        """Values of the small model the core trains (0 without a core)."""
        return sum(math.prod(len(a) if a is not None else n for a, n in zip(at, self.window[key].shape))
                   for _, key, at, _ in self._core)  # from the positions: no gather (it runs every step)

    def trained(self) -> State:
        """The window's trained values, by sub-model name: the client's reply."""
        return {sub: self.window[key].detach().clone() for sub, key in self._keys.items()}


def _positions(window: tuple[torch.Tensor | None, ...], core: tuple[torch.Tensor | None, ...]
               ) -> tuple[torch.Tensor | None, ...]:
    """Per dim, where the core's target coordinates sit in the window's (None: the whole dim in both)."""
    out: list[torch.Tensor | None] = []
    for w, c in zip(window, core):
        if w is None:
            out.append(c)
            continue
        if c is None:
            raise ValueError("core: the core holds a whole dim that the window slices")
        where = {int(x): i for i, x in enumerate(w.tolist())}
        missing = [int(x) for x in c.tolist() if int(x) not in where]
        if missing:
            raise ValueError(f"core: coordinates {missing[:3]} lie outside the window")
        out.append(torch.tensor([where[int(x)] for x in c.tolist()]))
    return tuple(out)


def _grid(at: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
    """An advanced index selecting the cross product of ``at``'s per-dim positions (None: the whole dim)."""
    dims = len(at)
    return tuple(slice(None) if a is None else a.view(*([1] * d), -1, *([1] * (dims - d - 1)))
                 if sum(x is not None for x in at) > 1 else a for d, a in enumerate(at))


def _take(values: torch.Tensor, at: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
    return values[_grid(at)]


def _mask(shape: torch.Size, at: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[_grid(at)] = True
    return mask


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


def core_plan(spec: WindowSpec) -> SlicePlan | None:
    """The small model grown inside the window that trains in its own forward pass (``spec.core``), or None."""
    return replace(SlicePlan.from_assignment(spec.core, scale=False, shared=True), grown=True) if spec.core else None


def from_payload(config: PretrainedConfig, received: Mapping[str, torch.Tensor], spec: WindowSpec,
                 seed: int) -> WindowModel | LowRankModel:
    """The model a device trains from a full-forward payload: the frozen target under :data:`FROZEN` keys, kept as
    it travelled (:func:`~fedfusion.wire.quantize.decode` with ``keep=FROZEN``; float tensors there are taken as
    they are), and the window's exact values (decoded), which it trains; with ``spec.rank`` r, a rank-r update (its
    ``A`` drawn from ``seed``) of every matrix the payload does not carry exactly, and those it carries. With
    ``spec.expand`` the frozen matrices are made float32 once (:meth:`~fedfusion.models.frozen.FrozenTargetModel.expand`)."""
    frozen = unpack({k.removeprefix(FROZEN): v for k, v in received.items() if k.startswith(FROZEN)})
    window = {k: v for k, v in received.items() if not k.startswith(FROZEN)}
    if not frozen:
        raise ValueError(f"a full-forward payload carries the frozen target under {FROZEN!r} keys; none arrived")
    model: WindowModel | LowRankModel
    if spec.rank:
        factored = [n for n, p in frozen.items() if len(p.shape) == 2 and n not in window]
        model = LowRankModel(config, frozen, factored, window, spec.rank, seed)
    else:
        model = WindowModel(config, frozen, window, window_plan(spec), core_plan(spec))
    if spec.expand:
        model.expand()
    return model
