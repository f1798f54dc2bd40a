"""Per-tier plan: what each device tier trains, its size, estimated peak memory, time and energy."""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig

from fedfusion.devices import load_catalog
from fedfusion.models import target_model_config
from fedfusion.recipe import Recipe
from fedfusion.slicing import plan_slice, sub_config


def llama_params(config: LlamaConfig) -> int:
    """Parameter count of a Llama config (untied embeddings unless the config ties them)."""
    h, i, v, layers = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    attn = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    per_layer = attn + 3 * h * i + 2 * h
    heads = 1 if config.tie_word_embeddings else 2
    return layers * per_layer + heads * v * h + h


def training_memory_bytes(config: LlamaConfig, batch: int, seq: int) -> int:
    """fp32 AdamW training estimate: weights + grads + 2 moments, plus stored activations and logits."""
    params = llama_params(config)
    per_token_layer = 10 * config.hidden_size + 3 * config.intermediate_size + 2 * config.num_attention_heads * seq
    activations = batch * seq * (config.num_hidden_layers * per_token_layer + 2 * config.vocab_size)
    return 4 * (4 * params + activations)


def plan_table(recipe: Recipe) -> list[dict[str, Any]]:
    """One row per tier of the population mix, narrowest first.

    Memory is the fp32 AdamW estimate of :func:`training_memory_bytes`; seconds and joules per round
    price ``6 * params * tokens`` FLOPs at the catalog's sustained TFLOPS and training watts.
    """
    catalog = load_catalog(recipe.population.catalog)
    target = target_model_config(recipe.model)
    tokens = recipe.train.local_steps * recipe.train.batch_size * recipe.train.seq_len
    rows = []
    for tier in sorted(recipe.population.mix, key=lambda t: recipe.fusion.widths[t]):
        device = catalog[tier]
        width = recipe.fusion.widths[tier]
        sub = sub_config(target, plan_slice(target, width, "static"))
        params = llama_params(sub)
        mem = training_memory_bytes(sub, recipe.train.batch_size, recipe.train.seq_len)
        seconds = 6 * params * tokens / (device.tflops * 1e12)
        rows.append({
            "tier": tier, "width": width,
            "slice": f"{sub.num_attention_heads}/{target.num_attention_heads} heads, "
                     f"{sub.intermediate_size}/{target.intermediate_size} neurons",
            "params": params, "peak MB": round(mem / 2**20, 1), "device MB": round(device.memory_gb * 1024),
            "fits": "yes" if mem <= device.memory_gb * 2**30 else "NO",
            "s/round": seconds, "J/round": seconds * device.train_w,
        })
    return rows
