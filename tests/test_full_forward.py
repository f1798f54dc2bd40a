"""Full-forward windows (fedfusion.models.full_forward): exact gradients of the whole target, only the window moves."""

from __future__ import annotations

import pytest
import torch
from fp_bounds import assert_within, matmul_bound
from transformers import LlamaConfig

from fedfusion.fusion.base import Client
from fedfusion.fusion.submodel.method import SubModelMethod
from fedfusion.models.build import model_from_state
from fedfusion.models.families import family_of
from fedfusion.models.full_forward import WindowModel, window_params, with_core
from fedfusion.models.slicing import extract, plan_slice, scatter, tensor_slices
from fedfusion.train.loop import lm_loss, train_steps
from tests.test_frozen import _operands


def config() -> LlamaConfig:
    return LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, head_dim=8, tie_word_embeddings=True, max_position_embeddings=32)


def setup(axes=("heads", "neurons")):
    cfg = config()
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in family_of(cfg).build(cfg).state_dict().items()}
    plan = plan_slice(cfg, 0.25, "rolling", server_round=2, stride=0.25, axes=axes, scale=False)
    return cfg, state, plan, torch.randint(0, cfg.vocab_size, (24, 17))


def test_the_window_model_computes_the_target():
    cfg, state, plan, data = setup()
    model = WindowModel(cfg, state, extract(state, cfg, plan), plan)
    with torch.no_grad():
        want = model_from_state(cfg, state)(input_ids=data[:, :-1]).logits
        got = model(input_ids=data[:, :-1]).logits
    assert torch.equal(want, got)


def test_window_training_is_the_targets_gradient_restricted_to_the_window():
    """The window's gradient is the whole target's gradient restricted to the window, so AdamW (coordinate-wise) on
    the window is AdamW on the target with every gradient outside the window zeroed.

    Checked on one backward: the window model runs the target's forward on the same values (the loss bit for bit);
    a packed layer's window gradient is the product of the window's rows of ``g`` and columns of ``x`` over the N
    tokens, the target's the same entries of the full ``g^T x``: each within ``gamma_N |g|^T |x|`` of the exact
    product (fp_bounds), so within twice that of each other; every other window gradient (norms, embeddings) runs
    the same operations, bit for bit. Trained values are not compared: after AdamW's first step
    (``g / (|g| + eps)``) a rounding-level gradient difference is no longer small."""
    cfg, state, plan, data = setup(("heads", "neurons", "hidden"))
    model = WindowModel(cfg, state, extract(state, cfg, plan), plan)
    reference = model_from_state(cfg, state)
    seen = _operands(model)
    loss, want_loss = lm_loss(model, data[:8])[0], lm_loss(reference, data[:8])[0]
    assert torch.equal(loss, want_loss)
    loss.backward()
    want_loss.backward()
    want = extract({n: p.grad for n, p in reference.named_parameters()}, cfg, plan)
    sub_of = {id(model.window[key]): sub for sub, key in model._keys.items()}
    bounded = set()
    for m, x, g in seen.values():
        slot, (rows, cols) = m._window
        values = slot()
        x, g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        g_r = g if rows is None else g.index_select(1, rows)
        x_c = x if cols is None else x.index_select(1, cols)
        assert_within(values.grad, want[sub_of[id(values)]], 2 * matmul_bound(g_r.T, x_c))
        bounded.add(sub_of[id(values)])
    assert bounded and set(model._keys) - bounded  # packed layers' windows and the rest
    for sub, key in model._keys.items():
        if sub not in bounded:
            assert torch.equal(model.window[key].grad, want[sub]), sub
    before = model.trained()
    train_steps(model, data, steps=5, lr=1e-2, batch_size=8, seed=3)
    assert max(float((value - before[key]).abs().max()) for key, value in model.trained().items()) > 1e-3  # it trained


def test_frozen_coordinates_never_move_even_with_weight_decay():
    cfg, state, plan, data = setup()
    model = WindowModel(cfg, state, extract(state, cfg, plan), plan)
    before = {k: v.clone() for k, v in model.target().state_dict().items()}
    train_steps(model, data, steps=3, lr=1e-2, batch_size=8, seed=0, weight_decay=0.1)
    after = model.target().state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    placed, trained = {k: v.clone() for k, v in state.items()}, model.trained()
    for name, sl in tensor_slices(list(state), cfg, plan).items():
        if sl.sub_name in trained:
            scatter(placed[name], sl.index, trained[sl.sub_name], accumulate=False)
    changed = sum(int((placed[k] != state[k]).sum()) for k in state if k != "lm_head.weight")
    assert 0 < changed <= window_params(cfg, state, plan)
    assert window_params(cfg, state, plan) < sum(v.numel() for k, v in state.items() if k != "lm_head.weight")


