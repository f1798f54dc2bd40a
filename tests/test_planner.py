"""Planner: memory estimates, auto-fit of widths and LoRA ranks, rows for tiers that fit nothing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from fedfusion.config.recipe import load_recipe
from fedfusion.config.sections import RecipeError
from fedfusion.devices.catalog import load_catalog, memory_note, population_catalog
from fedfusion.devices.memory import estimate_memory, fit_lora_rank, lora_params, param_count, training_memory_bytes
from fedfusion.fusion.plan import recipe_target
from fedfusion.fusion.submodel.plan import WIDTH_LADDER, auto_widths, expanded_tiers, fit_width, plan_table, sliced_config, window_memory
from tests.conftest import tiny_config

PHONE = load_catalog()["phone"]


def slicing(recipe):
    """What width slicing's plan reads of a recipe: its fusion, train and population sections, and its target."""
    return recipe.fusion, recipe.train, recipe.population, recipe_target(recipe.model, recipe.data_source())


def sized(gib: float):
    """The phone tier with ``gib`` GiB of memory."""
    return dataclasses.replace(PHONE, memory_gb=gib)


def test_full_training_estimate_is_weights_grads_adam_and_activations():
    cfg = tiny_config(heads=8, kv_heads=2)
    est = estimate_memory(cfg, batch=4, seq=16)
    p = sum(t.numel() for t in LlamaForCausalLM(cfg).parameters())
    assert (est.weights, est.grads, est.optimizer) == (4 * p, 4 * p, 8 * p)
    per_token_layer = 10 * 32 + 3 * 48 + 2 * 8 * 16
    assert est.activations == 4 * 4 * 16 * (2 * per_token_layer + 3 * 50)  # logits: output, log-softmax, gradient
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


@pytest.mark.xdist_group("peft")  # with the LoRA modules' tests: one xdist worker imports peft and bitsandbytes
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


@pytest.mark.parametrize("recipe, what", [("rolling", "width 0.0625"), ("quickstart", "a full-forward window of 0.0625")])
def test_plan_rows_for_a_tier_that_fits_nothing_explain_instead_of_raising(recipe, what):
    rows = plan_table(*slicing(load_recipe(recipe)), widths={"phone": None, "laptop": 0.25, "desktop": 0.5})
    phone = rows[0]
    assert phone["tier"] == "phone" and phone["width"] is None and phone["params"] is None
    assert phone["fits"].startswith(f"NO: even {what} needs")
    assert [r["tier"] for r in rows[1:]] == ["laptop", "desktop"]


def test_auto_widths_give_every_quickstart_tier_the_full_model():
    recipe = load_recipe("quickstart")  # a tiny target: everything fits
    widths = auto_widths(*slicing(recipe))
    assert widths == {"phone": 1.0, "laptop": 1.0, "desktop": 1.0}
    assert all(r["fits"] == "yes" and r["width"] == 1.0 for r in plan_table(*slicing(recipe), widths=widths))


def test_bad_inputs_are_named():
    cfg = tiny_config()
    with pytest.raises(ValueError, match="usable: must be in"):
        fit_width(cfg, PHONE, 1, 8, usable=0)
    with pytest.raises(ValueError, match="ladder"):
        fit_width(cfg, PHONE, 1, 8, ladder=(2.0,))
    with pytest.raises(ValueError, match="base_bits: must be one of"):
        estimate_memory(cfg, 1, 8, lora_rank=4, base_bits=3)
    with pytest.raises(ValueError, match="8 and 4 need lora_rank or window"):
        estimate_memory(cfg, 1, 8, base_bits=4)
    with pytest.raises(ValueError, match="unknown module 'qkv'"):
        lora_params(cfg, 4, ("qkv",))


def test_lora_plan_rows_show_rank_precision_and_the_4bit_saving():
    from transformers import LlamaConfig

    from fedfusion.config.recipe import load_recipe
    from fedfusion.fusion.lora.plan import lora_plan_table

    base = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64)  # SmolLM2-135M's shape
    recipe = load_recipe("rolling", ["fusion.method=lora", "data.source=chatterbot"])
    rows = {r["tier"]: r for r in lora_plan_table(recipe.lora, recipe.fusion, recipe.train, recipe.population, base)}
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
    assert f16.activations == tokens * (2 * layer + (2 + 4 + 4 + 4) * 50)
    assert f32.activations == tokens * (4 * layer + (4 + 4 + 4) * 50)
    # the weights that are not quantised (embeddings, lm_head, norms) account for the whole weight difference
    h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    linear = layers * (h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + 3 * h * cfg.intermediate_size)
    assert f32.weights - f16.weights == 2 * (f16.params - f16.trainable - linear) > 0


