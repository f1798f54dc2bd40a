"""Slicing invariants for every family (Llama, Mistral, Qwen2, GPT-2, OPT, the GroupNorm CNN) and axis."""

from __future__ import annotations

import json
import math

import pytest
import torch
from fp_bounds import assert_within, gamma
from model_bounds import output_bound
from transformers import GPT2Config, LlamaConfig, MistralConfig, OPTConfig, Qwen2Config

from fedfusion.models.cnn import FedCNNConfig
from fedfusion.models.families import config_from_dict, family_of
from fedfusion.models.slicing import (
    SelectiveAverager,
    SlicePlan,
    axis_sizes,
    extract,
    plan_slice,
    rolling_step,
    sub_config,
    tensor_slices,
)
from tests.test_slicing import assert_round_trip

torch.set_num_threads(1)
pytestmark = pytest.mark.usefixtures("one_thread")  # and per test: a test elsewhere may have raised the count since import

CONFIGS = {
    "llama": lambda: LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=4, max_position_embeddings=32, tie_word_embeddings=True,
        attention_bias=True, mlp_bias=True),
    "mistral": lambda: MistralConfig(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32),
    "qwen2": lambda: Qwen2Config(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32),
    "gpt2": lambda: GPT2Config(vocab_size=40, n_embd=32, n_layer=4, n_head=4, n_positions=32, bos_token_id=0,
                               eos_token_id=0),
    "opt": lambda: OPTConfig(vocab_size=40, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, ffn_dim=48,
                             max_position_embeddings=32, word_embed_proj_dim=32, bos_token_id=0, eos_token_id=0,
                             pad_token_id=1),
    "cnn": lambda: FedCNNConfig(channels=[8, 16, 16], groups=4, image_size=12),
}
LMS = ("llama", "mistral", "qwen2", "gpt2", "opt")
# Axis sets per family: each axis on its own (GPT-2/OPT slice heads with hidden), and all together.
AXIS_SETS = {
    **{f: [("heads",), ("neurons",), ("hidden",), ("depth",), ("heads", "neurons", "hidden", "depth")]
       for f in ("llama", "mistral", "qwen2")},
    **{f: [("heads", "hidden"), ("neurons",), ("depth",), ("heads", "neurons", "hidden", "depth")] for f in ("gpt2", "opt")},
    "cnn": [("channels",)],
}
CASES = [(f, axes) for f, sets in AXIS_SETS.items() for axes in sets]
CASE_IDS = [f"{f}-{'+'.join(a)}" for f, a in CASES]
_MODELS: dict[str, torch.nn.Module] = {}


def target(family: str):
    """A seeded tiny target of ``family`` (built once per test session)."""
    if family not in _MODELS:
        torch.manual_seed(0)
        cfg = CONFIGS[family]()
        _MODELS[family] = family_of(cfg).build(cfg).eval()
    return _MODELS[family]


