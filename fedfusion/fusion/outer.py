"""Server-side outer optimizers: a damped step on the round's aggregated change (plain torch, no Flower).

The fold of a round gives ``new``; the change ``new - old`` is a pseudo-gradient step of size 1. An outer
optimizer takes that change as its (negative) gradient and steps the target itself: FedAvgM (heavy-ball
momentum), DiLoCo's Nesterov momentum, or FedAdam. Only coordinates some client held this round move and
update their optimizer state; a coordinate nobody trained keeps its value and its momentum untouched while it
sits out. Its momentum is neither decayed nor applied in those rounds; the next round that holds it again
applies that (possibly old) momentum in full.

``none`` returns the fold as it is (plain averaging), which is what every method did before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedfusion.config.choices import OUTER_METHODS
from fedfusion.fusion.state import pack_tensors, unpack_tensors


@dataclass(frozen=True)
class OuterConfig:
    """An outer optimizer's settings; ``lr`` 1 with no momentum is plain averaging."""

    method: str = "none"
    lr: float = 1.0
    momentum: float = 0.9  # avgm / nesterov; adam's beta1
    beta2: float = 0.99  # adam
    eps: float = 1e-6  # adam (FedAdam's tau); small, since a round's change is ~lr x gradient

    def __post_init__(self) -> None:
        if self.method not in OUTER_METHODS:
            raise ValueError(f"outer method {self.method!r} is not one of {', '.join(OUTER_METHODS)}")
        if not self.lr > 0:
            raise ValueError(f"outer lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1 or not 0 <= self.beta2 < 1:
            raise ValueError(f"outer momentum and beta2 must be in [0, 1), got {self.momentum}, {self.beta2}")
        if not self.eps > 0:
            raise ValueError(f"outer eps must be > 0, got {self.eps}")


class OuterOptimizer:
    """Steps the target on each round's aggregated change, per coordinate over what clients held."""

    def __init__(self, config: OuterConfig) -> None:
        self.config = config
        self.state: dict[str, dict[str, torch.Tensor]] = {}  # tensor name -> buffers
        self.steps = 0

    def step(self, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor],
             held: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The next target from ``old`` and the round's fold ``new``; ``held`` marks (bool, per tensor) the
        coordinates some client trained (None: all); coordinates nobody held keep their ``old`` values, integer
        tensors are taken from ``new``."""
        c = self.config
        if c.method == "none":
            return new
        self.steps += 1
        out = {}
        for name, value in new.items():
            mask = None if held is None else held.get(name)
            if not value.is_floating_point():
                out[name] = value
                continue
            if mask is not None and not bool(mask.any()):
                out[name] = old[name]
                continue
            base = old[name].float()
            delta = value.float() - base  # the pseudo-gradient is -delta
            buffers = self.state.setdefault(name, {"m": torch.zeros_like(base)})
            m = buffers["m"]
            where = torch.ones_like(base, dtype=torch.bool) if mask is None else mask
            if c.method == "adam":
                v = buffers.setdefault("v", torch.zeros_like(base))
                m_new = c.momentum * m + (1 - c.momentum) * delta
                v_new = c.beta2 * v + (1 - c.beta2) * delta * delta
                stepped = base + c.lr * m_new / (v_new.sqrt() + c.eps)
                buffers["v"] = torch.where(where, v_new, v)
            else:
                m_new = c.momentum * m + delta
                direction = delta + c.momentum * m_new if c.method == "nesterov" else m_new
                stepped = base + c.lr * direction
            buffers["m"] = torch.where(where, m_new, m)
            out[name] = torch.where(where, stepped, base).to(value.dtype)
        return out

    def state_dict(self) -> dict:
        """Step count and buffers (safetensors, base64): JSON-able, for checkpoints."""
        flat = {f"{name}\t{buffer}": t for name, bufs in self.state.items() for buffer, t in bufs.items()}
        return {"steps": self.steps, "buffers": pack_tensors(flat) if flat else ""}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`."""
        self.steps = int(state["steps"])
        self.state = {}
        for key, tensor in (unpack_tensors(state["buffers"]) if state["buffers"] else {}).items():
            name, buffer = key.split("\t")
            self.state.setdefault(name, {})[buffer] = tensor
