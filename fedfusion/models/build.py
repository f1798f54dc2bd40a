"""The target model: a Llama-architecture causal LM from a recipe config, or a pretrained one."""

from __future__ import annotations

import json
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationMixin,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
)

from fedfusion.config.choices import FAMILY_MODEL_TYPES
from fedfusion.config.sections import ModelConfig
from fedfusion.data.text import load_tokenizer
from fedfusion.models.families import family_of


def generate(model: torch.nn.Module, inputs: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """``model.generate(inputs, **kwargs)``'s token ids; TypeError for a model that cannot generate (not a causal
    LM) or for settings that make it return more than the ids."""
    if not isinstance(model, GenerationMixin):
        raise TypeError(f"{type(model).__name__} cannot generate text")
    out = model.generate(inputs, **kwargs)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"generate returned a {type(out).__name__}, not token ids")
    return out


def target_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The config of ``cfg.family`` the recipe describes, sized to the tokenizer's vocabulary."""
    ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
           "eos_token_id": tokenizer.eos_token_id}
    if cfg.family == "gpt2":
        return GPT2Config(vocab_size=len(tokenizer), n_embd=cfg.hidden_size, n_layer=cfg.num_layers, n_head=cfg.num_heads,
                          n_inner=cfg.intermediate_size, n_positions=cfg.max_position, **ids)
    if cfg.family == "opt":
        return OPTConfig(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, ffn_dim=cfg.intermediate_size,
                         max_position_embeddings=cfg.max_position, word_embed_proj_dim=cfg.hidden_size,
                         do_layer_norm_before=True, **ids)
    llama_like = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[cfg.family]
    return llama_like(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_position,
        tie_word_embeddings=False,
        **ids,
    )


def target_model_config(cfg: ModelConfig) -> PretrainedConfig:
    """The target's config without building it (read from ``pretrained`` when set)."""
    if cfg.pretrained:
        return AutoConfig.from_pretrained(cfg.pretrained)
    return target_config(cfg, load_tokenizer(None))


def build_target(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreTrainedModel:
    """A freshly initialised target (seeded), or ``cfg.pretrained`` (local path or hub id) if set."""
    if cfg.pretrained:
        model = AutoModelForCausalLM.from_pretrained(cfg.pretrained, dtype=torch.float32)
        try:
            family_of(model.config)
        except ValueError as exc:
            raise ValueError(f"model.pretrained: {cfg.pretrained!r}: {exc}") from None
        return model
    torch.manual_seed(seed)
    config = target_config(cfg, tokenizer)
    return family_of(config).build(config)


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """State keys of ``model`` that name a parameter already named by another key (tied embeddings, e.g.
    GPT-2's and OPT's ``lm_head.weight``): alias -> that key. Messages leave aliases out, so each tensor
    travels once and is priced once."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


_ALIASES: dict[tuple[type, str], dict[str, str]] = {}


def config_aliases(config: PretrainedConfig) -> dict[str, str]:
    """:func:`tied_aliases` of a model of ``config``, built on the meta device (no memory, no init); remembered by
    the config's class and JSON, as the methods, the planner and the frozen target ask again for the same few
    configs (4-20 ms a build, ~600 of them in the test suite)."""
    key = (type(config), config.to_json_string())
    aliases = _ALIASES.get(key)  # one lookup: another thread may clear the cache between two
    if aliases is None:
        if len(_ALIASES) >= 256:
            _ALIASES.clear()
        with torch.device("meta"):
            aliases = _ALIASES[key] = tied_aliases(family_of(config).build(config))
    return dict(aliases)


def wire_state(state: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """``state`` without its tied aliases: what a message carries."""
    return {k: v for k, v in state.items() if k not in aliases}


def full_state(state: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """A message's state with every tied alias set to the tensor it aliases (an alias sent anyway is ignored)."""
    return {**state, **{alias: state[key] for alias, key in aliases.items() if key in state}}


def model_from_state(config: PretrainedConfig, state: dict[str, torch.Tensor]) -> PreTrainedModel:
    """A model of ``config`` (any sliceable family) holding ``state``, with or without its tied aliases
    (strict otherwise: every key and shape must match)."""
    model = family_of(config).build(config)
    model.load_state_dict(full_state(state, tied_aliases(model)), strict=True)
    return model


def count_params(model: torch.nn.Module) -> int:
    """Number of distinct parameters."""
    return sum(p.numel() for p in model.parameters())


def family_config(
    model_type: str, tokenizer: PreTrainedTokenizerBase, hidden_size: int, num_layers: int, num_heads: int,
    num_kv_heads: int | None = None, intermediate_size: int | None = None, max_position: int = 512,
) -> PretrainedConfig:
    """The config of a small family: a Llama (RMSNorm, SwiGLU, RoPE, GQA) or a GPT-2 (LayerNorm, GELU,
    learned positions), sized to ``tokenizer``'s vocabulary. ``intermediate_size`` defaults to 4 x hidden."""
    if model_type not in FAMILY_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not one of {', '.join(FAMILY_MODEL_TYPES)}")
    if hidden_size % num_heads:
        raise ValueError(f"num_heads {num_heads} does not divide hidden_size {hidden_size}")
    ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
           "eos_token_id": tokenizer.eos_token_id}
    inner = intermediate_size or 4 * hidden_size
    if model_type == "gpt2":
        return GPT2Config(vocab_size=len(tokenizer), n_embd=hidden_size, n_layer=num_layers, n_head=num_heads,
                          n_inner=inner, n_positions=max_position, **ids)
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=inner, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads or num_heads,
        head_dim=hidden_size // num_heads, max_position_embeddings=max_position, tie_word_embeddings=False, **ids,
    )


def small_model(config_json: str, state: dict[str, torch.Tensor] | None = None) -> PreTrainedModel:
    """A causal LM of the family config (JSON of ``PretrainedConfig.to_dict()``), holding ``state`` if given."""
    config = dict(json.loads(config_json))
    model_type = config.pop("model_type", None)
    if not model_type:
        raise ValueError("model-config has no model_type")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
    if state is not None:
        model.load_state_dict(full_state(state, tied_aliases(model)), strict=True)
    return model
