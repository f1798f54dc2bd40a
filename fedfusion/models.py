"""The target model: a Llama-architecture causal LM from a recipe config, or a pretrained one."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from fedfusion.recipe import ModelConfig


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


def build_target(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> LlamaForCausalLM:
    """A freshly initialised target (seeded), or ``cfg.pretrained`` (local path or hub id) if set."""
    if cfg.pretrained:
        model = AutoModelForCausalLM.from_pretrained(cfg.pretrained, torch_dtype=torch.float32)
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
