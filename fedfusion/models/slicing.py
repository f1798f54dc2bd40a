"""Width and depth slicing of a model into a genuine smaller model of its family, and selective averaging back.

A :class:`SlicePlan` lists, per axis, the units a client keeps; :mod:`fedfusion.models.families` says
for each family (Llama/Mistral/Qwen2, GPT-2, OPT, the GroupNorm CNN) which tensor dims belong to which
axis. Axes: ``heads`` (GQA-aware attention units), ``neurons`` (MLP), ``hidden`` (residual dims:
embeddings, norms, every projection's input dims, tied lm_head), ``depth`` (layers; the first and last
are always kept, the middle ones follow the policy) and ``channels`` (CNN GroupNorm groups). Every
layer keeps the same unit indices; a client's width applies to each axis the recipe slices.

Policies: ``static`` (HeteroFL prefix), ``rolling`` (FedRolex window, configurable stride),
``random`` (Federated Dropout, seeded), ``ordered`` (FjORD: the server sends the static prefix; the
client trains nested prefixes of it, see :mod:`fedfusion.train.ordered`), ``owned`` (a window fixed per client:
its start is the caller's ``offset``, which :func:`fedfusion.fusion.rounds.plan_round` derives from the client's
partition, so a client's private knowledge keeps landing in the same units instead of being overwritten
by whichever client rolls onto them next).

Activation scale: a slice keeping n of K units sums fewer terms wherever a tensor contracts over a
sliced axis (o_proj over heads, down_proj over neurons, every input projection over hidden dims, conv
over input channels). As in HeteroFL's scaler the sub-model computes ``(K/n) * sum over kept units``;
instead of a runtime scaler module that factor is folded into the extracted weights (multiplied on the
way out, divided on the way back; for the lm_head it sits in the final norm so tied embeddings stay
tied). The client therefore trains an ordinary Hugging Face model, the forward pass equals a scaled
sub-network exactly, and a width-1.0 slice is the full model bit for bit. ``SlicePlan.scale=False``
turns the scaler off.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch
from transformers import PretrainedConfig

from fedfusion.config.choices import POLICIES
from fedfusion.models.families import Dim, family_of
from fedfusion.wire.finite import all_finite

AXES = ("heads", "neurons", "hidden", "depth", "channels")
_FIELD = {"heads": "attn_units", "neurons": "neurons", "hidden": "hidden", "depth": "layers", "channels": "channels"}


@dataclass(frozen=True)
class SlicePlan:
    """Which units a client keeps, per axis: sorted indices, or None for an axis its family lacks.

    ``attn_units``: attention units (kv groups); ``neurons``: MLP neurons; ``hidden``: residual dims;
    ``layers``: kept layers (target indices, in order); ``channels``: CNN GroupNorm groups.
    ``scale``: fold the HeteroFL scaler into the weights (see the module docstring). ``grown``: the plan's
    units hold a small model grown into the target (:mod:`fedfusion.models.growth`): the family's growth factor
    instead (so extracting gives that small model back exactly). ``shared``: whether tensors on no sliced axis
    (embeddings, norms, with the hidden axis whole) belong to the slice; a full-forward window may leave them
    frozen.
    """

    attn_units: tuple[int, ...] | None = None
    neurons: tuple[int, ...] | None = None
    hidden: tuple[int, ...] | None = None
    layers: tuple[int, ...] | None = None
    channels: tuple[int, ...] | None = None
    scale: bool = True
    grown: bool = False
    shared: bool = True

    def units(self, axis: str) -> tuple[int, ...] | None:
        """The kept units of ``axis`` (a name of :data:`AXES`)."""
        return getattr(self, _FIELD[axis])

    @classmethod
    def from_assignment(cls, runs: dict[str, list[list[int]]], scale: bool = True, shared: bool = True) -> SlicePlan:
        """The plan :meth:`assignment` describes (as a message carries it); ValueError for an unknown field or a
        malformed run."""
        unknown = set(runs) - set(_FIELD.values())
        if unknown:
            raise ValueError(f"plan: unknown unit fields {sorted(unknown)}; use {', '.join(_FIELD.values())}")
        units = {}
        for name, spans in runs.items():
            if not all(isinstance(r, list) and len(r) == 2 and 0 <= r[0] <= r[1] for r in spans):
                raise ValueError(f"plan.{name}: runs must be [first, last] pairs, got {spans}")
            units[name] = tuple(u for first, last in spans for u in range(first, last + 1))
        return cls.of(units, scale=scale, shared=shared)

    @classmethod
    def of(cls, units: dict[str, tuple[int, ...]], scale: bool = True, shared: bool = True) -> SlicePlan:
        """A plan from its unit fields by name (absent: None)."""
        return cls(attn_units=units.get("attn_units"), neurons=units.get("neurons"), hidden=units.get("hidden"),
                   layers=units.get("layers"), channels=units.get("channels"), scale=scale, shared=shared)

    def assignment(self) -> dict[str, list[list[int]]]:
        """Every axis the plan holds, as inclusive runs (for the clients.jsonl assignment column)."""
        return {f.name: as_ranges(getattr(self, f.name)) for f in fields(self)
                if f.name in _FIELD.values() and getattr(self, f.name) is not None}


def as_ranges(units: tuple[int, ...]) -> list[list[int]]:
    """Sorted unit indices as inclusive [first, last] runs, e.g. (0, 1, 6, 7) -> [[0, 1], [6, 7]]."""
    runs: list[list[int]] = []
    for u in units:
        if runs and u == runs[-1][1] + 1:
            runs[-1][1] = u
        else:
            runs.append([u, u])
    return runs


def axis_sizes(config: PretrainedConfig) -> dict[str, int]:
    """Units per axis of ``config``'s family, e.g. {"heads": kv heads, "neurons": ..., "hidden": ..., "depth": layers}."""
    return family_of(config).sizes(config)


