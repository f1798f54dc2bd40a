"""Width slicing of a Llama-family model into a genuine smaller model, and selective averaging back.

Units sliced:
- **attention**: whole key/value groups (GQA-aware). A unit is one kv head together with the
  ``num_heads / num_kv_heads`` query heads that attend through it; for plain multi-head attention a
  unit is one head. q/k/v rows and o_proj columns of the kept units are taken.
- **MLP**: intermediate neurons (rows of gate/up, columns of down).

Embeddings, norms and lm_head stay whole. Every layer uses the same unit indices.

Activation scale: a slice keeping n of K units sums fewer terms in o_proj / down_proj. As in HeteroFL's
scaler, the sub-model computes ``(K/n) * sum over kept units``; instead of a runtime scaler module we fold
that factor into the extracted o_proj / down_proj weights (multiplied by K/n on the way out, divided on
the way back). The client therefore trains an ordinary ``LlamaForCausalLM``, the forward pass equals a
scaled sub-network exactly, and a width-1.0 slice is the full model bit for bit.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from transformers import LlamaConfig

POLICIES = ("static", "rolling", "random")

_LAYER = re.compile(r"\.layers\.\d+\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")


@dataclass(frozen=True)
class SlicePlan:
    """Which units a client keeps: sorted attention-unit (kv group) and MLP-neuron indices."""

    attn_units: tuple[int, ...]
    neurons: tuple[int, ...]


def as_ranges(units: tuple[int, ...]) -> list[list[int]]:
    """Sorted unit indices as inclusive [first, last] runs, e.g. (0, 1, 6, 7) -> [[0, 1], [6, 7]]."""
    runs: list[list[int]] = []
    for u in units:
        if runs and u == runs[-1][1] + 1:
            runs[-1][1] = u
        else:
            runs.append([u, u])
    return runs


def axis_sizes(config: LlamaConfig) -> tuple[int, int]:
    """(number of attention units = kv heads, number of MLP neurons)."""
    return config.num_key_value_heads, config.intermediate_size


def units_kept(total: int, width: float) -> int:
    """HeteroFL's ceil(width * K), at least one unit."""
    return max(1, min(total, math.ceil(width * total - 1e-9)))


def _window(total: int, width: float, start: int) -> tuple[int, ...]:
    n = units_kept(total, width)
    return tuple(sorted((start + i) % total for i in range(n)))


def rolling_step(total: int, stride: float) -> int:
    """Units the rolling window advances per round; one pass over the axis takes ceil(K / step) rounds."""
    return max(1, round(stride * total))


def plan_slice(
    config: LlamaConfig, width: float, policy: str, server_round: int = 1, stride: float = 0.125,
    offset: float = 0.0, seed: int = 0,
) -> SlicePlan:
    """The units a client of ``width`` keeps in ``server_round`` (1-based) under ``policy``.

    static: the first ceil(width*K) units (HeteroFL). rolling: a window of the same length whose start
    advances by ``rolling_step(K, stride)`` units per round and wraps around (FedRolex, with the stride
    made configurable so a pass fits the round budget). ``offset`` (a fraction of the axis) shifts this
    client's window: 0 for every client is FedRolex's shared start; staggered offsets tile the axis.
    random: ceil(width*K) units drawn uniformly without replacement (Federated Dropout), from a generator
    seeded by ``seed``, which the caller makes distinct per client and round.
    """
    if not 0 < width <= 1:
        raise ValueError(f"width must be in (0, 1], got {width}")
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
    plans = []
    gen = torch.Generator().manual_seed(seed)
    for total in axis_sizes(config):
        if policy == "random":
            plans.append(tuple(sorted(torch.randperm(total, generator=gen)[: units_kept(total, width)].tolist())))
            continue
        start = 0 if policy == "static" else ((server_round - 1) * rolling_step(total, stride) + round(offset * total)) % total
        plans.append(_window(total, width, start))
    return SlicePlan(attn_units=plans[0], neurons=plans[1])


