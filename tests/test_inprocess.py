"""The library's in-process round loops (what benchmarks compare methods with): exactness against the steps
they are made of."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch
from fp_bounds import assert_within, gamma
from model_bounds import ExactLM
from transformers import LlamaForCausalLM

from fedfusion.fusion.generative.config import GenerativeConfig
from fedfusion.fusion.generative.inprocess import GenerativeRun, run_generative
from fedfusion.fusion.generative.reply import sample_windows
from fedfusion.fusion.inprocess import SubModelRun, TransferRun, run_submodel, run_transfer
from fedfusion.fusion.rounds import client_seed, server_seed
from fedfusion.fusion.submodel.method import SubModelMethod
from fedfusion.models.build import config_aliases, model_from_state, wire_state
from fedfusion.models.growth import grown_plan
from fedfusion.models.slicing import extract, plan_slice, sub_config
from fedfusion.train.distill import feddf_teacher, kd_loss
from fedfusion.train.loop import evaluate_lm, train_steps
from tests.conftest import tiny_config


def _setup(clients: int = 3):
    cfg = tiny_config()
    torch.manual_seed(0)
    state = LlamaForCausalLM(cfg).state_dict()
    gen = torch.Generator().manual_seed(1)
    windows = [torch.randint(3, cfg.vocab_size, (12, 9), generator=gen) for _ in range(clients)]
    return cfg, state, windows


def test_one_full_width_client_per_round_is_that_clients_own_training():
    cfg, state, windows = _setup(clients=1)
    run = SubModelRun(cfg, windows, [1.0], policy="static", rounds=2, per_round=1, steps=3, lr=0.01, batch_size=4)
    fused, stats = run_submodel(run, state)
    model = model_from_state(cfg, state)
    for rnd in (1, 2):
        train_steps(model, windows[0], 3, 0.01, 4, client_seed(0, rnd, 0))
        model = model_from_state(cfg, model.state_dict())  # each round starts a fresh optimizer, as a client does
    for key, value in model.state_dict().items():  # the same operations in the same order: bit for bit (a full
        assert torch.equal(fused[key], value), key    # width slice is the model; one client's mean is its value)
    assert stats.client_rounds == 2 and stats.tokens == 2 * 3 * 4 * 8


@lru_cache(maxsize=4)
def _generative(device_state: str, top_k: int):
    """(run, its result): 3 rounds of a generative federation on ``_setup()``'s clients, run once for the tests that
    read it (none changes what it returns)."""
    cfg, state, windows = _setup()
    run = GenerativeRun(cfg, 0.5, windows, rounds=3, per_round=2, steps=2, lr=0.01, batch_size=4,
                        generative=GenerativeConfig(sample_fraction=0.5, server_steps=2, server_batch=4,
                                                    top_k=top_k, device_state=device_state))
    return run, run_generative(run, state)


@pytest.mark.xdist_group("generative_runs")  # with -n, on the worker that holds _generative's runs
@pytest.mark.parametrize("device_state", ["server", "node"])
def test_generative_returns_each_sampled_devices_own_model_and_counts_the_messages_bytes(device_state):
    cfg, state, _ = _setup()
    plan = plan_slice(cfg, 0.5, "static")
    run, (target, stats, devices) = _generative(device_state, 0)  # the bit-for-bit test below reads the same runs
    assert run.client_config.to_dict() == sub_config(cfg, plan).to_dict()
    assert set(devices) <= {0, 1, 2} and len(devices) >= 2
    start = wire_state(extract(state, cfg, plan), config_aliases(run.client_config))
    for own in devices.values():
        assert own.keys() == start.keys() and any(not torch.equal(own[k], start[k]) for k in own)
    model, samples = sum(v.numel() * 4 for v in start.values()), 6 * 9 * 8  # float32; ceil(0.5 x 12) windows x 9 ids, int64
    if device_state == "server":  # each device's model goes down and up every round
        assert stats.bytes_down == 3 * 2 * model and stats.bytes_up == 3 * 2 * (model + samples)  # rounds x clients
    else:  # a device's model goes down in its first round only, never up
        assert stats.bytes_down == len(devices) * model and stats.bytes_up == 3 * 2 * samples
    assert any(not torch.equal(target[k], state[k]) for k in state) and stats.server_flops > 0
    assert stats.flops > 6.0 * stats.tokens * sum(v.numel() for v in start.values())  # + the sampling's forwards


@pytest.mark.xdist_group("generative_runs")
@pytest.mark.parametrize("top_k", [0, 2])
def test_generative_node_and_server_state_train_the_same_target_bit_for_bit(top_k):
    (server, server_stats, server_devices), (node, node_stats, node_devices) = (
        _generative(m, top_k)[1] for m in ("server", "node"))
    assert all(torch.equal(server[k], node[k]) for k in server)
    assert server_devices.keys() == node_devices.keys()
    assert all(torch.equal(server_devices[p][k], node_devices[p][k]) for p in server_devices for k in server_devices[p])
    assert node_stats.bytes_down < server_stats.bytes_down and node_stats.bytes_up < server_stats.bytes_up


def test_a_generative_round_is_the_clients_training_its_samples_and_the_servers_training_on_them():
    cfg, state, windows = _setup(clients=1)
    g = GenerativeConfig(sample_fraction=0.5, server_steps=3, server_lr=0.01, server_batch=4)
    run = GenerativeRun(cfg, 0.5, windows, rounds=1, per_round=1, steps=2, lr=0.01, batch_size=4, generative=g)
    target, _, devices = run_generative(run, state)
    _assert_one_generative_round(cfg, windows[0], g, state, 1, target, devices[0])


def _assert_one_generative_round(cfg, own_windows, g, start, rnd, target, device) -> None:
    """``target`` and ``device`` are round ``rnd`` of a one-client generative run from ``start``, step for step: the
    device trains its slice of ``start`` (2 steps), samples it, and the server trains ``start`` on the samples
    (3 steps)."""
    plan = plan_slice(cfg, 0.5, "static")
    own = model_from_state(sub_config(cfg, plan), extract(start, cfg, plan))
    seed = client_seed(0, rnd, 0)
    train_steps(own, own_windows, 2, 0.01, 4, seed)
    samples = sample_windows(own, own_windows, 6, g.temperature, seed)
    server = model_from_state(cfg, start)
    train_steps(server, samples, 3, 0.01, 4, server_seed(0, rnd, 1))
    for key, value in server.state_dict().items():
        torch.testing.assert_close(target[key], value, rtol=0, atol=0)
    for key, value in device.items():
        torch.testing.assert_close(own.state_dict()[key], value, rtol=0, atol=0)


def test_transfer_distillation_runs_the_same_federation_and_moves_the_target_only_on_its_rounds():
    cfg, state, windows = _setup()
    run = SubModelRun(cfg, windows, [0.5] * 3, policy="static", rounds=4, per_round=2, steps=2, lr=0.05, batch_size=4)
    transfer = torch.randint(3, cfg.vocab_size, (10, 9), generator=torch.Generator().manual_seed(2))
    seen: dict[int, dict[str, torch.Tensor]] = {}

    def record(target: dict[str, torch.Tensor], rnd: int) -> dict[str, float]:
        seen[rnd] = {k: v.clone() for k, v in target.items()}
        return {}

    small, plain = run_submodel(run, state)
    target, stats = run_transfer(TransferRun(run, transfer, every=2, steps=5, lr=0.01, batch_size=4), state, state,
                                 record)
    assert (stats.flops, stats.bytes_up, stats.tokens) == (plain.flops, plain.bytes_up, plain.tokens)
    moved = [any(not torch.equal(seen[r][k], (seen[r - 1] if r > 1 else state)[k]) for k in state) for r in (1, 2, 3, 4)]
    assert moved == [False, True, False, True] and stats.server_flops > 0

    plan = plan_slice(cfg, 0.5, "static")
    teacher = model_from_state(sub_config(cfg, plan), extract(small, cfg, plan)).eval()
    inputs = transfer[:, :-1]
    with torch.no_grad():
        soft = feddf_teacher(teacher(input_ids=inputs).logits[None]).log_probs

        def kl(s: dict[str, torch.Tensor]) -> float:
            return float(kd_loss(model_from_state(cfg, s)(input_ids=inputs).logits, soft))

    assert kl(target) < kl(state)  # the target moved towards the federation's model on the public text
    untouched, _ = run_transfer(TransferRun(run, transfer, every=5), state, state)
    assert all(torch.equal(untouched[k], state[k]) for k in state)  # no distillation round within 4 rounds


def test_the_shared_local_step_refuses_a_non_finite_loss_and_changes_nothing():
    from fedfusion.train.loop import optimizer_step

    layer = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
    bad = layer(torch.ones(1, 3)).sum() * float("nan")
    try:
        optimizer_step(opt, bad, "distillation")
    except FloatingPointError as exc:
        assert "distillation loss became nan" in str(exc)
    else:
        raise AssertionError("a NaN loss was stepped")
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())
    expected = float((before["weight"].double().sum(1) + before["bias"].double()).sum())  # exact
    # the float32 loss is a sum of the same weights and biases in some order: within gamma_n of their magnitudes
    n = before["weight"].numel() + before["bias"].numel()
    size = float(before["weight"].double().abs().sum() + before["bias"].double().abs().sum())
    assert abs(optimizer_step(opt, layer(torch.ones(1, 3)).sum()) - expected) <= gamma(n, torch.float32) * size
    assert not torch.equal(before["bias"], layer.bias)


def test_dropout_follows_the_messages_seed_not_the_processs_history():
    """A Ray actor trains many clients, in an order that changes between runs: a model with dropout (GPT-2 family
    models have it by default) must train the same from the same seed whatever the process drew before, and
    leave the process's own generator where it was."""
    cfg, _, windows = _setup(1)
    cfg = cfg.__class__.from_dict({**cfg.to_dict(), "attention_dropout": 0.5})
    torch.manual_seed(0)
    init = LlamaForCausalLM(cfg).state_dict()
    losses = []
    for history in (0, 7):
        torch.manual_seed(history)
        model = model_from_state(cfg, init)
        after = torch.random.get_rng_state()
        losses.append(train_steps(model, windows[0], 3, 1e-2, 4, seed=11).loss)
        assert torch.equal(torch.random.get_rng_state(), after)
    assert losses[0] == losses[1]
    model = model_from_state(cfg, init)
    assert train_steps(model, windows[0], 3, 1e-2, 4, seed=12).loss != losses[0]