def units_kept(total: int, width: float) -> int:
    """HeteroFL's ceil(width * K), at least one unit."""
    return max(1, min(total, math.ceil(width * total - 1e-9)))


def rolling_step(total: int, stride: float) -> int:
    """Units the rolling window advances per round; one pass over the axis takes ceil(K / step) rounds."""
    return max(1, round(stride * total))


def _choose(total: int, n: int, policy: str, server_round: int, stride: float, offset: float,
            gen: torch.Generator) -> tuple[int, ...]:
    """n of ``total`` units under ``policy`` (sorted)."""
    if policy == "random":
        return tuple(sorted(torch.randperm(total, generator=gen)[:n].tolist()))
    start = 0
    if policy in ("rolling", "owned"):
        moved = (server_round - 1) * rolling_step(total, stride) if policy == "rolling" else 0
        start = (moved + round(offset * total)) % total
    return tuple(sorted((start + i) % total for i in range(n)))


def _layers(total: int, width: float, policy: str, server_round: int, stride: float, offset: float,
            gen: torch.Generator) -> tuple[int, ...]:
    """Depth: the first and last layer always, and ceil(width*L) - 2 of the middle ones under ``policy``."""
    if total <= 2:
        return tuple(range(total))
    middle = max(2, units_kept(total, width)) - 2
    chosen = _choose(total - 2, middle, policy, server_round, stride, offset, gen) if middle else ()
    return (0, *(1 + i for i in chosen), total - 1)