# -- one round's cost: the ledger's cost model (fedfusion.devices.energy.price_work), transfers included -----------------
def _assert_priced_as_the_ledger(row, device, flops, bytes_down, bytes_up):
    from fedfusion.devices.energy import price_work

    cost = price_work(device, flops, bytes_down, bytes_up)
    # the row's columns are the ledger's own numbers (the same price_work call), so equal exactly; the two shares of
    # the wall joules add back to it within a few float64 roundings (the split and the sum: 1e-12 is ~4500 ulps)
    assert (row["J/round"], row["s/round"]) == (cost.wall_j, cost.virtual_s)
    assert (row["compute s"], row["transfer s"]) == (cost.compute_s, cost.comm_s)
    assert row["compute J"] + row["transfer J"] == pytest.approx(row["J/round"], rel=1e-12)
    assert row["transfer J"] > 0 if bytes_down + bytes_up else row["transfer J"] == 0


@pytest.mark.parametrize("wire", ["float32", "float16"])
def test_plan_prices_each_tier_with_the_ledgers_cost_model_and_the_bytes_it_moves(wire):
    """One owner of the cost model: a tier's planned round is price_work of its FLOPs, its slice down (in
    fusion.wire_dtype) and its float32 reply up; those bytes are the sub-model the strategy sends."""
    from fedfusion.data.text import load_tokenizer
    from fedfusion.devices.energy import train_flops
    from fedfusion.models.build import build_target
    from fedfusion.models.slicing import extract, plan_slice

    recipe = load_recipe("rolling", [f"fusion.wire_dtype={wire}"])
    catalog, t = load_catalog(), recipe.train
    target = build_target(recipe.model, load_tokenizer(None), recipe.seed)
    rows = plan_table(*slicing(recipe))
    for row in rows:
        sub = extract(target.state_dict(), target.config, plan_slice(target.config, row["width"], "static"))
        sent = sum(v.numel() * (2 if wire == "float16" else 4) for v in sub.values())
        assert row["params"] == sum(v.numel() for v in sub.values())
        assert row["MB down"] * 2**20 == sent and row["MB up"] * 2**20 == 4 * row["params"]
        flops = train_flops(row["params"], t.local_steps * t.batch_size * t.seq_len)
        _assert_priced_as_the_ledger(row, catalog[row["tier"]], flops, sent, 4 * row["params"])
    laptop = next(r for r in rows if r["tier"] == "laptop")
    assert laptop["transfer s"] > laptop["compute s"]  # what a plan pricing compute alone would miss


@pytest.mark.parametrize("down, up", [("int8", "int8"), ("int4", "int4"), ("float16", "int4")])
def test_plan_prices_a_quantised_wire_at_the_bytes_its_arrays_carry(down, up):
    """fusion.wire_dtype / fusion.wire_up: the plan's MB down and up are quantize.encoded_bytes of the slice's
    parameters, within 3 % of the arrays quantize.encode makes of the real slice (per-tensor padding, shape arrays,
    float16 vectors)."""
    from fedfusion.data.text import load_tokenizer
    from fedfusion.models.build import build_target
    from fedfusion.models.slicing import extract, plan_slice
    from fedfusion.wire.quantize import encode

    recipe = load_recipe("rolling", [f"fusion.wire_dtype={down}", f"fusion.wire_up={up}"])
    target = build_target(recipe.model, load_tokenizer(None), recipe.seed)
    for row in plan_table(*slicing(recipe)):
        sub = extract(target.state_dict(), target.config, plan_slice(target.config, row["width"], "static"))
        for fmt, planned in ((down, row["MB down"]), (up, row["MB up"])):
            actual = sum(v.nbytes for v in encode(sub, fmt).values())
            assert planned * 2**20 == pytest.approx(actual, rel=0.03)


def test_lora_plan_prices_the_adapter_each_way():
    from transformers import LlamaConfig

    from fedfusion.devices.energy import frozen_work_params, train_flops
    from fedfusion.fusion.lora.plan import lora_plan_table

    base = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    recipe = load_recipe("rolling", ["fusion.method=lora", "data.source=chatterbot"])
    t = recipe.train
    for row in lora_plan_table(recipe.lora, recipe.fusion, recipe.train, recipe.population, base):
        flops = train_flops(frozen_work_params(param_count(base), row["trainable"]), t.local_steps * t.batch_size * t.seq_len)
        _assert_priced_as_the_ledger(row, load_catalog()[row["tier"]], flops, 4 * row["trainable"], 4 * row["trainable"])