def test_generative_after_growth_starts_devices_and_server_from_the_grown_small_model():
    """``grow_round`` g: rounds 1..g are the smallest-only federation (the target after them is that run's, bit for
    bit); round g+1's device model is its slice of the grown target trained, and the server trains the grown target
    on its samples."""
    cfg, state, windows = _setup(clients=1)
    g = GenerativeConfig(sample_fraction=0.5, server_steps=3, server_lr=0.01, server_batch=4)
    common = dict(per_round=1, steps=2, lr=0.01, batch_size=4)
    after: dict[int, dict[str, torch.Tensor]] = {}

    def keep(target, rnd):
        after[rnd] = {k: v.clone() for k, v in target.items()}

    run = GenerativeRun(cfg, 0.5, windows, rounds=2, generative=g, grow_round=1, **common)
    target, _, devices = run_generative(run, state, keep)
    grown, _ = run_submodel(SubModelRun(cfg, windows, [0.5], policy="static", rounds=1, grow_round=1, **common), state)
    assert all(torch.equal(after[1][k], grown[k]) for k in grown)
    _assert_one_generative_round(cfg, windows[0], g, grown, 2, target, devices[0])


def test_grow_rounds_are_smallest_only_training_and_the_grown_target_equals_it():
    """During ``grow_round`` rounds the target is the smallest slice's model: its held-out loss equals that of the
    small model a plain smallest-only federation trains (same clients, seeds and steps)."""
    cfg, state, windows = _setup()
    common = dict(policy="static", rounds=3, per_round=2, steps=3, lr=0.02, batch_size=4, scale=False)
    grown, _ = run_submodel(SubModelRun(cfg, windows, [0.5] * 3, grow_round=3, **common), state)
    small_only, _ = run_submodel(SubModelRun(cfg, windows, [0.5] * 3, **common), state)
    plan = plan_slice(cfg, 0.5, "static", scale=False)
    held = torch.cat(windows)
    # evaluated in float64 (the float32 weights exactly): the grown target computes the small model's function, an
    # identity of the algebra, so the two losses share one exact value; each is within model_bounds.ExactLM's bound
    # of it, float32's (evaluate_lm takes the cross-entropy of the logits in float32 and HF's RMSNorm computes in
    # float32; the float64 products round less), and the two within the sum of those bounds
    target_loss = evaluate_lm(model_from_state(cfg, grown).double(), held)["eval_loss"]
    small_state = extract(small_only, cfg, plan)
    small = model_from_state(sub_config(cfg, plan), small_state).double()
    small_loss = evaluate_lm(small, held)["eval_loss"]
    bound = ExactLM(cfg, grown).at({}, held).loss_bound + ExactLM(sub_config(cfg, plan), small_state).at({}, held).loss_bound
    assert bound < 1e-3  # a bound that could fail: below the move training must make (the last line)
    assert_within(torch.tensor(target_loss), torch.tensor(small_loss), bound)
    assert abs(target_loss - evaluate_lm(model_from_state(cfg, state), held)["eval_loss"]) > 1e-3  # it trained


