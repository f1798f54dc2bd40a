"""Distillation fusion from its recipe sections (the registry entry's ``build``)."""

from __future__ import annotations

from transformers import PretrainedConfig, PreTrainedTokenizerBase

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
    tokenizer, spec = load_tokenizer(model.pretrained), data_spec(source)
    text = transfer_text(distill.transfer.source, spec, distill.transfer.max_chars, distill.transfer.path)
    return distill_method(distill, target.model.config, tokenizer, text, model.max_position, train.seq_len, seed, tiers,
                          eval_text=pooled_held_out(spec, source.data.eval_chars))


def distill_method(distill: DistillConfig, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, text: str,
                   max_position: int, seq_len: int, seed: int, tiers: list[str], eval_text: str = "") -> DistillMethod:
    """The ``distill`` section's families (sized to ``tokenizer``, up to ``max_position`` positions) distilled
    into the target on the transfer ``text`` for the device ``tiers``: what a run builds, and what a benchmark builds
    on its own text and tokenizer."""
    families = {name: Family(family, own) for name, (family, own)
                in distill_families(distill, max_position, tokenizer, text).items()}
    return DistillMethod(config, tokenizer, families, {t: distill.tier_family[t] for t in tiers}, text, seq_len,
                         distill, eval_text=eval_text, run_seed=seed)
