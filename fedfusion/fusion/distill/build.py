"""Distillation fusion from its recipe sections (the registry entry's ``build``)."""

from __future__ import annotations

from fedfusion.config.sections import DataSource, ModelConfig, TrainConfig
from fedfusion.data.population import data_spec, pooled_held_out
from fedfusion.data.text import load_tokenizer
from fedfusion.fusion.base import BuildTarget
from fedfusion.fusion.distill.config import DistillConfig
from fedfusion.fusion.distill.method import DistillMethod, Family
from fedfusion.train.transfer import distill_families, transfer_text


def build(distill: DistillConfig, model: ModelConfig, train: TrainConfig, source: DataSource, seed: int,
          target: BuildTarget, tiers: list[str]) -> DistillMethod:
    """Distillation fusion for ``tiers``: one global model per small family, a transfer set no client owns; every
    family is scored each round on the same pooled held-out text as the target."""
    d, tokenizer, spec = distill, load_tokenizer(model.pretrained), data_spec(source)
    text = transfer_text(d.transfer.source, spec, d.transfer.max_chars, d.transfer.path)
    families = {name: Family(config, own)
                for name, (config, own) in distill_families(d, model.max_position, tokenizer, text).items()}
    return DistillMethod(target.model.config, tokenizer, families, {t: d.tier_family[t] for t in tiers}, text,
                         train.seq_len, d, eval_text=pooled_held_out(spec, source.data.eval_chars), run_seed=seed)