@pytest.mark.parametrize("frozen", ["float32", "int8"])
def test_full_forward_windows_after_growth_move_only_their_units_and_lower_the_loss(frozen):
    cfg, state, windows = _setup()
    run = SubModelRun(cfg, windows, [0.5] * 3, policy="rolling", stride=0.5, stagger=False, rounds=4, per_round=3,
                      steps=4, lr=0.02, batch_size=4, grow_round=2, forward="full", frozen=frozen)
    seen: dict[int, dict[str, torch.Tensor]] = {}
    fused, stats = run_submodel(run, state, lambda s, rnd: seen.setdefault(rnd, dict(s)) and None)
    before, after = seen[2], fused
    embed = "model.embed_tokens.weight"
    assert torch.equal(before[embed], after[embed])  # windows leave what no unit owns (embeddings, norms) alone
    down = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(before[down], after[down])
    held = torch.cat(windows)
    assert evaluate_lm(model_from_state(cfg, after), held)["eval_loss"] < evaluate_lm(model_from_state(cfg, before), held)["eval_loss"]
    assert stats.bytes_down > stats.bytes_up  # the frozen target goes down, only windows come back


def test_core_windows_train_the_small_models_units_every_round_after_growth():
    cfg, state, windows = _setup()
    run = SubModelRun(cfg, windows, [0.5] * 3, policy="rolling", stride=0.5, stagger=False, rounds=4, per_round=3,
                      steps=4, lr=0.02, batch_size=4, grow_round=2, forward="full", frozen="float32", window_core=True)
    seen: dict[int, dict[str, torch.Tensor]] = {}
    run_submodel(run, state, lambda s, rnd: seen.setdefault(rnd, dict(s)) and None)
    core = plan_slice(cfg, 0.5, "static", scale=False)
    q = "model.layers.0.self_attn.q_proj.weight"
    rows = core.attn_units and len(core.attn_units) * cfg.head_dim
    for rnd in (3, 4):  # the core's heads move in every round after growth, whatever the rolling window
        assert not torch.equal(seen[rnd][q][:rows], seen[rnd - 1][q][:rows]), rnd


