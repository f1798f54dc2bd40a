"""Planner: memory estimates, auto-fit of widths and LoRA ranks, rows for tiers that fit nothing."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from fedfusion.devices import load_catalog
from fedfusion.planner import (
    WIDTH_LADDER, auto_widths, estimate_memory, fit_lora_rank, fit_width, lora_params, param_count, plan_table,
    sliced_config, training_memory_bytes,
)
from fedfusion.recipe import load_recipe
from tests.conftest import tiny_config

PHONE = load_catalog()["phone"]


def sized(gib: float):
    """The phone tier with ``gib`` GiB of memory."""
    return dataclasses.replace(PHONE, memory_gb=gib)


def test_full_training_estimate_is_weights_grads_adam_and_activations():
    cfg = tiny_config(heads=8, kv_heads=2)
    est = estimate_memory(cfg, batch=4, seq=16)
    p = sum(t.numel() for t in LlamaForCausalLM(cfg).parameters())
    assert (est.weights, est.grads, est.optimizer) == (4 * p, 4 * p, 8 * p)
    per_token_layer = 10 * 32 + 3 * 48 + 2 * 8 * 16
    assert est.activations == 4 * 4 * 16 * (2 * per_token_layer + 2 * 50)
    assert training_memory_bytes(cfg, 4, 16) == est.total


def test_param_count_of_another_family_is_counted_exactly():
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50, n_positions=64)
    assert param_count(cfg) == sum(p.numel() for p in GPT2LMHeadModel(cfg).parameters())


def test_memory_shrinks_with_width():
    cfg = tiny_config(heads=8, kv_heads=8, hidden=64, inter=256)
    mems = [training_memory_bytes(sliced_config(cfg, w), 8, 32) for w in WIDTH_LADDER]
    assert mems == sorted(mems, reverse=True) and len(set(mems)) == len(mems)


def test_fit_width_takes_the_largest_ladder_width_that_fits():
    cfg = tiny_config(heads=8, kv_heads=8, hidden=64, inter=256)
    m = {w: training_memory_bytes(sliced_config(cfg, w), 8, 32) for w in WIDTH_LADDER}
    between = (m[0.25] + m[0.5]) / 2 / 2**30
    assert fit_width(cfg, sized(between), 8, 32, usable=1.0) == 0.25
    assert fit_width(cfg, sized(between / 0.5), 8, 32, usable=0.5) == 0.25
    assert fit_width(cfg, sized(m[1.0] / 2**30), 8, 32, usable=1.0) == 1.0
    assert fit_width(cfg, sized(m[0.0625] * 0.99 / 2**30), 8, 32, usable=1.0) is None
    assert fit_width(cfg, sized(between), 8, 32, ladder=(0.75, 0.1), usable=1.0) == 0.1


def test_lora_parameters_match_peft():
    from peft import LoraConfig, get_peft_model

    cfg = tiny_config(heads=8, kv_heads=2)
    modules = ("q_proj", "v_proj", "down_proj")
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, target_modules=list(modules)))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_params(cfg, 4, modules) == trainable


def test_quantised_base_is_smaller_and_fit_prefers_precision_then_rank():
    cfg = tiny_config(heads=8, kv_heads=8, hidden=256, inter=1024)
    w = {bits: estimate_memory(cfg, 1, 8, lora_rank=8, base_bits=bits).weights for bits in (32, 16, 8, 4)}
    assert w[32] > w[16] > w[8] > w[4]
    total = {bits: estimate_memory(cfg, 1, 8, lora_rank=1, base_bits=bits).total for bits in (32, 16, 8, 4)}
    room = (total[4] + total[8]) / 2 / 2**30  # 4-bit fits, 8-bit does not
    fit = fit_lora_rank(cfg, sized(room), 1, 8, usable=1.0)
    assert fit is not None and fit.base_bits == 4 and fit.memory.total <= room * 2**30
    assert fit_lora_rank(cfg, sized(100.0), 1, 8).base_bits == 32
    assert fit_lora_rank(cfg, sized(100.0), 1, 8).rank == 64
    assert fit_lora_rank(cfg, sized(total[4] * 0.9 / 2**30), 1, 8, usable=1.0) is None


def test_plan_rows_for_a_tier_that_fits_nothing_explain_instead_of_raising():
    recipe = load_recipe("quickstart")
    rows = plan_table(recipe, widths={"phone": None, "laptop": 0.25, "desktop": 0.5})
    phone = rows[0]
    assert phone["tier"] == "phone" and phone["width"] is None and phone["params"] is None
    assert phone["fits"].startswith("NO: even width 0.0625 needs")
    assert [r["tier"] for r in rows[1:]] == ["laptop", "desktop"]


def test_auto_widths_give_every_quickstart_tier_the_full_model():
    recipe = load_recipe("quickstart")  # a tiny target: everything fits
    widths = auto_widths(recipe)
    assert widths == {"phone": 1.0, "laptop": 1.0, "desktop": 1.0}
    assert all(r["fits"] == "yes" and r["width"] == 1.0 for r in plan_table(recipe, widths=widths))


def test_bad_inputs_are_named():
    cfg = tiny_config()
    with pytest.raises(ValueError, match="usable: must be in"):
        fit_width(cfg, PHONE, 1, 8, usable=0)
    with pytest.raises(ValueError, match="ladder"):
        fit_width(cfg, PHONE, 1, 8, ladder=(2.0,))
    with pytest.raises(ValueError, match="base_bits: must be one of"):
        estimate_memory(cfg, 1, 8, lora_rank=4, base_bits=3)
    with pytest.raises(ValueError, match="needs lora_rank"):
        estimate_memory(cfg, 1, 8, base_bits=4)
    with pytest.raises(ValueError, match="unknown module 'qkv'"):
        lora_params(cfg, 4, ("qkv",))


def test_lora_plan_rows_show_rank_precision_and_the_4bit_saving():
    from transformers import LlamaConfig

    from fedfusion.planner import lora_plan_table
    from fedfusion.recipe import load_recipe

    base = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64)  # SmolLM2-135M's shape
    recipe = load_recipe("quickstart", ["fusion.method=lora", "data.source=chatterbot"])
    rows = {r["tier"]: r for r in lora_plan_table(recipe, base)}
    assert rows["phone"]["rank"] == 4 and rows["phone"]["base"] == "4-bit"
    assert rows["phone"]["trainable"] == 30 * 4 * ((576 + 576) + (576 + 192))  # q_proj and v_proj adapters
    assert rows["phone"]["peak MB"] < rows["phone"]["fp32 base MB"]  # the 4-bit base is what makes it fit
    assert rows["desktop"]["peak MB"] == rows["desktop"]["fp32 base MB"]


def test_a_quantised_base_keeps_its_other_weights_and_activations_in_the_compute_dtype():
    cfg = tiny_config()
    f16 = estimate_memory(cfg, 2, 16, lora_rank=4, base_bits=4, compute_bytes=2)
    f32 = estimate_memory(cfg, 2, 16, lora_rank=4, base_bits=4, compute_bytes=4)
    tokens, layer = 2 * 16, 2 * (10 * 32 + 3 * 48 + 2 * 4 * 16)
    # layer activations in the compute dtype; logits: the output, the loss's float32 copy (only where the output
    # is narrower) and the float32 log-softmax
    assert f16.activations == tokens * (2 * layer + (2 + 4 + 4) * 50)
    assert f32.activations == tokens * (4 * layer + (4 + 4) * 50)
    # the weights that are not quantised (embeddings, lm_head, norms) account for the whole weight difference
    h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    linear = layers * (h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + 3 * h * cfg.intermediate_size)
    assert f32.weights - f16.weights == 2 * (f16.params - f16.trainable - linear) > 0