def plan_slice(
    config: PretrainedConfig, width: float, policy: str, server_round: int = 1, stride: float = 0.125,
    offset: float = 0.0, seed: int = 0, axes: Iterable[str] | None = None, scale: bool = True, skip: float = 0.0,
) -> SlicePlan:
    """The units a client of ``width`` keeps in ``server_round`` (1-based) under ``policy``.

    ``axes``: which axes to slice (None = the family's default: heads and neurons for Llama-style
    models, plus hidden for GPT-2/OPT, channels for the CNN); the others are kept whole.
    static / ordered: the first ceil(width*K) units (HeteroFL; FjORD's widest prefix). rolling: a window
    of the same length whose start advances by ``rolling_step(K, stride)`` units per round and wraps
    around (FedRolex, with the stride made configurable so a pass fits the round budget). ``offset`` (a
    fraction of the axis) shifts this client's window: 0 for every client is FedRolex's shared start;
    staggered offsets tile the axis. random: ceil(width*K) units drawn uniformly without replacement
    (Federated Dropout), from a generator seeded by ``seed``, which the caller makes distinct per client
    and round. Depth keeps the first and last layer and applies the policy to the middle ones.
    GPT-2/OPT keep ``heads x head_dim`` hidden dims (their attention width is the hidden width).

    ``skip`` (a fraction): the units are drawn from those after the first ``ceil(skip x K)`` of each sliced unit
    axis (the static slice of width ``skip``: a core every window adds), the window still ``ceil(width x K)`` long
    (at most what is left; none where the core holds the whole axis), so the core plus the window has one size every
    round. Not on ``depth`` (its first and last layers are kept anyway) nor ``hidden`` (no window slices it).
    """
    if not 0 <= skip < 1:
        raise ValueError(f"skip must be in [0, 1), got {skip}")
    if not 0 < width <= 1:
        raise ValueError(f"width must be in (0, 1], got {width}")
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
    family = family_of(config)
    axes = family.default_axes if axes is None else tuple(axes)
    family.check(config, axes)
    sizes = family.sizes(config)
    gen = torch.Generator().manual_seed(seed)
    kept: dict[str, tuple[int, ...]] = {}
    for axis in family.axes:  # fixed order: random draws repeat for the same seed and axes
        total = sizes[axis]
        if axis not in axes:
            kept[axis] = tuple(range(total))
        elif axis == "depth":
            kept[axis] = _layers(total, width, policy, server_round, stride, offset, gen)
        else:
            n = units_kept(total, width)
            if axis == "hidden" and family.hidden_follows_heads:
                n = len(kept["heads"]) * family.head_dim(config)
            first = units_kept(total, skip) if skip and axis != "hidden" else 0
            kept[axis] = tuple(first + u for u in _choose(total - first, min(n, total - first), policy, server_round,
                                                          stride, offset, gen)) if total > first else ()
    return SlicePlan.of({_FIELD[a]: units for a, units in kept.items()}, scale=scale)


def _check_plan(config: PretrainedConfig, plan: SlicePlan) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
    """(sizes, kept units) of every axis of the family; ValueError for a plan that does not fit ``config``."""
    family = family_of(config)
    sizes = family.sizes(config)
    kept = {}
    for axis in family.axes:
        units = plan.units(axis)
        if units is None:
            raise ValueError(f"plan: no {_FIELD[axis]!r} for a {family.name} model")
        if not units or list(units) != sorted(set(units)) or units[0] < 0 or units[-1] >= sizes[axis]:
            raise ValueError(f"plan.{_FIELD[axis]}: must be distinct sorted indices in [0, {sizes[axis]}), got {units}")
        kept[axis] = tuple(units)
    if family.hidden_follows_heads and len(kept["hidden"]) != len(kept["heads"]) * family.head_dim(config):
        raise ValueError(f"plan.hidden: a {family.name} model keeps heads x head_dim hidden dims")
    return sizes, kept


def sub_config(config: PretrainedConfig, plan: SlicePlan) -> PretrainedConfig:
    """The config of the smaller model a plan describes (same family; head_dim pinned where it is a setting)."""
    _, kept = _check_plan(config, plan)
    family = family_of(config)
    layers = kept.get("depth", ())
    return family.sub_config(config, {a: len(u) for a, u in kept.items()}, layers)