@pytest.mark.parametrize("frozen", ["float32", "int8"])
def test_a_core_in_its_own_forward_pass_follows_smallest_only_exactly_and_the_rest_learns_beside_it(frozen):
    """fusion.core_forward=small: after growth the core (the small model's coordinates) trains only through the
    small model's own loss, so the small model inside the target is step for step the one smallest-only training
    makes (same clients, seeds, batches), whatever the frozen target's format; the units outside the core move."""
    cfg, state, windows = _setup()
    common = dict(policy="rolling", stride=0.5, stagger=False, rounds=3, per_round=2, steps=3, lr=0.02, batch_size=4,
                  scale=False, axes=("heads", "neurons"))
    small_only, _ = run_submodel(SubModelRun(cfg, windows, [0.5] * 3, grow_round=3, **common), state)
    seen: dict[int, dict[str, torch.Tensor]] = {}
    residual, _ = run_submodel(SubModelRun(cfg, windows, [0.5] * 3, grow_round=1, forward="full", frozen=frozen,
                                           window_shared=True, window_core=True, core_forward="small", **common),
                               state, lambda s, rnd: seen.setdefault(rnd, dict(s)) and None)
    core = grown_plan(plan_slice(cfg, 0.5, "static", axes=("heads", "neurons"), scale=False))
    want, got = extract(small_only, cfg, core), extract(residual, cfg, core)
    # the core trains by the small model's own loss: the same small model's operations in the same order as
    # smallest-only training, so bit for bit (after AdamW steps a tolerance would not be a bound on anything)
    assert all(torch.equal(want[k], got[k]) for k in want)
    down = "model.layers.0.mlp.down_proj.weight"
    outside = residual[down][:, cfg.intermediate_size // 2:]
    assert float(seen[1][down][:, cfg.intermediate_size // 2:].abs().max()) == 0.0  # silenced at growth
    assert float(outside.abs().max()) > 0.0  # the new neurons learnt beside the core


def test_a_core_needs_a_shared_window():
    cfg, state, _ = _setup()
    with pytest.raises(ValueError, match="core_forward"):
        SubModelMethod(cfg, {"t": 0.5}, state, forward="full", window_core=True, core_forward="small")


def test_the_driver_trains_each_round_at_the_recipes_scheduled_lr(monkeypatch):
    """``lr_schedule``: round r's clients train at :func:`fedfusion.fusion.rounds.round_lr` of r, as the strategy
    sends it (cosine from ``lr`` in round 1 to ``lr_final`` x ``lr`` in the last)."""
    import fedfusion.fusion.inprocess as inprocess
    from fedfusion.fusion.rounds import round_lr

    cfg, state, windows = _setup(clients=1)
    seen: list[float] = []
    real = inprocess.train_steps

    def spy(model, data, steps, lr, *args, **kwargs):
        seen.append(lr)
        return real(model, data, steps, lr, *args, **kwargs)

    monkeypatch.setattr(inprocess, "train_steps", spy)
    run = SubModelRun(cfg, windows, [1.0], policy="static", rounds=3, per_round=1, steps=1, lr=0.01, batch_size=4,
                      lr_schedule="cosine", lr_final=0.1)
    run_submodel(run, state)
    assert seen == [round_lr(0.01, "cosine", 0.1, rnd, 3) for rnd in (1, 2, 3)]
    assert seen[0] == 0.01 and seen[-1] == pytest.approx(0.001)  # lr, then lr_final x lr


def test_the_driver_caps_a_small_clients_steps_in_epochs_as_the_strategy_does():
    """``max_epochs``: a client of 12 examples at batch 4 takes ceil(2 x 12 / 4) = 6 of its 10 steps
    (:func:`fedfusion.fusion.rounds.client_steps`)."""
    cfg, state, windows = _setup(clients=1)
    common = dict(policy="static", rounds=1, per_round=1, steps=10, lr=0.01, batch_size=4)
    _, capped = run_submodel(SubModelRun(cfg, windows, [1.0], max_epochs=2, **common), state)
    _, free = run_submodel(SubModelRun(cfg, windows, [1.0], **common), state)
    assert capped.tokens == 6 * 4 * 8 and free.tokens == 10 * 4 * 8


def test_a_loop_whose_clients_train_on_the_cpu_refuses_another_device():
    cfg, state, windows = _setup()
    run = GenerativeRun(cfg, 0.5, windows, rounds=1, per_round=1, steps=1, lr=0.01, batch_size=4, device="cuda")
    with pytest.raises(ValueError, match="run_generative: its clients train on the CPU"):
        run_generative(run, state)


@pytest.mark.parametrize(("feedback", "forward"), [(True, "slice"), (False, "slice"), (True, "full")])
def test_a_client_keeps_its_uplink_rounding_where_the_message_asks_for_error_feedback(feedback, forward):
    """The driver's client reads the uplink from the payload's wire spec, as the client app does: an int8 reply keeps
    its rounding error for the next one only with error feedback, and never for a full-forward window."""
    from fedfusion.fusion.base import Client
    from fedfusion.fusion.inprocess import SliceClients, submodel_method
    from fedfusion.fusion.rounds import round_payloads
    from fedfusion.wire.quantize import Wire

    cfg, state, windows = _setup(clients=1)
    run = SubModelRun(cfg, windows, [0.5], policy="static", rounds=1, per_round=1, steps=1, lr=0.01, batch_size=4,
                      wire=Wire(up="int8", error_feedback=feedback), forward=forward, frozen="float32")
    method = submodel_method(run, {"t": 0.5}, state)
    payload, = round_payloads({"t": method}, 1, state, [Client(0, "t", client_seed(0, 1, 0))])
    clients = SliceClients(run)
    clients(1, payload)
    kept = clients.residuals[0]
    assert (len(kept) > 0) == (feedback and forward == "slice")
    assert all(t.abs().max() > 0 for t in kept.values())  # int8 rounding of trained values leaves some error
