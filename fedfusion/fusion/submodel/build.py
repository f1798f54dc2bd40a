"""Width slicing from its recipe sections (the registry entry's ``build``)."""

from __future__ import annotations

from fedfusion.config.sections import FusionConfig
from fedfusion.fusion.base import BuildTarget
from fedfusion.fusion.outer import OuterConfig
from fedfusion.fusion.rounds import fusion_wire
from fedfusion.fusion.submodel.method import SubModelMethod


def build(fusion: FusionConfig, seed: int, target: BuildTarget, tiers: list[str]) -> SubModelMethod:
    """Width slicing for ``tiers`` at their ``fusion.widths`` (in their own or the full forward pass, after
    ``fusion.grow_round`` rounds of the smallest slice)."""
    f = fusion
    return SubModelMethod(
        target.model.config, {t: f.widths[t] for t in tiers}, target.initial(), policy=f.policy,
        stride=f.stride, stagger=f.stagger and f.policy == "rolling", run_seed=seed, aggregate=f.aggregate,
        trim=f.trim, axes=tuple(f.axes) if f.axes else None, scale=f.scaler,
        ordered_ladder=tuple(f.ordered_ladder) if f.ordered_ladder else None, ordered_distill=f.ordered_distill,
        wire=fusion_wire(f), outer=OuterConfig(f.outer, f.outer_lr, f.outer_momentum), forward=f.forward,
        frozen=f.frozen_dtype, window_shared=f.window_shared, grow_round=f.grow_rounds(),
        window_widths={t: f.window_widths[t] for t in tiers if t in f.window_widths} or None,
        window_rank=f.window_rank, window_core=f.window_core, core_forward=f.core_forward,
        outside_core=f.window_outside_core, lr_power=f.window_lr_power)
