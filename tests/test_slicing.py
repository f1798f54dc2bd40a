"""Exactness properties of width slicing and selective averaging."""

from __future__ import annotations

import math

import pytest
import torch
from fp_bounds import assert_within, gamma, matmul_bound
from transformers import LlamaForCausalLM

from fedfusion.models.build import model_from_state
from fedfusion.models.slicing import (
    SelectiveAverager,
    SlicePlan,
    as_ranges,
    axis_sizes,
    extract,
    plan_slice,
    rolling_step,
    sub_config,
    sub_scales,
    units_kept,
)


def sub_model(model, plan: SlicePlan):
    return model_from_state(sub_config(model.config, plan), extract(model.state_dict(), model.config, plan)).eval()


@pytest.mark.parametrize("policy", ["static", "rolling"])
def test_width_one_slice_gives_the_full_models_logits_exactly(model, policy):
    x = torch.randint(0, 50, (2, 10))
    plan = plan_slice(model.config, 1.0, policy, server_round=5)
    with torch.no_grad():
        assert torch.equal(sub_model(model, plan)(x).logits, model(x).logits)


def test_sub_model_is_a_smaller_llama_with_the_planned_units(model):
    cfg = model.config
    plan = plan_slice(cfg, 0.5, "rolling", server_round=2, stride=0.25)
    sub = sub_model(model, plan)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    assert sub.config.num_key_value_heads == len(plan.attn_units) == units_kept(cfg.num_key_value_heads, 0.5)
    assert sub.config.num_attention_heads == len(plan.attn_units) * group
    assert sub.config.intermediate_size == len(plan.neurons) == 24
    assert sub.config.head_dim == cfg.head_dim
    assert sum(p.numel() for p in sub.parameters()) < sum(p.numel() for p in model.parameters())
    out = sub(torch.randint(0, 50, (1, 6)), labels=torch.randint(0, 50, (1, 6)))
    out.loss.backward()  # ordinary training code works on it


def test_sliced_mlp_equals_scaled_sum_over_kept_neurons(model):
    """The scaler folded into down_proj: sub-MLP(x) = K/n * sum of the kept neurons' terms of the full MLP.

    The sub-MLP's gate and up rows are the kept neurons' own (bit for bit), so its activations are theirs; its
    output is one float32 product of them with ``fl(W_kept * n/K)``: within ``gamma_K |act| |W_sub|`` (the product,
    fp_bounds) plus ``|act| |fl(W s) - W s|`` (the scaler's rounding, computed exactly) of the exact scaled sum."""
    plan = plan_slice(model.config, 0.25, "rolling", server_round=3, stride=0.25)
    full, sub = model.model.layers[1].mlp, sub_model(model, plan).model.layers[1].mlp
    x = torch.randn(3, model.config.hidden_size)
    keep = torch.tensor(plan.neurons)
    assert torch.equal(sub.gate_proj.weight, full.gate_proj.weight[keep])
    assert torch.equal(sub.up_proj.weight, full.up_proj.weight[keep])
    seen = []
    sub.down_proj.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach()))
    with torch.no_grad():
        got = sub(x)
    (act,) = seen
    scaled = full.down_proj.weight[:, keep].detach().double() * (model.config.intermediate_size / len(keep))
    w_sub = sub.down_proj.weight.detach()
    bound = matmul_bound(act, w_sub.T) + act.abs().double() @ (w_sub.double() - scaled).abs().T
    assert_within(got, act.double() @ scaled.T, bound)


def assert_round_trip(got: torch.Tensor, want: torch.Tensor) -> None:
    """A coordinate sent and written back unchanged: ``fl(fl(x s) / s)`` with the float32 scaler ``s``, within
    ``gamma_3 |x|`` of ``x`` (one rounding each for the scaling, the division, and the reciprocal should the
    division be done as a multiplication by it); exact where no scaler applies."""
    assert_within(got, want, gamma(3, torch.float32) * want.double().abs())


@pytest.mark.parametrize("width", [0.25, 0.5, 0.75, 1.0])
def test_extract_then_write_back_unchanged_leaves_the_target_unchanged(model, width):
    state = model.state_dict()
    plan = plan_slice(model.config, width, "rolling", server_round=4, stride=0.25)
    avg = SelectiveAverager(state, model.config)
    avg.add(extract(state, model.config, plan), plan)
    for name, value in avg.result().items():
        assert_round_trip(value, state[name])