def _head_dim(config: LlamaConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sub_config(config: LlamaConfig, plan: SlicePlan) -> LlamaConfig:
    """The config of the smaller model a plan describes (head_dim pinned so heads keep their size)."""
    group = config.num_attention_heads // config.num_key_value_heads
    sub = LlamaConfig.from_dict(config.to_dict())
    sub.head_dim = _head_dim(config)
    sub.num_key_value_heads = len(plan.attn_units)
    sub.num_attention_heads = len(plan.attn_units) * group
    sub.intermediate_size = len(plan.neurons)
    return sub


def _rows(units: tuple[int, ...], block: int) -> torch.Tensor:
    return torch.cat([torch.arange(u * block, (u + 1) * block) for u in units])


def param_index(
    name: str, config: LlamaConfig, plan: SlicePlan
) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
    """(row index, column index, weight factor) of ``name``'s slice; None = the whole dimension.

    The factor is the scaler folded into o_proj / down_proj (see module docstring).
    """
    match = _LAYER.search(name)
    if not match:
        return None, None, 1.0
    _, proj, _ = match.groups()
    d = _head_dim(config)
    group = config.num_attention_heads // config.num_key_value_heads
    n_attn, n_mlp = axis_sizes(config)
    if proj == "q_proj":
        return _rows(plan.attn_units, group * d), None, 1.0
    if proj in ("k_proj", "v_proj"):
        return _rows(plan.attn_units, d), None, 1.0
    if proj == "o_proj":
        scale = n_attn / len(plan.attn_units)
        return (None, _rows(plan.attn_units, group * d), scale) if name.endswith("weight") else (None, None, 1.0)
    if proj in ("gate_proj", "up_proj"):
        return torch.tensor(plan.neurons), None, 1.0
    if proj == "down_proj":
        scale = n_mlp / len(plan.neurons)
        return (None, torch.tensor(plan.neurons), scale) if name.endswith("weight") else (None, None, 1.0)
    raise ValueError(f"parameter {name!r}: unknown projection {proj!r} for width slicing")


def _take(t: torch.Tensor, rows: torch.Tensor | None, cols: torch.Tensor | None) -> torch.Tensor:
    if rows is not None:
        t = t.index_select(0, rows)
    if cols is not None:
        t = t.index_select(1, cols)
    return t


def extract(
    state: dict[str, torch.Tensor], config: LlamaConfig, plan: SlicePlan
) -> dict[str, torch.Tensor]:
    """The sub-model's state dict (new tensors; the target is not touched)."""
    out = {}
    for name, tensor in state.items():
        rows, cols, scale = param_index(name, config, plan)
        sliced = _take(tensor, rows, cols)
        out[name] = (sliced * scale if scale != 1.0 else sliced.clone()).contiguous()
    return out


AGGREGATES = ("mean", "median", "trimmed_mean")


def _robust_reduce(stack: torch.Tensor, rule: str, trim: float) -> torch.Tensor:
    """Coordinate-wise median or trimmed mean over dim 0, ignoring NaN (= client did not hold it)."""
    if rule == "median":
        return torch.nanmedian(stack, dim=0).values
    ordered, _ = torch.sort(stack, dim=0)  # NaN sorts last
    held = (~torch.isnan(stack)).sum(0)
    cut = torch.floor(trim * held)
    rank = torch.arange(stack.shape[0]).view(-1, *([1] * (stack.dim() - 1)))
    keep = (rank >= cut) & (rank < held - cut)
    return torch.where(keep, ordered, 0.0).sum(0) / keep.sum(0).clamp_min(1)


class SelectiveAverager:
    """Folds client sub-models into the target, each coordinate over the clients whose slice held it.

    ``mean`` (default) streams replies into per-coordinate sums and counts, so memory is O(target) and
    client weights apply. ``median`` and ``trimmed_mean`` (dropping ``trim`` of the values at each end)
    resist a few wild updates; they keep every client's slice until :meth:`result` (memory O(clients x
    target)) and ignore weights. A coordinate no client held keeps its old value.
    """

    def __init__(self, target: dict[str, torch.Tensor], config: LlamaConfig, rule: str = "mean",
                 trim: float = 0.2) -> None:
        if rule not in AGGREGATES:
            raise ValueError(f"aggregate {rule!r} is not one of {', '.join(AGGREGATES)}")
        if not 0 <= trim < 0.5:
            raise ValueError(f"trim must be in [0, 0.5), got {trim}")
        self.target, self.config, self.rule, self.trim = target, config, rule, trim
        self.sums = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in target.items()} if rule == "mean" else {}
        self.counts = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in target.items()}
        self.kept: list[dict[str, tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]]] = []
        self.clients = 0

    def add(self, sub: dict[str, torch.Tensor], plan: SlicePlan, weight: float = 1.0) -> None:
        """Fold one client's trained sub-model in; a mismatched key or shape, or NaN/Inf, raises ValueError
        before anything is added, so a bad update never touches the sums."""
        if set(sub) != set(self.target):
            missing, extra = set(self.target) - set(sub), set(sub) - set(self.target)
            raise ValueError(f"update keys differ from the target: missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]}")
        staged = []
        for name, value in sub.items():
            rows, cols, scale = param_index(name, self.config, plan)
            expected = _take(self.target[name], rows, cols).shape
            if value.shape != expected:
                raise ValueError(f"{name}: shape {tuple(value.shape)} does not match its slice {tuple(expected)}")
            if not torch.isfinite(value).all():
                raise ValueError(f"{name}: update holds NaN or Inf")
            staged.append((name, rows, cols, value.float() / scale))
        if self.rule != "mean":  # robust rules keep the slices and ignore weights
            self.kept.append({name: (rows, cols, value) for name, rows, cols, value in staged})
            weight = 1.0
        for name, rows, cols, value in staged:
            if self.rule == "mean":
                self._scatter_add(self.sums[name], rows, cols, weight * value)
            self._scatter_add(self.counts[name], rows, cols, torch.full_like(value, weight))
        self.clients += 1

    @staticmethod
    def _scatter_add(dst: torch.Tensor, rows: torch.Tensor | None, cols: torch.Tensor | None, src: torch.Tensor) -> None:
        # A parameter is sliced along at most one axis (rows of q/k/v/gate/up, columns of o/down).
        if rows is not None:
            dst.index_add_(0, rows, src)
        elif cols is not None:
            dst.index_add_(1, cols, src)
        else:
            dst += src

    def coverage(self) -> float:
        """Fraction of target coordinates that at least one client updated."""
        held = sum(int((c > 0).sum()) for c in self.counts.values())
        return held / sum(c.numel() for c in self.counts.values())

    def _robust(self, name: str) -> torch.Tensor:
        stack = torch.full((len(self.kept), *self.target[name].shape), float("nan"))
        for i, client in enumerate(self.kept):
            rows, cols, value = client[name]
            if rows is not None:
                stack[i].index_copy_(0, rows, value)
            elif cols is not None:
                stack[i].index_copy_(1, cols, value)
            else:
                stack[i] = value
        return _robust_reduce(stack, self.rule, self.trim)

    def result(self) -> dict[str, torch.Tensor]:
        """The new target state dict."""
        out = {}
        for name, old in self.target.items():
            count = self.counts[name]
            if not self.clients:
                value = old.float()
            elif self.rule == "mean":
                value = self.sums[name] / count.clamp_min(1e-12)
            else:
                value = self._robust(name)
            out[name] = torch.where(count > 0, value, old.float()).to(old.dtype)
        return out
