"""A frozen target held as it travelled: every linear layer's matrix stays in its wire form (int8 / int4 codes with
float16 scales, or float16) and is made float32 one layer at a time, in the forward pass and again in backward, so
a device holds the narrow matrices plus one layer's float32 matrix, not a float32 copy of the target (what the
planner's ``frozen_dtype`` memory assumes). A trainable window of a matrix's coordinates
(:mod:`fedfusion.models.full_forward`) or a rank-r update (:mod:`fedfusion.models.low_rank`) rides on the layer
with the exact gradient of the loss. Every other tensor (embeddings, norms, biases, a tied head) is float32, as
usual. No Flower import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import init_empty_weights
from torch.nn.utils.parametrize import register_parametrization
from transformers import PretrainedConfig, PreTrainedModel

from fedfusion.models.build import config_aliases, full_state
from fedfusion.models.families import family_of
from fedfusion.models.slicing import scatter
from fedfusion.wire.quantize import Packed

Index = tuple[torch.Tensor | None, ...]


class _FrozenMatmul(torch.autograd.Function):
    """``x @ W.T`` for a :class:`FrozenLinear`'s matrix ``W`` (its window's ``values`` written in): ``W`` is rebuilt
    for backward instead of being kept, and the window's gradient is only the rows and columns it holds."""

    generate_vmap_rule = True  # torch.func: DP-SGD's per-example gradients (fedfusion.train.loop._vmapped_grads)

    @staticmethod
    def forward(x: torch.Tensor, values: torch.Tensor | None, layer: FrozenLinear) -> torch.Tensor:
        return torch.nn.functional.linear(x, layer.matrix(values))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, values, layer = inputs
        ctx.layer = layer
        ctx.save_for_backward(x, values)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, values = ctx.saved_tensors
        layer: FrozenLinear = ctx.layer
        grad_x = grad @ layer.matrix(values) if ctx.needs_input_grad[0] else None
        grad_values = None
        if ctx.needs_input_grad[1]:
            rows, cols = layer.window_index(grad.device)
            g = grad.reshape(-1, grad.shape[-1])
            xs = x.reshape(-1, x.shape[-1])
            g = g if rows is None else g.index_select(1, rows)
            xs = xs if cols is None else xs.index_select(1, cols)
            grad_values = (g.T @ xs).to(values.dtype)
        return grad_x, grad_values, None


def _on(index: Index, device: torch.device) -> Index:
    """``index`` on ``device`` (the same tuple when it is there already)."""
    if all(i is None or i.device == device for i in index):
        return index
    return tuple(None if i is None else i.to(device) for i in index)


