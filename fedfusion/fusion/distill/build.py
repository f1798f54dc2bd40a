"""Distillation fusion from a recipe (the registry entry's ``build``)."""

from __future__ import annotations

from fedfusion.config.recipe import Recipe
from fedfusion.data.population import data_spec, pooled_held_out
from fedfusion.data.text import load_tokenizer
from fedfusion.fusion.base import BuildTarget
from fedfusion.fusion.distill.method import DistillMethod, Family
from fedfusion.train.transfer import distill_families, transfer_text


def build(recipe: Recipe, target: BuildTarget, tiers: list[str]) -> DistillMethod:
    """Distillation fusion for ``tiers``: one global model per small family, a transfer set no client owns; every
    family is scored each round on the same pooled held-out text as the target."""
    d, tokenizer = recipe.distill, load_tokenizer(recipe.model.pretrained)
    text = transfer_text(d.transfer.source, data_spec(recipe), d.transfer.max_chars, d.transfer.path)
    families = {name: Family(config, own) for name, (config, own) in distill_families(recipe, tokenizer, text).items()}
    return DistillMethod(target.model.config, tokenizer, families, {t: d.tier_family[t] for t in tiers}, text,
                         recipe.train.seq_len, d,
                         eval_text=pooled_held_out(data_spec(recipe), recipe.data.eval_chars), run_seed=recipe.seed)