def test_identical_updates_aggregate_to_that_update(model):
    state = model.state_dict()
    plan = plan_slice(model.config, 0.5, "static")
    update = {k: v + 0.01 for k, v in extract(state, model.config, plan).items()}
    avg = SelectiveAverager(state, model.config)
    avg.add(update, plan, weight=3.0)
    avg.add({k: v.clone() for k, v in update.items()}, plan, weight=1.0)
    single = SelectiveAverager(state, model.config)
    single.add(update, plan)
    for name, value in avg.result().items():  # (fl(3 v) + v) / 4 against v / 1: two roundings, the / 4 exact
        assert_within(value, single.result()[name], gamma(2, torch.float32) * single.result()[name].double().abs())


def test_the_mean_is_taken_in_the_sums_storage_once_and_is_the_plain_quotient(model):
    """``result()`` divides the sums in place (no second target-sized copy at the round's peak): the values are the
    out-of-place ``where(count > 0, sum / count, old)`` bit for bit; a second call gives the same dict, and an averager
    whose mean was taken refuses another reply rather than fold it into a divided sum."""
    state = model.state_dict()
    plans = [plan_slice(model.config, 0.5, "rolling", server_round=r, stride=0.25) for r in (1, 2)]
    avg = SelectiveAverager(state, model.config)
    for i, plan in enumerate(plans):
        avg.add({k: v + 0.01 * (i + 1) for k, v in extract(state, model.config, plan).items()}, plan, weight=i + 1.0)
    counts = {k: avg.count(k) for k in state}
    want = {k: torch.where(c > 0, avg.sums[k] / c.clamp_min(1e-12), state[k].float()) if bool((c > 0).any())
            else state[k].clone() for k, c in counts.items()}
    storage = {k: v.data_ptr() for k, v in avg.sums.items()}
    got = avg.result()
    held = [k for k, c in counts.items() if bool((c > 0).any())]
    assert held and all(got[k].data_ptr() == storage[k] for k in held)
    assert all(torch.equal(got[k], want[k]) for k in state)
    assert avg.result() is got
    with pytest.raises(RuntimeError, match="already taken"):
        avg.add(extract(state, model.config, plans[0]), plans[0])


def test_each_coordinate_count_is_the_number_of_clients_that_held_it(model):
    cfg = model.config
    state = model.state_dict()
    plans = [plan_slice(cfg, w, "rolling", server_round=r, stride=0.25) for w, r in ((0.25, 1), (0.5, 2), (0.25, 4))]
    avg = SelectiveAverager(state, cfg)
    for plan in plans:
        avg.add(extract(state, cfg, plan), plan)
    d, group = cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    for unit in range(cfg.num_key_value_heads):
        held = sum(unit in p.attn_units for p in plans)
        assert torch.all(avg.count("model.layers.0.self_attn.k_proj.weight")[unit * d : (unit + 1) * d] == held)
        cols = slice(unit * group * d, (unit + 1) * group * d)
        assert torch.all(avg.count("model.layers.1.self_attn.o_proj.weight")[:, cols] == held)
    for neuron in range(cfg.intermediate_size):
        held = sum(neuron in p.neurons for p in plans)
        assert torch.all(avg.count("model.layers.0.mlp.up_proj.weight")[neuron] == held)
        assert torch.all(avg.count("model.layers.0.mlp.down_proj.weight")[:, neuron] == held)
    assert torch.all(avg.count("model.embed_tokens.weight") == len(plans))
    assert torch.all(avg.count("model.norm.weight") == len(plans))


def test_uncovered_coordinates_keep_their_old_value(model):
    state = model.state_dict()
    plan = plan_slice(model.config, 0.25, "static")
    avg = SelectiveAverager(state, model.config)
    avg.add({k: torch.zeros_like(v) for k, v in extract(state, model.config, plan).items()}, plan)
    new = avg.result()
    units = model.config.intermediate_size // 4
    assert torch.all(new["model.layers.0.mlp.gate_proj.weight"][:units] == 0)
    assert torch.equal(new["model.layers.0.mlp.gate_proj.weight"][units:], state["model.layers.0.mlp.gate_proj.weight"][units:])
    assert 0 < avg.coverage() < 1


@pytest.mark.parametrize("width,stride", [(0.25, 0.25), (0.5, 0.125), (0.125, 0.125)])
def test_rolling_covers_every_unit_equally_often_over_one_period(width, stride):
    from tests.conftest import tiny_config

    cfg = tiny_config(heads=8, kv_heads=8, hidden=64, inter=64)
    for axis in ("heads", "neurons"):
        total = axis_sizes(cfg)[axis]
        period = math.ceil(total / rolling_step(total, stride))
        assert total % rolling_step(total, stride) == 0  # chosen so that one period is whole
        hits = torch.zeros(total)
        for rnd in range(1, period + 1):
            plan = plan_slice(cfg, width, "rolling", rnd, stride)
            hits[list(plan.units(axis))] += 1
        assert torch.all(hits == hits[0]) and hits[0] > 0