def test_distill_plan_shows_each_tiers_family_model_and_the_servers_work():
    from fedfusion.data.population import data_spec
    from fedfusion.data.text import load_tokenizer
    from fedfusion.devices.energy import train_flops
    from fedfusion.fusion.distill.plan import distill_plan_table
    from fedfusion.train.distill import forward_flops
    from fedfusion.train.transfer import distill_families, transfer_text

    recipe = load_recipe("distill", ["distill.transfer.max_chars=20000"])
    d, t = recipe.distill, recipe.train
    rows = {r["tier"]: r for r in distill_plan_table(d, t, recipe.population, recipe.model, recipe.data_source())}
    assert list(rows) == ["phone", "laptop", "desktop", "server (cloud-a100)"]
    assert rows["phone"]["trains"].startswith("tiny: llama 32x2") and rows["laptop"]["trains"].startswith("small: gpt2")
    text = transfer_text(d.transfer.source, data_spec(recipe.data_source()), d.transfer.max_chars)
    built = {name: param_count(config) for name, (config, _) in
             distill_families(recipe.distill, recipe.model.max_position, load_tokenizer(None), text).items()}
    assert rows["phone"]["params"] == built["tiny"] and rows["desktop"]["params"] == built["small"]
    for tier in ("phone", "laptop", "desktop"):
        p = rows[tier]["params"]
        _assert_priced_as_the_ledger(rows[tier], load_catalog()[tier],
                                     train_flops(p, t.local_steps * t.batch_size * t.seq_len), 4 * p, 4 * p)
    server, target = rows["server (cloud-a100)"], rows["server (cloud-a100)"]["params"]
    fwd, back = (s * d.server_batch_size * t.seq_len for s in (d.server_steps, d.back_steps))
    flops = train_flops(target, fwd) + sum(forward_flops(p, fwd) + train_flops(p, back) + forward_flops(target, back)
                                           for p in built.values())
    _assert_priced_as_the_ledger(server, load_catalog()["cloud-a100"], flops, 0, 0)  # as the ledger prices the server


def test_generative_server_row_prices_the_targets_training_on_the_samples():
    from fedfusion.devices.energy import train_flops
    from fedfusion.fusion.generative.plan import generative_server_row

    recipe = load_recipe("knowledge")
    g, row = recipe.generative, generative_server_row(recipe.generative, recipe.train, recipe.population,
                                                   recipe_target(recipe.model, recipe.data_source()))
    assert row["tier"] == "server (cloud-a100)" and row["trains"] == "learns the samples (30 steps)"
    flops = train_flops(row["params"], g.server_steps * g.server_batch * recipe.train.seq_len)
    _assert_priced_as_the_ledger(row, load_catalog()["cloud-a100"], flops, 0, 0)


def test_generative_plan_says_what_travels_with_the_device_state():
    from fedfusion.config.methods import GENERATIVE, call, method

    def note(*overrides: str) -> str:  # the view as `fedfusion plan` calls it: its registry entry's, on its sections
        recipe = load_recipe("knowledge", list(overrides))
        return call(method(GENERATIVE).plan, recipe, source=recipe.data_source()).notes[0]

    node, server = note(), note("generative.device_state=server")
    assert "first round only" in node and "top tokens" in node
    assert "first round" not in server and server.startswith("a client's uplink also carries its samples")


def test_plan_prices_the_wire_of_a_mixed_federations_slicing_tiers_only():
    """fusion.method=mixed: the sub-model tiers' slices travel in the wire's formats (the strategy sends them so);
    a tier of another method is not priced by them."""
    from fedfusion.wire.quantize import encoded_bytes

    recipe = load_recipe("mixed", ["fusion.wire_dtype=int8", "fusion.wire_up=int4"])
    (row,) = plan_table(*slicing(recipe), tiers=["laptop"])
    assert row["MB down"] * 2**20 == encoded_bytes("int8", row["params"])
    assert row["MB up"] * 2**20 == encoded_bytes("int4", row["params"])