@dataclass(frozen=True)
class TensorSlice:
    """Where a target tensor's slice lives in the sub-model: its name there, the index of each leading
    dim (None = whole) and the folded scaler."""

    sub_name: str
    index: tuple[torch.Tensor | None, ...]
    scale: float


def _dim_index(dim: Dim, units: tuple[int, ...], size: int) -> torch.Tensor | None:
    if len(units) == size:  # sorted and distinct: the whole axis
        return None
    base = (torch.tensor(units).unsqueeze(1) * dim.block + torch.arange(dim.block)).flatten()
    return torch.cat([base + p * size * dim.block for p in range(dim.parts)]) if dim.parts > 1 else base


def _on_units(dims: Iterable[Dim | None]) -> bool:
    return any(d is not None and d.axis != "hidden" for d in dims)


def on_unit_axis(config: PretrainedConfig, name: str) -> bool:
    """Whether target tensor ``name`` lies on a unit axis (heads, neurons, channels), as a window of units holds
    it; embeddings and norms lie on the residual stream only (a plan's ``shared`` tensors)."""
    return _on_units(family_of(config).rule(name, config).dims)


def tensor_slices(names: Iterable[str], config: PretrainedConfig, plan: SlicePlan) -> dict[str, TensorSlice]:
    """For every target parameter the plan keeps: its :class:`TensorSlice` (dropped layers are absent)."""
    family = family_of(config)
    sizes, kept = _check_plan(config, plan)
    position = {layer: j for j, layer in enumerate(kept["depth"])} if "depth" in kept else {}
    grown = math.sqrt(sizes["hidden"] / len(kept["hidden"])) if plan.grown and "hidden" in kept else 1.0
    out = {}
    for name in names:
        sub_name = name
        match = family.layer_key.search(name) if family.layer_key is not None else None
        if match:
            layer = int(match.group(2))
            if layer not in position:
                continue
            sub_name = f"{name[:match.start(2)]}{position[layer]}{name[match.end(2):]}"
        rule = family.rule(name, config)
        index = tuple(None if d is None else _dim_index(d, kept[d.axis], sizes[d.axis]) for d in rule.dims)
        if not plan.shared and not _on_units(rule.dims):
            continue  # embeddings, norms: not a window's, even one that covers every unit
        if plan.scale:
            scale = math.prod(sizes[a] / len(kept[a]) for a in rule.contracts)
        else:
            scale = 1 / family.growth_factor(name, config, grown) if plan.grown else 1.0
        out[name] = TensorSlice(sub_name, index, scale)
    return out


def sub_scales(config: PretrainedConfig, plan: SlicePlan, names: Iterable[str]) -> dict[str, float]:
    """The folded scaler of every sub-model tensor that carries one (sub-model names; others are 1).

    Folding keeps the forward pass of HeteroFL's scaler but not its optimisation: a client that trains
    W' = s*W moves W by its step / s. A client that wants HeteroFL's steps gives these tensors a
    learning rate s times larger (Adam; s**2 for plain SGD).
    """
    return {sl.sub_name: sl.scale for sl in tensor_slices(names, config, plan).values() if sl.scale != 1.0}