def inputs(family: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    if family == "cnn":
        return {"pixel_values": torch.randn(2, 1, 12, 12, generator=gen), "labels": torch.tensor([1, 7])}
    ids = torch.randint(0, 40, (2, 9), generator=gen)
    return {"input_ids": ids, "labels": ids}


def sub_model(model, plan: SlicePlan):
    sub = family_of(model.config).build(sub_config(model.config, plan))
    sub.load_state_dict(extract(model.state_dict(), model.config, plan), strict=True)
    return sub.eval()


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("policy", ["rolling", "random"])
def test_width_one_is_the_full_model_bit_for_bit(family, policy):
    model = target(family)
    plan = plan_slice(model.config, 1.0, policy, server_round=3, seed=5, axes=family_of(model.config).axes)
    state = model.state_dict()
    sub_state = extract(state, model.config, plan)
    assert sub_state.keys() == state.keys()
    assert all(torch.equal(sub_state[k], state[k]) for k in state)
    sub = sub_model(model, plan)
    with torch.no_grad():
        assert torch.equal(sub(**inputs(family)).logits, model(**inputs(family)).logits)


@pytest.mark.parametrize("family,axes", CASES, ids=CASE_IDS)
def test_extract_then_write_back_unchanged_is_the_identity(family, axes):
    model = target(family)
    state = model.state_dict()
    plan = plan_slice(model.config, 0.4, "random", seed=3, axes=axes)  # arbitrary, non-contiguous units
    avg = SelectiveAverager(state, model.config)
    avg.add(extract(state, model.config, plan), plan)
    for name, value in avg.result().items():
        assert_round_trip(value, state[name])  # tests/test_slicing.py: within gamma_3 |x|


@pytest.mark.parametrize("family,axes", CASES, ids=CASE_IDS)
def test_sliced_model_is_a_smaller_genuine_model_that_trains(family, axes):
    model = target(family)
    plan = plan_slice(model.config, 0.5, "rolling", server_round=2, stride=0.25, axes=axes)
    sub = sub_model(model, plan).train()
    assert type(sub) is type(model)
    assert sum(p.numel() for p in sub.parameters()) < sum(p.numel() for p in model.parameters())
    out = sub(**inputs(family))
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in sub.parameters())
    rebuilt = config_from_dict(json.loads(json.dumps(sub.config.to_dict())))  # what a client receives
    family_of(rebuilt).build(rebuilt).load_state_dict(sub.state_dict(), strict=True)


@pytest.mark.parametrize("family,axes", CASES, ids=CASE_IDS)
def test_identical_updates_aggregate_to_that_update(family, axes):
    model = target(family)
    state = model.state_dict()
    plan = plan_slice(model.config, 0.5, "rolling", server_round=3, stride=0.25, axes=axes)
    update = {k: v + 0.01 for k, v in extract(state, model.config, plan).items()}
    avg = SelectiveAverager(state, model.config)
    avg.add(update, plan, weight=3.0)
    avg.add({k: v.clone() for k, v in update.items()}, plan, weight=1.0)
    got = extract(avg.result(), model.config, plan)
    for name, value in update.items():  # float32 roundings: u / s (2, the reciprocal's included), fl(3 v) + v (2),
        assert_within(got[name], value, gamma(5, torch.float32) * value.double().abs())  # / 4 exact, * s (1)