def test_a_window_computes_in_float32_and_checkpointing_keeps_one_layer():
    """A full-forward window's activations are float32 whatever its frozen target's bits (fedfusion.models.frozen);
    with train.checkpoint each layer keeps its input and one layer's values are live."""
    cfg = tiny_config(heads=8, kv_heads=2)
    tokens, layer = 4 * 16, 10 * 32 + 3 * 48 + 2 * 8 * 16
    window = estimate_memory(cfg, batch=4, seq=16, base_bits=8, window=100)
    assert window.activations == tokens * 4 * (2 * layer + 3 * 50)
    kept = estimate_memory(cfg, batch=4, seq=16, base_bits=8, window=100, checkpoint=True)
    assert kept.activations == tokens * 4 * (2 * 32 + layer + 3 * 50)
    assert estimate_memory(cfg, 4, 16, checkpoint=True).total < estimate_memory(cfg, 4, 16).total


def test_the_plan_says_when_activations_are_checkpointed_and_counts_less():
    plain = plan_table(*slicing(load_recipe("quickstart", [])))
    kept = plan_table(*slicing(load_recipe("quickstart", ["train.checkpoint=true"])))
    assert all("checkpointed" in r["slice"] and "checkpointed" not in p["slice"] for r, p in zip(kept, plain))
    assert all(r["peak MB"] < p["peak MB"] for r, p in zip(kept, plain))


def test_auto_widths_fit_full_forward_windows_not_just_slices():
    """A full-forward tier holds the frozen target and its activations besides its window: its fitted width is the
    widest whose window fits, narrower than a slice of the same memory, and the plan agrees that every row fits."""
    big = ["model.hidden_size=1024", "model.num_heads=16", "model.num_kv_heads=16", "model.intermediate_size=4096",
           "model.num_layers=24", "train.batch_size=8"]
    grown = load_recipe("quickstart", big)
    sliced = load_recipe("quickstart", [*big, "fusion.forward=slice", "fusion.window_core=false",
                                        "fusion.window_shared=false", "fusion.grow_round=0"])
    windows, slices = auto_widths(*slicing(grown)), auto_widths(*slicing(sliced))
    assert windows["phone"] is not None and windows["phone"] < slices["phone"]
    assert all(windows[t] <= slices[t] for t in windows)
    assert all(r["fits"] == "yes" and r["width"] == windows[r["tier"]] for r in plan_table(*slicing(grown), widths=windows))
    lowend = [*big, "fusion.auto_widths=true", "population.mix={phone-lowend: 1.0}"]
    assert auto_widths(*slicing(load_recipe("rolling", lowend)))["phone-lowend"] is not None  # a slice fits it
    grown_lowend = load_recipe("quickstart", lowend)
    [row] = plan_table(*slicing(grown_lowend), widths=auto_widths(*slicing(grown_lowend)))  # the frozen target and its activations do not
    assert row["width"] is None and row["fits"].startswith("NO: even a full-forward window of 0.0625 needs")


def test_a_tier_expands_its_frozen_target_only_where_its_memory_holds_the_float32_copy():
    """fedfusion.fusion.submodel.plan.window_path: a device whose memory holds the window with the frozen target made float32
    once (and the message's int8 copy beside it) trains that way (faster, the same values); one whose memory does
    not keeps the target as it travelled. The plan prices the way each tier takes, and the run's messages say the
    same (expanded_tiers, read by SubModelMethod)."""
    big = ["model.hidden_size=1024", "model.num_heads=16", "model.num_kv_heads=16", "model.intermediate_size=4096",
           "model.num_layers=24", "train.batch_size=8", "population.mix={phone: 0.5, laptop: 0.5}",
           "fusion.widths={phone: 0.0625, laptop: 0.25}"]
    recipe = load_recipe("quickstart", big)
    (fusion, train, population, target), catalog = slicing(recipe), load_catalog()
    rows = {r["tier"]: r for r in plan_table(fusion, train, population, target)}
    expanded = expanded_tiers(fusion, train, population, recipe.model, recipe.data_source())
    for tier, width in recipe.fusion.widths.items():
        narrow, wide = (window_memory(fusion, train, target, width, 0.0625, expand)[1] for expand in (False, True))
        budget = catalog[tier].memory_gb * 2**30 * 0.9
        assert narrow < wide
        expands = wide <= budget
        assert (tier in expanded) == expands
        assert rows[tier]["slice"].endswith(" -> float32") == expands
        assert rows[tier]["peak MB"] == round((wide if expands else narrow) / 2**20, 1)
    assert expanded == {"laptop"}  # the phone (3.6 GB usable) holds the int8 target, not a float32 one
    sliced = load_recipe("quickstart", [*big, "fusion.forward=slice", "fusion.window_core=false"])
    assert expanded_tiers(sliced.fusion, sliced.train, sliced.population, sliced.model, sliced.data_source()) == set()