def test_a_core_window_adds_the_small_models_units_and_keeps_whole_axes_whole():
    cfg = config()
    window = plan_slice(cfg, 0.25, "rolling", server_round=3, stride=0.25, axes=("heads", "neurons"), scale=False)
    core = plan_slice(cfg, 0.25, "static", axes=("heads", "neurons", "hidden"))
    both = with_core(window, core)
    for axis in ("attn_units", "neurons"):
        assert set(getattr(both, axis)) == set(getattr(window, axis)) | set(getattr(core, axis))
        assert len(getattr(both, axis)) > len(getattr(window, axis))  # round 3's window is not the static prefix
    assert both.hidden == window.hidden == tuple(range(cfg.hidden_size))  # the residual stream stays whole


@pytest.mark.parametrize("policy", ["rolling", "random"])
def test_windows_drawn_outside_the_core_have_one_size_every_round_and_cover_every_unit(policy):
    """fusion.window_outside_core: each round's window is drawn from the units outside the core (the smallest
    width's static units), so core + window has one shape for the whole run (what a device program needs), where
    a window rolling over every unit shrinks its union with the core whenever they overlap. Over a rolling pass the
    windows still visit every unit outside the core."""
    cfg = config()
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in family_of(cfg).build(cfg).state_dict().items()}
    shapes, union_shapes, seen = set(), set(), {"attn_units": set(), "neurons": set()}
    for outside in (True, False):
        method = SubModelMethod(cfg, {"small": 0.25, "t": 0.25}, state, forward="full", scale=False, policy=policy,
                                stride=0.25, window_core=True, window_shared=True, outside_core=outside)
        core = method.small
        for server_round in range(1, 9):
            [payload] = method.payloads(server_round, state, [Client(partition=3, tier="t", seed=1)])
            plan = payload.context[0]
            shape = tuple(len(getattr(plan, a)) for a in ("attn_units", "neurons"))
            (shapes if outside else union_shapes).add(shape)
            for axis in seen:
                assert set(getattr(core, axis)) <= set(getattr(plan, axis))  # the core is in every window
                if outside:
                    seen[axis] |= set(getattr(plan, axis)) - set(getattr(core, axis))
    assert shapes == {(2, 32)}  # a quarter of the 4 heads and 64 neurons, plus the core's quarter
    if policy == "rolling":
        assert len(union_shapes) > 1  # the other draw's union changes size from round to round
        assert seen == {"attn_units": {1, 2, 3}, "neurons": set(range(16, 64))}
    assert not SubModelMethod(cfg, {"t": 0.25}, state, forward="full", window_core=False, outside_core=True).outside_core


def test_a_core_travels_in_the_window_spec_and_its_client_trains_it_in_the_small_forward_pass():
    """The payload of fusion.core_forward=small names the core in its WindowSpec (through the ConfigRecord round
    trip a message makes); the client's model then trains with the core loss, whose gradient reaches only the core:
    the target's loss alone leaves the core's coordinates without gradient."""
    from fedfusion.fusion.base import Client
    from fedfusion.fusion.submodel.method import SubModelMethod
    from fedfusion.models.full_forward import from_payload
    from fedfusion.train.loop import CORE, LM, lm_loss, loss_of
    from fedfusion.wire.keys import FROZEN
    from fedfusion.wire.quantize import decode
    from fedfusion.wire.specs import WindowSpec

    cfg = config()
    torch.manual_seed(0)
    state = family_of(cfg).build(cfg).state_dict()
    models = {}
    for core_forward in ("full", "small"):
        method = SubModelMethod(cfg, {"t": 0.25}, state, forward="full", frozen="int8", scale=False, stagger=False,
                                window_shared=True, window_core=True, core_forward=core_forward)
        payload = method.payloads(2, state, [Client(partition=0, tier="t", seed=3)])[0]
        spec = WindowSpec.from_config(WindowSpec.from_config(payload.spec).to_config())
        models[core_forward] = from_payload(cfg, decode(payload.arrays, keep=FROZEN), spec, 3)
    assert loss_of(models["full"]) is LM and loss_of(models["small"]) is CORE
    costs = {cf: SubModelMethod(cfg, {"t": 0.25}, state, forward="full", window_shared=True, window_core=True,
                                core_forward=cf).tier_cost("t").params for cf in ("full", "small")}
    assert costs["small"] - costs["full"] == models["small"].core_params() > 0  # the small model's own training, priced
    model = models["small"]
    batch = torch.randint(0, cfg.vocab_size, (4, 9))
    core = model.core_masks()

    def grads(loss: torch.Tensor) -> tuple[float, float]:
        """The largest |gradient| on the core's coordinates and off them, over the whole window."""
        model.zero_grad()
        loss.backward()
        on, off = 0.0, 0.0
        for k, p in model.window.items():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            mask = core.get(k, torch.zeros_like(p, dtype=torch.bool))
            on = max([on, *grad[mask].abs().tolist()])
            off = max([off, *grad[~mask].abs().tolist()])
        return on, off

    on, off = grads(lm_loss(model, batch)[0])
    assert on == 0.0 and off > 0.0  # the target's loss trains the window around the core, not the core
    on, off = grads(model.core_loss(batch))
    assert on > 0.0 and off == 0.0  # the small model's loss trains the core alone