def _coordinate_ids(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each target coordinate holds its own id (float64 keeps them exact)."""
    out, start = {}, 0
    for name, value in state.items():
        out[name] = torch.arange(start, start + value.numel(), dtype=torch.float64).view(value.shape)
        start += value.numel()
    return out


@pytest.mark.parametrize("family,axes", CASES, ids=CASE_IDS)
def test_each_coordinate_count_is_the_number_of_clients_whose_slice_held_it(family, axes):
    model = target(family)
    cfg, state = model.config, model.state_dict()
    plans = [plan_slice(cfg, w, p, server_round=r, stride=0.25, seed=r, axes=axes, scale=False)
             for w, p, r in ((0.25, "rolling", 1), (0.5, "rolling", 2), (0.25, "random", 4), (0.75, "static", 1))]
    ids = _coordinate_ids(state)
    expected = torch.zeros(sum(v.numel() for v in state.values()))
    avg = SelectiveAverager(state, cfg)
    for plan in plans:
        for value in extract(ids, cfg, plan).values():  # the coordinates this client was sent
            expected[value.flatten().long()] += 1
        avg.add(extract(state, cfg, plan), plan)
    got = torch.cat([avg.count(name).flatten() for name in state])
    assert torch.equal(got, expected)
    assert 0 < avg.coverage() <= 1


def test_gpt2_fused_qkv_columns_follow_heads_in_each_third():
    model = target("gpt2")
    cfg = model.config
    plans = [plan_slice(cfg, 0.5, "rolling", server_round=r, stride=0.25, axes=("heads", "hidden")) for r in (1, 2, 4)]
    avg = SelectiveAverager(model.state_dict(), cfg)
    for plan in plans:
        avg.add(extract(model.state_dict(), cfg, plan), plan)
    counts, d, h = avg.count("transformer.h.1.attn.c_attn.weight"), cfg.n_embd // cfg.n_head, cfg.n_embd
    for third in range(3):
        for head in range(cfg.n_head):
            for row in (0, 13, 31):
                held = sum(head in p.attn_units and row in p.hidden for p in plans)
                assert torch.all(counts[row, third * h + head * d: third * h + (head + 1) * d] == held)


def test_dropped_layers_are_neither_sent_nor_changed():
    model = target("opt")
    cfg, state = model.config, model.state_dict()
    plan = plan_slice(cfg, 0.5, "rolling", server_round=2, stride=0.5, axes=("depth",))
    assert plan.layers[0] == 0 and plan.layers[-1] == cfg.num_hidden_layers - 1 and len(plan.layers) == 2
    sub = extract(state, cfg, plan)
    assert {k.split(".")[3] for k in sub if ".layers." in k} == {"0", "1"}  # kept layers renamed 0..n-1
    assert torch.equal(sub["model.decoder.layers.1.fc1.weight"], state["model.decoder.layers.3.fc1.weight"])  # a copy
    avg = SelectiveAverager(state, cfg)
    avg.add({k: torch.zeros_like(v) for k, v in sub.items()}, plan)
    new = avg.result()
    assert torch.equal(new["model.decoder.layers.1.fc1.weight"], state["model.decoder.layers.1.fc1.weight"])
    assert torch.all(new["model.decoder.layers.3.fc1.weight"] == 0)


@pytest.mark.parametrize("family,axes", CASES, ids=CASE_IDS)
def test_rolling_covers_every_unit_equally_often_over_one_period(family, axes):
    cfg = target(family).config
    sizes = axis_sizes(cfg)
    for width, stride in ((0.25, 0.25), (0.5, 0.5)):
        for axis in (a for a in axes if a != "depth"):
            step = rolling_step(sizes[axis], stride)
            assert sizes[axis] % step == 0  # the configs are chosen so that one period is whole
            hits = torch.zeros(sizes[axis])
            for rnd in range(1, sizes[axis] // step + 1):
                hits[list(plan_slice(cfg, width, "rolling", rnd, stride, axes=axes).units(axis))] += 1
            assert torch.all(hits == hits[0]) and hits[0] > 0


@pytest.mark.parametrize("family", LMS)
def test_rolling_depth_keeps_first_and_last_and_covers_the_middle_equally(family):
    cfg = CONFIGS[family]()
    cfg.num_hidden_layers = 8  # every LM config reads its depth from here (GPT-2 through its attribute map)
    middle, width, stride = 6, 0.5, 1 / 3  # 4 layers kept: first, last and 2 of the 6 middle ones
    step = rolling_step(middle, stride)
    hits = torch.zeros(8)
    for rnd in range(1, middle // step + 1):
        plan = plan_slice(cfg, width, "rolling", rnd, stride, axes=("depth",))
        assert len(plan.layers) == 4 and plan.layers[0] == 0 and plan.layers[-1] == 7
        hits[list(plan.layers)] += 1
    assert hits[0] == hits[7] == middle // step
    assert torch.all(hits[1:7] == 1)
    static = {plan_slice(cfg, width, "static", r, axes=("depth",)).layers for r in (1, 2, 3)}
    assert static == {(0, 1, 2, 7)}


def _masked_full(model, plan: SlicePlan):
    """The full model with every coordinate outside ``plan`` zeroed (so it computes only the kept units)."""
    cfg, state = model.config, model.state_dict()
    avg = SelectiveAverager({k: torch.zeros_like(v) for k, v in state.items()}, cfg)
    avg.add(extract(state, cfg, plan), plan)
    full = family_of(cfg).build(cfg).eval()
    full.load_state_dict(avg.result())
    return full


def _blocks(model, family: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention, MLP) outputs of layer 1 of ``model`` on hidden states ``x``."""
    if family == "gpt2":
        layer = model.transformer.h[1]
        return layer.attn(x)[0], layer.mlp(x)
    if family == "opt":
        layer = model.model.decoder.layers[1]
        return layer.self_attn(hidden_states=x)[0], layer.fc2(layer.activation_fn(layer.fc1(x)))
    layer = model.model.layers[1]
    rope = model.model.rotary_emb(x, torch.arange(x.shape[1]).unsqueeze(0))
    return layer.self_attn(hidden_states=x, position_embeddings=rope, attention_mask=None)[0], layer.mlp(x)


@pytest.mark.parametrize("family", LMS)
def test_sliced_attention_and_mlp_compute_exactly_the_kept_heads_and_neurons(family):
    """Per-head q/k/v (GPT-2: inside the fused, transposed c_attn), GQA groups and the MLP are cut consistently:
    without the scaler, the sub-model's blocks equal the full blocks with every other unit zeroed. In float64 (the
    float32 weights exactly): an identity of the algebra, proven to float64 rounding: each side's block output within
    model_bounds.output_bound of the exact one (every product's ``gamma_k |x| |W|`` carried to each output entry by
    that entry's own derivatives, doubled for the ops between), so the two within the sum of their bounds (about
    1e-12 of the outputs: a unit cut inconsistently moves them by its share); in float32 the two sides' products of
    different lengths round differently through softmax and norms, with no bound worth asserting."""
    model = target(family)
    cfg = model.config
    axes = ("heads", "neurons", "hidden")
    plan = plan_slice(cfg, 0.5, "rolling", server_round=2, stride=0.25, axes=axes, scale=False)
    full, sub = _masked_full(model, plan).double(), sub_model(model, plan).double()
    hidden = torch.tensor(plan.hidden)
    x = torch.zeros(2, 7, axis_sizes(cfg)["hidden"], dtype=torch.float64)
    x[..., hidden] = torch.randn(2, 7, len(hidden), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        outputs = list(zip(_blocks(sub, family, x[..., hidden]), _blocks(full, family, x)))
    for block, (got, want) in enumerate(outputs):
        bound = output_bound(lambda v, m=sub, j=block: _blocks(m, family, v)[j], x[..., hidden], sub) \
            + output_bound(lambda v, m=full, j=block: _blocks(m, family, v)[j], x, full)[..., hidden]
        assert bound.max() < 1e-9 * got.abs().max()  # a bound that could fail
        assert_within(got, want[..., hidden], bound)


def test_scaler_multiplies_contracting_weights_by_full_over_kept():
    model = target("llama")
    cfg = model.config
    axes = ("heads", "neurons", "hidden")
    plan = plan_slice(cfg, 0.5, "static", axes=axes)
    plain = extract(model.state_dict(), cfg, SlicePlan(**{**plan.__dict__, "scale": False}))
    scaled = extract(model.state_dict(), cfg, plan)
    factor = {"q_proj": 32 / 16, "o_proj": 4 / 2, "down_proj": 48 / 24, "up_proj": 2.0}
    for proj, f in factor.items():  # powers of two: the scaling is exact in float32, bit for bit
        name = next(k for k in plain if proj in k and k.endswith("weight"))
        assert torch.equal(scaled[name], plain[name] * f)
    assert torch.equal(scaled["model.norm.weight"], plain["model.norm.weight"] * 2)  # lm_head's, tied
    assert torch.equal(scaled["model.embed_tokens.weight"], plain["model.embed_tokens.weight"])


def test_cnn_groupnorm_groups_stay_whole_and_exact():
    """Float64 (the float32 weights exactly), as the attention and MLP test above: the identity to float64
    rounding, each side's blocks so far within model_bounds.output_bound of the exact output (the convolutions'
    ``gamma_{k+1} (|x| * |W| + |b|)`` and GroupNorm's ``gamma_{n+7}`` terms carried to each entry by its own
    derivatives, doubled), the two within the sum of their bounds."""
    model = target("cnn")
    cfg = model.config
    plan = plan_slice(cfg, 0.5, "rolling", server_round=2, stride=0.25, scale=False)
    full, sub = _masked_full(model, plan).double(), sub_model(model, plan).double()
    assert sub.config.groups == 2 and sub.config.channels == [4, 8, 8]
    x = torch.randn(2, 1, 12, 12, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def through(model, layers: int):
        """The model's first ``layers`` blocks as one function of the images."""

        def run(v: torch.Tensor) -> torch.Tensor:
            for blk in model.blocks[:layers]:
                v = blk(v)
            return v
        return run

    a, b = x, x
    for layer, (fb, sb) in enumerate(zip(full.blocks, sub.blocks)):
        block = cfg.channels[layer] // cfg.groups
        kept = torch.tensor([u * block + i for u in plan.channels for i in range(block)])
        with torch.no_grad():
            a, b = fb(a), sb(b)
        bound = output_bound(through(sub, layer + 1), x, sub) + output_bound(through(full, layer + 1), x, full)[:, kept]
        assert bound.max() < 1e-9 * b.abs().max()  # a bound that could fail
        assert_within(b, a[:, kept], bound)  # GroupNorm stats are the group's own


def test_opt_125m_shaped_config_slices_every_axis():
    cfg = OPTConfig(vocab_size=50272, hidden_size=768, num_hidden_layers=12, ffn_dim=3072, num_attention_heads=12,
                    max_position_embeddings=2048, word_embed_proj_dim=768, do_layer_norm_before=True)
    family = family_of(cfg)
    with torch.device("meta"):
        state = family.build(cfg).state_dict()
    assert math.isclose(sum(v.numel() for k, v in state.items() if k != "lm_head.weight") / 1e6, 125.2, abs_tol=0.1)
    for width in (0.125, 0.5, 1.0):
        plan = plan_slice(cfg, width, "rolling", server_round=5, axes=("heads", "neurons", "hidden", "depth"))
        sub_cfg = sub_config(cfg, plan)
        assert sub_cfg.hidden_size == sub_cfg.num_attention_heads * 64 == len(plan.hidden)
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in family.build(sub_cfg).state_dict().items()}
        got = {s.sub_name: tuple(state[name][s.index[0] if s.index and s.index[0] is not None else slice(None)].shape)
               for name, s in tensor_slices(state, cfg, plan).items() if all(i is None for i in s.index[1:])}
        assert got.items() <= expected.items()  # every tensor sliced on its first dim only
        sub = extract(state, cfg, plan)
        assert {k: tuple(v.shape) for k, v in sub.items()} == expected


@pytest.mark.parametrize("case,message", [
    (lambda: plan_slice(CONFIGS["gpt2"](), 0.5, "static", axes=("heads",)), "together"),
    (lambda: plan_slice(CONFIGS["opt"](), 0.5, "static", axes=("neurons", "bogus")), "bogus"),
    (lambda: plan_slice(CONFIGS["cnn"](), 0.5, "static", axes=("heads",)), "channels"),
    (lambda: plan_slice(OPTConfig(hidden_size=64, word_embed_proj_dim=32, num_attention_heads=4, ffn_dim=64,
                                  do_layer_norm_before=False), 0.5, "static", axes=("heads", "hidden")), "pre-norm"),
    (lambda: sub_config(CONFIGS["llama"](), SlicePlan(attn_units=(0,), neurons=(0,))), "hidden"),
    (lambda: sub_config(CONFIGS["opt"](), plan_slice(CONFIGS["cnn"](), 0.5, "static")), "attn_units"),
    (lambda: extract({}, CONFIGS["opt"](), SlicePlan((0,), (99,), tuple(range(32)), (0, 3))), "plan.neurons"),
    (lambda: family_of(CONFIGS["llama"]().__class__.from_dict({"model_type": "bert"})), "model_type"),
])
def test_bad_axes_plans_and_families_are_named(case, message):
    with pytest.raises(ValueError, match=message):
        case()


@pytest.mark.parametrize("family", list(CONFIGS))
def test_param_count_matches_the_built_model(family):
    model = target(family)
    plan = plan_slice(model.config, 0.5, "static", axes=family_of(model.config).axes)
    sub = sub_model(model, plan)
    assert family_of(sub.config).param_count(sub.config) == sum(p.numel() for p in sub.parameters())
