"""The target model: a Llama-architecture causal LM from a recipe config, or a pretrained one."""

from __future__ import annotations

from functools import lru_cache

import torch
from transformers import (
    AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase,
)

from fedfusion.data import build_char_tokenizer
from fedfusion.recipe import ModelConfig


@lru_cache(maxsize=4)
def load_tokenizer(pretrained: str | None) -> PreTrainedTokenizerBase:
    """The fixed character tokenizer, or the tokenizer saved with ``pretrained`` (local path or hub id)."""
    if not pretrained:
        return build_char_tokenizer()
    tok = AutoTokenizer.from_pretrained(pretrained)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def target_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    """The Llama config the recipe describes, sized to the tokenizer's vocabulary."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_position,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def target_model_config(cfg: ModelConfig) -> LlamaConfig:
    """The target's config without building it (read from ``pretrained`` when set)."""
    if cfg.pretrained:
        return AutoConfig.from_pretrained(cfg.pretrained)
    return target_config(cfg, load_tokenizer(None))


def build_target(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> LlamaForCausalLM:
    """A freshly initialised target (seeded), or ``cfg.pretrained`` (local path or hub id) if set."""
    if cfg.pretrained:
        model = AutoModelForCausalLM.from_pretrained(cfg.pretrained, dtype=torch.float32)
        if not isinstance(model, LlamaForCausalLM):
            raise ValueError(
                f"model.pretrained: {cfg.pretrained!r} is a {type(model).__name__}; width slicing needs a Llama-family model"
            )
        return model
    torch.manual_seed(seed)
    return LlamaForCausalLM(target_config(cfg, tokenizer))


def model_from_state(config: LlamaConfig, state: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    """A model of ``config`` holding ``state`` (strict: every key and shape must match)."""
    model = LlamaForCausalLM(config)
    model.load_state_dict(state, strict=True)
    return model


def count_params(model: torch.nn.Module) -> int:
    """Number of distinct parameters."""
    return sum(p.numel() for p in model.parameters())