def _take(t: torch.Tensor, index: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
    for dim, idx in enumerate(index):
        if idx is not None:
            t = t.index_select(dim, idx)
    return t


def sliced_shape(shape: torch.Size, index: tuple[torch.Tensor | None, ...]) -> tuple[int, ...]:
    padded = [*index, *[None] * (len(shape) - len(index))]
    return tuple(n if idx is None else len(idx) for n, idx in zip(shape, padded))


def extract(state: dict[str, torch.Tensor], config: PretrainedConfig, plan: SlicePlan) -> dict[str, torch.Tensor]:
    """The sub-model's state dict (new tensors; the target is not touched). Differentiable, so it also
    gives nested sub-models of a model's live parameters (see :mod:`fedfusion.train.ordered`)."""
    out = {}
    for name, sl in tensor_slices(state, config, plan).items():
        sliced = _take(state[name], sl.index)
        out[sl.sub_name] = (sliced * sl.scale if sl.scale != 1.0 else sliced.clone()).contiguous()
    return out


def scatter(dst: torch.Tensor, index: tuple[torch.Tensor | None, ...], src: torch.Tensor, accumulate: bool) -> None:
    """dst[slice] (+)= src for the slice ``index`` describes."""
    sliced = {d: idx for d, idx in enumerate(index) if idx is not None}
    if not sliced:
        if accumulate:
            dst += src
        else:
            dst.copy_(src)
    elif len(sliced) == 1:
        [(d, idx)] = sliced.items()
        (dst.index_add_ if accumulate else dst.index_copy_)(d, idx, src)
    else:  # several sliced dims: broadcast index tensors over the leading dims
        last = max(sliced)
        mesh = []
        for d in range(last + 1):
            idx = sliced[d] if d in sliced else torch.arange(dst.shape[d])
            mesh.append(idx.view(*([1] * d), -1, *([1] * (last - d))))
        dst.index_put_(tuple(mesh), src, accumulate=accumulate)


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


def stage_update(target: dict[str, torch.Tensor], config: PretrainedConfig, sub: dict[str, torch.Tensor],
                 plan: SlicePlan) -> list[tuple[str, tuple[torch.Tensor | None, ...], torch.Tensor]]:
    """A client's trained sub-model as (target tensor, slice index, value with the scaler undone); a mismatched
    key or shape, or NaN/Inf, raises ValueError naming it."""
    slices = tensor_slices(target, config, plan)
    expected = {sl.sub_name: (name, sl) for name, sl in slices.items()}
    if set(sub) != set(expected):
        missing, extra = set(expected) - set(sub), set(sub) - set(expected)
        raise ValueError(f"update keys differ from the plan's sub-model: missing {sorted(missing)[:3]}, "
                         f"extra {sorted(extra)[:3]}")
    staged = []
    for sub_name, value in sub.items():
        name, sl = expected[sub_name]
        shape = sliced_shape(target[name].shape, sl.index)
        if tuple(value.shape) != shape:
            raise ValueError(f"{sub_name}: shape {tuple(value.shape)} does not match its slice {shape}")
        if not all_finite(value):
            raise ValueError(f"{sub_name}: update holds NaN or Inf")
        # x / 1.0 is x exactly: no copy of an unscaled slice
        staged.append((name, sl.index, value.float() / sl.scale if sl.scale != 1.0 else value.float()))
    return staged


class SelectiveAverager:
    """Folds client sub-models into the target, each coordinate over the clients whose slice held it.

    ``mean`` (default) streams replies into per-coordinate sums, so memory is one target whatever the number of
    clients (the counts are each client's slice index and weight, made into a tensor one target tensor at a time),
    and client weights apply. ``median`` and ``trimmed_mean`` (dropping
    ``trim`` of the values at each end) resist a few wild updates; they keep every client's slice until
    :meth:`result` (memory O(clients x target)) and ignore weights. A coordinate no client held (an
    unsliced unit, a dropped layer) keeps its old value.
    """

    def __init__(self, target: dict[str, torch.Tensor], config: PretrainedConfig, rule: str = "mean",
                 trim: float = 0.2) -> None:
        if rule not in AGGREGATES:
            raise ValueError(f"aggregate {rule!r} is not one of {', '.join(AGGREGATES)}")
        if not 0 <= trim < 0.5:
            raise ValueError(f"trim must be in [0, 0.5), got {trim}")
        self.target, self.config, self.rule, self.trim = target, config, rule, trim
        self.sums = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in target.items()} if rule == "mean" else {}
        # per target tensor, each client's slice index and weight: the counts are made from these one tensor at a time
        # (:meth:`count`), never a second target-sized tensor beside the sums
        self.holders: dict[str, list[tuple[tuple[torch.Tensor | None, ...], float]]] = {k: [] for k in target}
        self.kept: list[dict[str, tuple[tuple[torch.Tensor | None, ...], torch.Tensor]]] = []
        self.clients = 0
        self.done: dict[str, torch.Tensor] | None = None  # the result, once taken (mean: it lives in the sums)

    def add(self, sub: dict[str, torch.Tensor], plan: SlicePlan, weight: float = 1.0) -> None:
        """Fold one client's trained sub-model in; a mismatched key or shape, or NaN/Inf, raises ValueError
        before anything is added, so a bad update never touches the sums."""
        if self.done is not None:
            raise RuntimeError("this round's average was already taken (result()): fold the reply into a new averager")
        staged = stage_update(self.target, self.config, sub, plan)
        if self.rule != "mean":  # robust rules keep the slices and ignore weights
            self.kept.append({name: (index, value) for name, index, value in staged})
            weight = 1.0
        for name, index, value in staged:
            if self.rule == "mean":
                scatter(self.sums[name], index, weight * value, accumulate=True)
            self.holders[name].append((index, weight))
        self.clients += 1

    def add_sum(self, sums: dict[str, torch.Tensor]) -> None:
        """Add a sum of weighted values whose clients :meth:`add` already counted (their starting values, at the same
        weights): secure aggregation's unmasked sum of the clients' changes (:mod:`fedfusion.wire.secagg`), which no
        client's own update can be read from. ``mean`` only; a key the target lacks or a wrong shape raises."""
        if self.rule != "mean":
            raise ValueError(f"a sum over clients averages; aggregate {self.rule!r} needs each client's values")
        if self.done is not None:
            raise RuntimeError("this round's average was already taken (result()): add the sum before it")
        for name, value in sums.items():
            if name not in self.sums or self.sums[name].shape != value.shape:
                raise ValueError(f"{name}: not a target tensor of shape {tuple(value.shape)}")
        for name, value in sums.items():
            self.sums[name] += value

    def count(self, name: str) -> torch.Tensor:
        """Per coordinate of target tensor ``name``, the summed weight of the clients whose slice held it (float32,
        made anew on each call from the clients' slice indices, in the order they were added)."""
        out = torch.zeros_like(self.target[name], dtype=torch.float32)
        for index, weight in self.holders[name]:
            scatter(out, index, torch.full(sliced_shape(out.shape, index), weight, dtype=torch.float32), accumulate=True)
        return out

    def coverage(self) -> float:
        """Fraction of target coordinates that at least one client updated."""
        held = sum(int((self.count(name) > 0).sum()) for name in self.target)
        return held / sum(t.numel() for t in self.target.values())

    def held(self) -> dict[str, torch.Tensor]:
        """Per target tensor, which coordinates at least one client updated (bool)."""
        return {name: self.count(name) > 0 for name in self.target}

    def _robust(self, name: str) -> torch.Tensor:
        stack = torch.full((len(self.kept), *self.target[name].shape), float("nan"))
        for i, client in enumerate(self.kept):
            if name in client:  # absent: this client's plan dropped the layer
                index, value = client[name]
                scatter(stack[i], index, value, accumulate=False)
        return _robust_reduce(stack, self.rule, self.trim)

    def result(self) -> dict[str, torch.Tensor]:
        """The new target state dict. ``mean`` computes it in the sums' own storage (one target-sized copy fewer
        at the round's peak); the averager is then done: it takes no more replies and gives this result again."""
        if self.done is not None:
            return self.done
        out = {}
        for name, old in self.target.items():
            count = self.count(name)
            if not self.clients or not bool((count > 0).any()):
                out[name] = old.clone()
                continue
            if self.rule == "mean":
                value = self.sums[name].div_(count.clamp_min(1e-12))
                out[name] = torch.where(count > 0, value, old.float(), out=value).to(old.dtype)
            else:
                out[name] = torch.where(count > 0, self._robust(name), old.float()).to(old.dtype)
        self.done = out
        return out