def test_static_keeps_the_prefix_every_round():
    from tests.conftest import tiny_config

    cfg = tiny_config()
    plans = {plan_slice(cfg, 0.5, p, r) for r in range(1, 6) for p in ("static", "ordered")}
    assert plans == {SlicePlan(attn_units=(0, 1), neurons=tuple(range(24)), hidden=tuple(range(32)), layers=(0, 1))}


@pytest.mark.parametrize("bad", ["nan", "shape", "keys"])
def test_malformed_update_is_rejected_and_changes_nothing(model, bad):
    state = model.state_dict()
    plan = plan_slice(model.config, 0.5, "static")
    update = extract(state, model.config, plan)
    if bad == "nan":
        update["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    elif bad == "shape":
        update["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    else:
        update.pop("model.norm.weight")
    avg = SelectiveAverager(state, model.config)
    with pytest.raises(ValueError):
        avg.add(update, plan)
    assert all(torch.all(c == 0) for c in map(avg.count, avg.target))
    assert avg.clients == 0


def test_invalid_width_and_policy_are_named():
    from tests.conftest import tiny_config

    with pytest.raises(ValueError, match="width"):
        plan_slice(tiny_config(), 1.5, "static")
    with pytest.raises(ValueError, match="policy"):
        plan_slice(tiny_config(), 0.5, "sideways")


def test_staggered_windows_of_one_round_tile_the_axis():
    from tests.conftest import tiny_config

    cfg = tiny_config(heads=8, kv_heads=8, hidden=64, inter=64)
    widths, offset, plans = [0.5, 0.25, 0.125, 0.125], 0.0, []
    for w in widths:
        plans.append(plan_slice(cfg, w, "rolling", server_round=3, stride=0.125, offset=offset))
        offset += w
    for axis in ("heads", "neurons"):
        held = sorted(u for p in plans for u in p.units(axis))
        assert held == list(range(axis_sizes(cfg)[axis]))  # every unit exactly once
    shared = [plan_slice(cfg, w, "rolling", server_round=3, stride=0.125) for w in widths]
    assert set().union(*(p.neurons for p in shared)) == set(shared[0].neurons)  # FedRolex: widest window only


def test_as_ranges_compacts_wrapped_windows():
    assert as_ranges((0, 1, 6, 7)) == [[0, 1], [6, 7]]
    assert as_ranges((3,)) == [[3, 3]]


def test_random_policy_is_seeded_per_client_and_covers_units_uniformly():
    from tests.conftest import tiny_config

    cfg = tiny_config(heads=8, kv_heads=8, hidden=64, inter=64)
    a = plan_slice(cfg, 0.25, "random", server_round=1, seed=11)
    assert a == plan_slice(cfg, 0.25, "random", server_round=1, seed=11)
    assert a != plan_slice(cfg, 0.25, "random", server_round=1, seed=12)
    assert len(a.attn_units) == 2 and len(a.neurons) == 16
    hits = torch.zeros(64)
    for seed in range(400):
        hits[list(plan_slice(cfg, 0.25, "random", seed=seed).neurons)] += 1
    assert hits.sum() == 400 * 16
    assert hits.min() > 0.6 * 100 and hits.max() < 1.4 * 100  # each neuron held ~1/4 of the time


def test_random_slices_still_write_back_exactly(model):
    state = model.state_dict()
    plan = plan_slice(model.config, 0.5, "random", seed=3)
    avg = SelectiveAverager(state, model.config)
    avg.add(extract(state, model.config, plan), plan)
    for name, value in avg.result().items():
        assert_round_trip(value, state[name])


@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
def test_robust_rules_ignore_an_outlier_client(model, rule):
    state = model.state_dict()
    plan = plan_slice(model.config, 0.5, "static")
    base = extract(state, model.config, plan)
    avg = SelectiveAverager(state, model.config, rule=rule, trim=0.2)
    for shift in (0.0, 0.01, 0.02, 0.03, 1000.0):  # five clients, the last one wild
        avg.add({k: v + shift for k, v in base.items()}, plan)
    new = extract(avg.result(), model.config, plan)
    expected = 0.02  # median of the five shifts; trimming 0.2 of 5 drops one at each end: mean(.01, .02, .03)
    # float32 roundings of |base| + 0.03 at most: the shifts' constants and additions (2), the staging's division by
    # the scaler (2), the trimmed mean's sum of three and division (3), extract's scaling (1), the expected's sum (1)
    norm = base["model.norm.weight"]
    assert_within(new["model.norm.weight"], norm + expected, gamma(9, torch.float32) * (norm.double().abs() + 0.03))
    mean = SelectiveAverager(state, model.config)
    for shift in (0.0, 0.01, 0.02, 0.03, 1000.0):
        mean.add({k: v + shift for k, v in base.items()}, plan)
    assert float(extract(mean.result(), model.config, plan)["model.norm.weight"].mean()) > 100


def test_robust_rules_respect_which_clients_held_a_coordinate(model):
    cfg = model.config
    state = model.state_dict()
    wide, narrow = plan_slice(cfg, 1.0, "static"), plan_slice(cfg, 0.5, "static")
    avg = SelectiveAverager(state, cfg, rule="median")
    avg.add({k: torch.zeros_like(v) for k, v in extract(state, cfg, wide).items()}, wide)
    avg.add({k: torch.ones_like(v) for k, v in extract(state, cfg, narrow).items()}, narrow)
    avg.add({k: torch.ones_like(v) for k, v in extract(state, cfg, narrow).items()}, narrow)
    up = avg.result()["model.layers.0.mlp.up_proj.weight"]
    half = cfg.intermediate_size // 2
    assert torch.all(up[:half] == 1) and torch.all(up[half:] == 0)  # outer rows: only the wide client's 0


def test_unknown_aggregate_rule_is_named(model):
    with pytest.raises(ValueError, match="aggregate"):
        SelectiveAverager(model.state_dict(), model.config, rule="mode")


def test_default_axes_repeat_the_foundations_plans_exactly():
    """Llama recipes that name no axes slice heads and neurons only, drawing the same units as before
    hidden and depth existed (so saved quickstart runs reproduce)."""
    from tests.conftest import tiny_config

    cfg = tiny_config(heads=8, kv_heads=2, hidden=32, inter=48)
    random = plan_slice(cfg, 0.25, "random", 1, 0.125, 0.0, 11)
    assert (random.attn_units, random.neurons) == ((1,), (0, 6, 13, 15, 16, 19, 23, 25, 26, 28, 30, 44))
    rolling = plan_slice(cfg, 0.5, "rolling", 3, 0.125, 0.25)
    assert (rolling.attn_units, rolling.neurons) == ((0,), tuple(range(24, 48)))
    assert rolling.hidden == tuple(range(32)) and rolling.layers == (0, 1)
    assert rolling.assignment() == {"attn_units": [[0, 0]], "neurons": [[24, 47]], "hidden": [[0, 31]], "layers": [[0, 1]]}


def test_scaler_off_sends_the_target_coordinates_unscaled(model):
    plan = plan_slice(model.config, 0.5, "static", scale=False)
    sub = extract(model.state_dict(), model.config, plan)
    full = model.state_dict()["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(sub["model.layers.0.mlp.down_proj.weight"], full[:, :24])
    avg = SelectiveAverager(model.state_dict(), model.config)
    avg.add(sub, plan)
    assert torch.equal(avg.result()["model.layers.0.mlp.down_proj.weight"], full)


def test_depth_slice_of_a_llama_runs_with_its_kept_layers_renamed():
    from tests.conftest import tiny_config

    cfg = tiny_config()
    cfg.num_hidden_layers = 5
    torch.manual_seed(0)
    target = model_from_state(cfg, LlamaForCausalLM(cfg).state_dict())
    plan = plan_slice(cfg, 0.6, "rolling", server_round=3, stride=1 / 3, axes=("depth",))
    assert plan.layers == (0, 3, 4)
    sub = sub_model(target, plan)
    assert sub.config.num_hidden_layers == 3
    assert torch.equal(sub.model.layers[1].mlp.up_proj.weight, target.model.layers[3].mlp.up_proj.weight)
    sub(torch.randint(0, 50, (1, 5)), labels=torch.randint(0, 50, (1, 5))).loss.backward()


def test_plan_that_does_not_fit_the_config_is_named(model):
    with pytest.raises(ValueError, match="plan.attn_units"):
        extract(model.state_dict(), model.config, SlicePlan(attn_units=(9,), neurons=(0,), hidden=(0,), layers=(0,)))
    with pytest.raises(ValueError, match="plan: no 'hidden'"):
        sub_config(model.config, SlicePlan(attn_units=(0,), neurons=(0,)))


def test_sub_scales_name_the_tensors_that_carry_the_folded_scaler(model):
    cfg = model.config
    plan = plan_slice(cfg, 0.5, "static")
    scales = sub_scales(cfg, plan, model.state_dict())
    assert set(scales) == {f"model.layers.{i}.{p}.weight" for i in range(2) for p in ("self_attn.o_proj", "mlp.down_proj")}
    assert set(scales.values()) == {2.0}
    assert sub_scales(cfg, plan_slice(cfg, 1.0, "static"), model.state_dict()) == {}