def test_memory_scale_shrinks_every_tier_and_the_fit_follows_it():
    """``population.memory_scale`` scales each tier's memory as every plan reads it (one door:
    ``population_catalog``): the fitted slice narrows as the scale falls, the plan's device column shows the scaled
    memory, and a scale of 1 is the catalog itself."""
    base = load_recipe("rolling", ["fusion.auto_widths=true"])
    assert population_catalog(base.population) == load_catalog()
    scaled = load_recipe("rolling", ["fusion.auto_widths=true", "population.memory_scale=0.003"])
    devices = population_catalog(scaled.population)
    assert all(devices[t].memory_gb == pytest.approx(0.003 * d.memory_gb, rel=1e-15)
               for t, d in load_catalog().items())
    full, small = auto_widths(*slicing(base)), auto_widths(*slicing(scaled))
    assert full == {"phone": 1.0, "laptop": 1.0, "desktop": 1.0}
    assert all(small[t] is None or small[t] < full[t] for t in full)  # each tier fits less than with its whole memory
    rows = plan_table(*slicing(scaled), widths=small)
    assert {r["tier"]: r["device MB"] for r in rows} == {t: round(devices[t].memory_gb * 1024) for t in full}
    assert memory_note(base.population) is None and "0.003" in (memory_note(scaled.population) or "")


@pytest.mark.parametrize("bad", ["0", "-0.5", "1.5", "true", "nan"])
def test_a_memory_scale_outside_0_1_is_one_named_error(bad):
    with pytest.raises(RecipeError, match=r"population\.memory_scale"):
        load_recipe("quickstart", [f"population.memory_scale={bad}"])


@pytest.mark.parametrize("name", ["quickstart", "rolling"])
def test_secure_aggregation_prices_every_reply_as_the_masked_vector_at_its_bound(name):
    """Under ``privacy.secure_aggregation`` a reply is 8 bytes (fixed point modulo 2**64) for every coordinate of the
    round's support, whatever the client trains; the plan prices that at its bound, every coordinate of the target,
    for every tier (slices and full-forward windows alike), and leaves the downlink as it was."""
    from fedfusion.config.methods import call, method

    plain, secure = (load_recipe(name, [f"privacy.secure_aggregation={on}"]) for on in ("false", "true"))
    views = [call(method(r.fusion.method).plan, r, source=r.data_source()) for r in (plain, secure)]
    coordinates = param_count(recipe_target(secure.model, secure.data_source()))
    for before, after in zip(*(v.rows for v in views), strict=True):
        assert after["MB up"] == 8 * coordinates / 2**20 and before["MB up"] < after["MB up"]
        assert after["MB down"] == before["MB down"] and after["compute s"] == before["compute s"]
    assert any("masked vector" in note for note in views[1].notes)
    assert not any("masked vector" in note for note in views[0].notes)


@pytest.mark.parametrize("lora_method", ["flexlora", "fedavg"])
def test_secure_lora_prices_the_padded_change_the_method_masks(lora_method):
    """Under secure aggregation a LoRA reply is the padded change (the dense update of every adapted module for
    flexlora, both factors at the largest rank otherwise), 8 bytes a coordinate: the plan's MB up is what the real
    method masks on a model built from the same config, for every tier; the downlink stays the adapter's."""
    from transformers import LlamaConfig

    from fedfusion.fusion.lora.method import adapted_modules, secure_shapes
    from fedfusion.fusion.lora.plan import lora_plan_table

    base = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
    tiers = "{phone: 2, laptop: 4, desktop: 8}" if lora_method == "flexlora" else "{phone: 4, laptop: 4, desktop: 4}"
    recipe = load_recipe("rolling", ["fusion.method=lora", "data.source=chatterbot", f"lora.method={lora_method}",
                                     f"lora.ranks={tiers}", "lora.quantize={phone: 0, laptop: 0, desktop: 0}"])
    plain, secure = (lora_plan_table(recipe.lora, recipe.fusion, recipe.train, recipe.population, base, secure=on)
                     for on in (False, True))
    shapes = secure_shapes(adapted_modules(LlamaForCausalLM(base), list(recipe.lora.target_modules)), lora_method,
                           max(recipe.lora.ranks.values()))
    masked = 8 * sum(o * i for o, i in shapes.values())
    dense = 2 * sum(o * i for o, i in [(32, 32), (16, 32)])  # q_proj (32 x 32) and v_proj (16 x 32), two layers
    factors = 2 * 4 * ((32 + 32) + (32 + 16))  # rank 4: A (4 x 32) and B (32 x 4), (4 x 32) and (16 x 4), two layers
    assert masked == 8 * (dense if lora_method == "flexlora" else factors)
    for before, after in zip(plain, secure, strict=True):
        assert after["MB up"] == masked / 2**20 and after["MB down"] == before["MB down"]
        assert before["MB up"] < after["MB up"]


