"""Generative distillation from a recipe (the registry entry's ``build``)."""

from __future__ import annotations

from fedfusion.config.recipe import Recipe, grow_rounds
from fedfusion.fusion.base import BuildTarget
from fedfusion.fusion.generative.method import GenerativeMethod
from fedfusion.models.samples import GenerativeConfig


def build(recipe: Recipe, target: BuildTarget, tiers: list[str]) -> GenerativeMethod:
    """Generative distillation for ``tiers``: each keeps the static slice at its ``fusion.widths`` as its own model
    (after ``fusion.grow_round`` rounds of the smallest slice, a slice of the grown target)."""
    f, g = recipe.fusion, recipe.generative
    return GenerativeMethod(
        target.model.config, {t: f.widths[t] for t in tiers}, target.initial.to_torch_state_dict(),
        GenerativeConfig(g.sample_fraction, g.temperature, g.server_steps, g.server_lr, g.server_batch, top_k=g.top_k,
                         device_state=g.device_state),
        seq_len=recipe.train.seq_len, population=recipe.population.num_clients, run_seed=recipe.seed,
        axes=tuple(f.axes) if f.axes else None, scale=f.scaler, grow_round=grow_rounds(recipe))
