"""Route a Hugging Face Llama's ``nn.Linear`` layers through the unit engine (forward, input and weight gradient).

Each group of linear layers that reads the same input is one fused GEMM: ``[q|k|v]`` and ``[gate|up]`` (the
first member called computes the whole group, the others take their slice), ``o``, ``down`` and ``lm_head``
alone. Per group a custom ``autograd.Function`` runs

- forward: ``Y = X W^T`` (one phase),
- backward: ``dX = dY W`` and ``dW = dY^T X`` (one phase, both GEMMs in one message per device; with the
  engine's ``accumulate`` the devices sum ``dW`` over the step's micro-batches and only the last micro-batch to
  reach the layer gets it: the others return no weight gradient),

so attention cores, norms, embeddings, the loss and the optimizer stay on the server, and the parameters stay
the same ``nn.Parameter`` objects (state dict names and optimizers are untouched).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fedfusion.units.engine import UnitEngine
from fedfusion.units.messages import Gemm, Operand

MLP_GROUPS = (("gate_proj", "up_proj"), ("down_proj",))
ATTENTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",))


class _UnitLinear(torch.autograd.Function):
    """``X [W_1; ...; W_g]^T`` through units; gradients through units too."""

    @staticmethod
    def forward(ctx: Any, engine: UnitEngine, name: str, version: int, x2d: torch.Tensor,
                *weights: torch.Tensor) -> torch.Tensor:
        w = torch.cat(weights, 0) if len(weights) > 1 else weights[0]
        (y,) = engine.phase([Gemm(Operand("X", x2d), Operand(name, w, t=True, version=version))])
        assert y is not None  # a forward product is never a running sum
        ctx.engine, ctx.name, ctx.version = engine, name, version
        ctx.save_for_backward(x2d, *weights)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2d, *weights = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[3], any(ctx.needs_input_grad[4:])
        dy = dy.contiguous()
        w = torch.cat(weights, 0) if len(weights) > 1 else weights[0]
        gemms = []
        if need_x:
            gemms.append(Gemm(Operand("dY", dy), Operand(ctx.name, w, version=ctx.version)))
        if need_w:
            gemms.append(Gemm(Operand("dY", dy, t=True), Operand("X", x2d), sums=f"{ctx.name}@{ctx.version}"))
        outs = ctx.engine.phase(gemms) if gemms else []
        dx = outs.pop(0) if need_x else None
        dws: list[torch.Tensor | None] = [None] * len(weights)
        if need_w and outs[0] is not None:
            dws = list(outs[0].split([wi.shape[0] for wi in weights], 0))
        return (None, None, None, dx, *dws)


@dataclass(eq=False)
class UnitGroup:
    """Linear layers that read the same input, computed as one fused GEMM."""

    engine: UnitEngine
    members: list[nn.Linear]
    name: str = "W"  # unique per group: names the weight blocks devices may cache
    # per thread (micro-batches in flight run one thread each): the fused GEMM's other members' outputs for input x,
    # so a sibling layer reading the same x takes its part instead of computing the GEMM again
    cache: dict[int, tuple[torch.Tensor, dict[int, torch.Tensor]]] = field(default_factory=dict)

    def compute(self, x: torch.Tensor) -> list[torch.Tensor]:
        x2d = x.reshape(-1, x.shape[-1])
        weights = [m.weight for m in self.members]
        version = sum(w._version for w in weights)  # bumped by every in-place update (the optimizer's step)
        y = _UnitLinear.apply(self.engine, self.name, version, x2d, *weights)
        outs = []
        for m, part in zip(self.members, y.split([m.out_features for m in self.members], dim=1)):
            part = part.contiguous().reshape(*x.shape[:-1], m.out_features)
            outs.append(part if m.bias is None else part + m.bias)  # a bias is added on the server
        return outs


class UnitLinear(nn.Module):
    """Stands in for one ``nn.Linear`` of a group; holds the same parameters."""

    def __init__(self, original: nn.Linear, group: UnitGroup, index: int) -> None:
        super().__init__()
        self.weight = original.weight
        self.bias = original.bias
        self.in_features, self.out_features = original.in_features, original.out_features
        self.original = [original]  # a list so it is not a submodule (no duplicate parameters)
        self.group, self.index = group, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        thread = threading.get_ident()
        cache = self.group.cache.get(thread)
        if cache is not None and cache[0] is x and self.index in cache[1]:
            out = cache[1].pop(self.index)
            if not cache[1]:
                del self.group.cache[thread]
            return out
        outs = self.group.compute(x)
        rest = {i: o for i, o in enumerate(outs) if i != self.index}
        if rest:
            self.group.cache[thread] = (x, rest)
        else:
            self.group.cache.pop(thread, None)
        return outs[self.index]


@dataclass
class Installed:
    """What ``install`` replaced, so ``remove`` can put the original layers back."""

    swaps: list[tuple[nn.Module, str, nn.Linear]] = field(default_factory=list)
    groups: list[UnitGroup] = field(default_factory=list)

    def remove(self) -> None:
        for parent, name, original in self.swaps:
            setattr(parent, name, original)
        self.swaps.clear()


def install(model: nn.Module, engine: UnitEngine, mode: str = "mlp") -> Installed:
    """Route the model's MLP (``mode="mlp"``) or all linear layers incl. ``lm_head`` (``mode="all"``) via units."""
    if mode not in ("mlp", "all"):
        raise ValueError(f"mode must be 'mlp' or 'all', got {mode!r}")
    specs = MLP_GROUPS + (ATTENTION_GROUPS if mode == "all" else ())
    done = Installed()
    parents = [m for m in model.modules()]
    for parent in parents:
        for names in specs:
            if all(isinstance(getattr(parent, n, None), nn.Linear) for n in names):
                _swap(parent, names, engine, done)
    head = getattr(model, "lm_head", None)
    if mode == "all" and isinstance(head, nn.Linear):
        _swap(model, ("lm_head",), engine, done)
    if not done.groups:
        raise ValueError("no linear layer of a Llama-style MLP or attention block found")
    return done


def _swap(parent: nn.Module, names: tuple[str, ...], engine: UnitEngine, done: Installed) -> None:
    originals = [getattr(parent, n) for n in names]
    group = UnitGroup(engine, originals, name=f"W{len(done.groups)}")
    for i, (name, lin) in enumerate(zip(names, originals)):
        setattr(parent, name, UnitLinear(lin, group, i))
        done.swaps.append((parent, name, lin))
    done.groups.append(group)
