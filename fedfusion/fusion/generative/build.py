"""Generative distillation from its recipe sections (the registry entry's ``build``)."""

from __future__ import annotations

from fedfusion.config.sections import FusionConfig, PopulationConfig, TrainConfig
from fedfusion.fusion.base import BuildTarget
from fedfusion.fusion.generative.config import GenerativeConfig
from fedfusion.fusion.generative.method import GenerativeMethod


def build(fusion: FusionConfig, generative: GenerativeConfig, train: TrainConfig, population: PopulationConfig,
          seed: int, target: BuildTarget, tiers: list[str]) -> GenerativeMethod:
    """Generative distillation for ``tiers``: each keeps the static slice at its ``fusion.widths`` as its own model
    (after ``fusion.grow_round`` rounds of the smallest slice, a slice of the grown target)."""
    f = fusion
    return GenerativeMethod(
        target.model.config, {t: f.widths[t] for t in tiers}, target.initial(), generative,
        seq_len=train.seq_len, population=population.num_clients, run_seed=seed,
        axes=tuple(f.axes) if f.axes else None, scale=f.scaler, grow_round=f.grow_rounds())