def test_a_trained_tied_embedding_adds_its_two_unsummed_gradients_after_backward():
    """Full training of a tied embedding: backward's end holds the head's and the input embedding's vocab x hidden
    gradients before autograd sums them (fedfusion.devices.memory.tied_grad_bytes), counted from the shapes and
    only where that moment outweighs the activations and the optimizer step; an untied model has none."""
    def config(vocab: int, tied: bool = True):
        return dataclasses.replace(tiny_config(), vocab_size=vocab, tie_word_embeddings=tied)

    small, large = (estimate_memory(config(v), batch=1, seq=2, checkpoint=True) for v in (4_000, 8_000))
    assert (small.tied, large.tied) == (2 * 4 * 4_000 * 32, 2 * 4 * 8_000 * 32)
    assert large.total == large.weights + large.grads + large.optimizer + large.tied  # above activations and step
    assert estimate_memory(config(8_000), 1, 2, base_bits=16, checkpoint=True).tied == large.tied // 2
    assert estimate_memory(config(8_000, tied=False), 1, 2, checkpoint=True).tied == 0
    assert estimate_memory(config(8_000), 1, 2, base_bits=8, window=100).tied == 0  # the embedding is not trained
    few = estimate_memory(config(50), batch=4, seq=16)
    assert few.total == few.weights + few.grads + few.optimizer + few.activations  # tiny vocab: activations win


@pytest.mark.xdist_group("peft")  # benchmarks/cpu_memory.py imports peft (cuda_lora): on the LoRA tests' worker
def test_the_peak_of_full_training_with_a_tied_embedding_is_within_15_percent_of_its_live_tensors(monkeypatch):
    """Measured: the most tensor bytes alive at once while a tied Llama with a large vocabulary trains two
    checkpointed AdamW steps (benchmarks/cpu_memory.py's LiveTensors), above the tensors alive before (the weights
    and whatever else the process holds), is within the planner's goal, 15 %, of the estimate less its weights, and
    above the estimate without the tied gradients."""
    import torch

    from fedfusion.train.loop import train_steps

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from cpu_memory import GOAL, LiveTensors

    cfg = dataclasses.replace(tiny_config(), vocab_size=8_000, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    data = torch.randint(0, cfg.vocab_size, (8, 5))
    with LiveTensors() as live:
        held = live.bytes
        train_steps(model, data, steps=2, lr=1e-3, batch_size=1, seed=0, checkpoint=True)
    est = estimate_memory(cfg, batch=1, seq=4, checkpoint=True)
    measured = live.peak - held
    assert abs((est.total - est.weights) / measured - 1) <= GOAL
    assert est.grads + est.optimizer + max(est.activations, est.step) < measured


def test_a_rank_updates_dense_matrices_are_two_whatever_the_uses_and_live_with_the_activations():
    """A rank-r update of a tied embedding (two uses: lookup and head) costs two dense float32 vocab x hidden
    matrices at once, the head's kept copy and its gradient (rank_dense_bytes); a linear layer's update none. In the
    estimate they are live with the activations: the kept half through the loss, the whole at the head's backward
    beside the layers' activations and the logits' float32 gradient."""
    from fedfusion.fusion.submodel.plan import rank_dense_bytes

    cfg = dataclasses.replace(tiny_config(), vocab_size=8_000, tie_word_embeddings=True)
    dense = rank_dense_bytes(cfg, ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"])
    assert dense == 2 * 4 * 8_000 * cfg.hidden_size
    plain, ranked = (estimate_memory(cfg, 2, 8, base_bits=8, window=100, dense=d) for d in (0, dense))
    layers = plain.activations - 12 * 2 * 8 * 8_000  # the float32 logits' 12 bytes per entry (the module docstring)
    assert ranked.with_dense == max(plain.activations + dense // 2, layers + 4 * 2 * 8 * 8_000 + dense)
    assert ranked.total - plain.total == ranked.with_dense - plain.activations > 0