def _plain(t: torch.Tensor) -> bool:
    """Whether ``t`` is an ordinary tensor, not a torch.func wrapper (DP-SGD's vmap batches the window's values)."""
    return not torch._C._functorch.is_functorch_wrapped_tensor(t)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` starts where ``b`` does; True for a tensor without storage of its own (a torch.func wrapper,
    under DP-SGD's vmap), which is then copied rather than risked."""
    try:
        return a.data_ptr() == b.data_ptr()
    except RuntimeError:
        return True


@dataclass(frozen=True)
class Slot:
    """Where a wrapper keeps a trainable tensor: read at each forward, so that :func:`torch.func.functional_call`
    on the wrapper (DP-SGD's per-example gradients) reaches the frozen layers that use it, and a deep copy of the
    wrapper follows its own parameters."""

    params: torch.nn.ParameterDict
    key: str

    def __call__(self) -> torch.Tensor:
        return self.params[self.key]


class FrozenLinear(torch.nn.Module):
    """A linear layer whose frozen matrix is kept as it travelled (a :class:`~fedfusion.wire.quantize.Packed`'s
    codes and scales as buffers, so ``.to()`` moves them), with an optional trainable window of its coordinates and
    an optional trainable rank-r update ``B @ A``."""

    codes: torch.Tensor
    scale: torch.Tensor | None

    def __init__(self, packed: Packed, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("codes", packed.data)
        self.register_buffer("scale", packed.scale)
        self.register_buffer("bias", bias)
        self.dims = packed.dims
        self._window: tuple[Slot, Index] | None = None  # not registered: the wrapper owns them
        self._fixed: torch.Tensor | None = None  # the window's coordinates read without gradient (see attach_window)
        self._low_rank: tuple[Slot, Slot] | None = None
        self._owned = False  # the matrix is this layer's own float32 copy (expand): the window is written into it

    def stored(self) -> Packed:
        """The matrix as it is held."""
        return Packed(self.codes, self.scale, self.dims)

    def expand(self) -> None:
        """Hold the matrix as float32, made once (for the round) instead of in every forward and backward pass: a
        device whose memory holds the float32 target trains faster, on the same values. The window's values are
        then written into this copy in place at each pass (they own those coordinates; no other one changes)."""
        if not self._owned:
            self.codes, self.scale, self._owned = self.stored().value().clone(), None, True

    def attach_window(self, values: Slot, index: Index, fixed: torch.Tensor | None = None) -> None:
        """Train ``values``, the coordinates ``index`` (rows, columns; None = all) of this matrix; where the mask
        ``fixed`` (shaped as ``values``) is True, the forward reads them without gradient (they train elsewhere)."""
        self._window = (values, (*index, None, None)[:2])
        self._fixed = fixed

    def attach_low_rank(self, a: Slot, b: Slot) -> None:
        """Add the trainable update ``b @ a`` to this matrix."""
        self._low_rank = (a, b)

    def window_index(self, device: torch.device) -> Index:
        """(rows, columns) of the window on ``device``, moved there once."""
        if self._window is None:
            return (None, None)
        values, index = self._window
        self._window = (values, _on(index, device))
        return self._window[1]

    def matrix(self, values: torch.Tensor | None) -> torch.Tensor:
        """The float32 matrix, with the window's ``values`` written in (no autograd: :class:`_FrozenMatmul`)."""
        w = self.stored().value()
        if values is None:
            return w
        if _same_storage(w, self.codes) and not (self._owned and _plain(values)):
            w = w.clone()  # a float32 base: never write into what was received (nor one copy per example, vmapped)
        scatter(w, self.window_index(w.device), values.detach().to(w.dtype), accumulate=False)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values: torch.Tensor | None = self._window[0]() if self._window is not None else None
        if values is not None and self._fixed is not None:
            values = without_grad(values, self._fixed)
        y = _FrozenMatmul.apply(x, values, self)
        if self._low_rank is not None:
            a, b = (slot() for slot in self._low_rank)
            y = y + (x @ a.T) @ b.T
        if self.bias is not None:
            y = y + self.bias
        return y


def frozen_target(config: PretrainedConfig, packed: dict[str, Packed]) -> PreTrainedModel:
    """A model of ``config`` holding ``packed`` (a wire state, tied aliases absent): each ``torch.nn.Linear`` whose
    matrix arrived becomes a :class:`FrozenLinear` keeping it packed; every other tensor is float32. Frozen
    (no tensor requires grad). ValueError naming a tensor the model lacks or one of its tensors that is missing.

    The model is built with its parameters on the meta device (buffers real), so no float32 copy of the target is
    ever allocated or randomly initialised: the device's peak is what the planner prices, from the first byte."""
    with init_empty_weights(include_buffers=False):
        model = family_of(config).build(config)
    aliases = config_aliases(config)  # not tied_aliases(model): parameters made empty this way are not tied
    replaced: set[str] = set()  # the tensors the FrozenLinear layers hold
    layers: list[str] = []
    for name, module in list(model.named_modules()):
        weight = f"{name}.weight"
        if isinstance(module, torch.nn.Linear) and weight in packed and weight not in aliases:
            bias = packed[f"{name}.bias"].value() if module.bias is not None and f"{name}.bias" in packed else None
            if module.bias is not None and bias is None:
                raise ValueError(f"frozen target: {name}.bias missing")
            model.set_submodule(name, FrozenLinear(packed[weight], bias))
            replaced |= {weight, f"{name}.bias"}
            layers.append(name)
    dense = {k: p.value() for k, p in packed.items() if k not in replaced}
    missing, unexpected = model.load_state_dict(full_state(dense, aliases), strict=False, assign=True)
    held = {f"{name}.{k}" for name in layers for k in ("codes", "scale", "bias")}
    stray = [k for k in missing if k not in held]
    if unexpected or stray:
        raise ValueError(f"frozen target: unexpected {sorted(unexpected)[:3]}, missing {sorted(stray)[:3]}")
    for alias, key in aliases.items():  # assign loads each key as its own Parameter: tie them again
        module, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(module), attr, model.get_parameter(key))
    return model.requires_grad_(False)


def as_packed(state: Mapping[str, Packed | torch.Tensor]) -> dict[str, Packed]:
    """``state`` with each plain tensor taken as it is (a float32 base kept float32)."""
    return {k: v if isinstance(v, Packed) else Packed(v) for k, v in state.items()}


def linear_of(model: torch.nn.Module, name: str) -> FrozenLinear | None:
    """The :class:`FrozenLinear` whose matrix is the tensor ``name``, if there is one."""
    if not name.endswith(".weight"):
        return None
    module = model.get_submodule(name.removesuffix(".weight"))
    return module if isinstance(module, FrozenLinear) else None


def without_grad(values: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
    """``values`` as they are, with no gradient reaching the coordinates where the mask ``fixed`` is True."""
    fixed = fixed.to(values.device)
    return torch.where(fixed, values.detach(), values)


class _Written(torch.nn.Module):
    """A parametrization of a frozen tensor: trainable ``values`` written into the coordinates ``index`` (all
    None: the whole tensor), recomputed at each access (so activation checkpointing's recompute sees them too)."""

    def __init__(self, values: Slot, index: Index, fixed: torch.Tensor | None = None) -> None:
        super().__init__()
        self._values = values  # the wrapper owns the parameter
        self._index = index
        self._fixed = fixed

    def forward(self, frozen: torch.Tensor) -> torch.Tensor:
        values = self._values() if self._fixed is None else without_grad(self._values(), self._fixed)
        if all(i is None for i in self._index):
            return values
        out = frozen.clone()
        self._index = _on(self._index, out.device)
        scatter(out, self._index, values, accumulate=False)
        return out


class _Added(torch.nn.Module):
    """A parametrization of a frozen matrix: plus the trainable update ``b @ a``."""

    def __init__(self, a: Slot, b: Slot) -> None:
        super().__init__()
        self._factors = (a, b)

    def forward(self, frozen: torch.Tensor) -> torch.Tensor:
        a, b = (slot() for slot in self._factors)
        return frozen + b @ a


class FrozenTargetModel(torch.nn.Module):
    """A trainable part (the subclass's parameters) on a :func:`frozen_target`: the target is not a submodule (its
    frozen tensors are no parameters of the wrapper) but moves with it. A matrix on a :class:`FrozenLinear` takes
    its trainable part there; any other tensor through a parametrization (:meth:`write`, :meth:`add`), tied
    copies included."""

    def __init__(self, config: PretrainedConfig, target: PreTrainedModel) -> None:
        super().__init__()
        self._target = [target]  # a list: not a submodule
        aliases = config_aliases(config)
        self._ties = {src: [src, *(a for a, s in aliases.items() if s == src)] for src in set(aliases.values())}

    def _apply(self, fn: Any, recurse: bool = True) -> FrozenTargetModel:
        super()._apply(fn, recurse)
        self._target[0]._apply(fn, recurse)
        return self

    def train(self, mode: bool = True) -> FrozenTargetModel:
        self._target[0].train(mode)  # dropout, where the target has any, follows the wrapper
        return super().train(mode)

    @property
    def device(self) -> torch.device:
        return self._target[0].device

    def target(self) -> PreTrainedModel:
        """The frozen target (for counting and evaluation)."""
        return self._target[0]

    def _parametrize(self, name: str, make: Callable[[], torch.nn.Module]) -> None:
        for each in self._ties.get(name, [name]):
            module, _, attr = each.rpartition(".")
            register_parametrization(self._target[0].get_submodule(module), attr, make(), unsafe=True)

    def write(self, name: str, values: Slot, index: Index, fixed: torch.Tensor | None = None) -> None:
        """Train ``values``, the coordinates ``index`` of the target's tensor ``name``; the coordinates of ``values``
        where the mask ``fixed`` is True are read without gradient (they train in another forward pass)."""
        layer = linear_of(self._target[0], name)
        if layer is not None:
            layer.attach_window(values, index, fixed)
        else:
            self._parametrize(name, lambda: _Written(values, index, fixed))

    def expand(self) -> None:
        """Hold every frozen matrix as float32 for the round (:meth:`FrozenLinear.expand`): the same values, no
        per-pass dequantisation; the planner prices it (``fedfusion plan``: "int8 target -> float32") where memory allows."""
        for module in self._target[0].modules():
            if isinstance(module, FrozenLinear):
                module.expand()

    def add(self, name: str, a: Slot, b: Slot) -> None:
        """Train the update ``b @ a`` of the target's matrix ``name``."""
        layer = linear_of(self._target[0], name)
        if layer is not None:
            layer.attach_low_rank(a, b)
        else:
            self._parametrize(name, lambda: _Added(a, b))

    def forward(self, **inputs: Any) -> Any:
        return self._target[0](**inputs)
