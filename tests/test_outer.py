"""Server-side outer optimizers and the shared round planning (plain tensors, no Flower)."""

from __future__ import annotations

import pytest
import torch
from fp_bounds import assert_within, gamma
from transformers import LlamaConfig

from fedfusion.config import choices
from fedfusion.fusion import outer
from fedfusion.fusion.outer import OuterConfig, OuterOptimizer
from fedfusion.fusion.rounds import client_seed, fold, owned_starts, plan_round
from fedfusion.models import slicing
from fedfusion.models.families import family_of
from fedfusion.models.slicing import SelectiveAverager, extract, plan_slice


def _cfg() -> LlamaConfig:
    return LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, head_dim=4)


def test_recipe_choices_are_the_modules_own():
    """The recipe checks the very tuples the slicer and the outer optimizer act on (one home: config.choices)."""
    assert choices.CHOICES["fusion.policy"] is slicing.POLICIES is choices.POLICIES
    assert choices.CHOICES["fusion.outer"] is outer.OUTER_METHODS is choices.OUTER_METHODS


def test_none_is_plain_averaging_and_bad_settings_are_refused():
    old, new = {"w": torch.zeros(3)}, {"w": torch.ones(3)}
    assert OuterOptimizer(OuterConfig()).step(old, new) is new
    for bad in ({"method": "sgdx"}, {"lr": 0.0}, {"momentum": 1.0}, {"eps": 0.0}):
        with pytest.raises(ValueError):
            OuterConfig(**bad)


def test_avgm_and_nesterov_follow_their_formulas():
    """Two rounds with a constant change d: heavy ball gives lr*d then lr*(1+mu)*d; Nesterov lr*(1+mu)*d then
    lr*(1+mu+mu^2)*d (the look-ahead applies the updated momentum once more).

    The step runs in float32 (lr and mu rounded to it too): against the exact values, the first round takes at most
    seven roundings of ``lr (1 + mu) |d|`` (the constants, the momentum, the product, the sum); the second also
    rounds ``x1 + d``, the change read back from it, the momentum's update and ``x2 - x1``: twelve of the magnitudes
    it adds (fp_bounds)."""
    d, lr, mu = torch.tensor([0.5, -1.0]), 0.7, 0.9
    for method, first, second in (("avgm", 1.0, 1 + mu), ("nesterov", 1 + mu, 1 + mu + mu * mu)):
        opt = OuterOptimizer(OuterConfig(method, lr=lr, momentum=mu))
        x0 = torch.zeros(2)
        x1 = opt.step({"w": x0}, {"w": x0 + d})["w"]
        exact = d.double() * lr
        assert_within(x1, exact * first, gamma(7, torch.float32) * (exact * first).abs())
        x2 = opt.step({"w": x1}, {"w": x1 + d})["w"]
        size = x1.double().abs() + x2.double().abs() + d.double().abs() + (exact * second).abs()
        assert_within(x2 - x1, exact * second, gamma(12, torch.float32) * size)


def test_adam_step_is_normalised():
    opt = OuterOptimizer(OuterConfig("adam", lr=0.1, momentum=0.0, beta2=0.0, eps=1e-12))
    d = torch.tensor([3.0, -0.001])
    out = opt.step({"w": torch.zeros(2)}, {"w": d})["w"]
    # sign(d) * lr when m = d and v = d^2: lr d / (|d| + eps) in float32 (d^2, its root, the sum, the quotient, the
    # product: gamma_5 of lr), eps moving it by lr eps / |d|
    assert_within(out, torch.sign(d) * 0.1, 0.1 * (gamma(5, torch.float32) + 1e-12 / d.abs().double()))


def test_only_held_coordinates_move_and_keep_momentum():
    opt = OuterOptimizer(OuterConfig("avgm", lr=1.0, momentum=0.5))
    held = {"w": torch.tensor([True, False]), "b": torch.tensor([False])}
    old = {"w": torch.zeros(2), "b": torch.zeros(1), "steps": torch.tensor([3])}
    out = opt.step(old, {"w": torch.tensor([1.0, 5.0]), "b": torch.tensor([2.0]), "steps": torch.tensor([3])}, held)
    assert out["w"].tolist() == [1.0, 0.0] and out["b"].tolist() == [0.0] and out["steps"].tolist() == [3]
    out2 = opt.step(out, {"w": torch.tensor([1.0, 1.0]), "b": out["b"]}, {"w": torch.tensor([False, True])})
    assert out2["w"].tolist() == [1.0, 1.0]  # coordinate 0 sat out: no stale momentum applied to it
    state = opt.state_dict()
    again = OuterOptimizer(OuterConfig("avgm", lr=1.0, momentum=0.5))
    again.load_state_dict(state)
    assert torch.equal(again.state["w"]["m"], opt.state["w"]["m"]) and again.steps == opt.steps == 2


def test_fold_without_outer_is_the_selective_average():
    cfg = _cfg()
    torch.manual_seed(0)
    state = family_of(cfg).build(cfg).state_dict()
    averager = SelectiveAverager(state, cfg)
    plan = plan_slice(cfg, 0.5, "rolling", 2)
    averager.add({k: v + 1 for k, v in extract(state, cfg, plan).items()}, plan)
    expected = averager.result()
    assert all(torch.equal(fold(averager)[k], expected[k]) for k in expected)
    stepped = fold(averager, OuterOptimizer(OuterConfig("avgm", lr=2.0, momentum=0.0)))
    held = averager.held()
    for k in state:  # x + 2 (avg - x) in float32 here and in the step: each within gamma_3 of its magnitudes
        x, change = state[k][held[k]].double(), (expected[k] - state[k])[held[k]].double()
        bound = 2 * gamma(3, torch.float32) * (x.abs() + 2 * change.abs())
        assert_within(stepped[k][held[k]], (state[k] + 2 * (expected[k] - state[k]))[held[k]], bound)
        assert torch.equal(stepped[k][~held[k]], state[k][~held[k]])


def test_plan_round_matches_one_plan_per_client():
    """The shared planner gives exactly the plans the strategy used to build client by client."""
    cfg = _cfg()
    clients = [(3, 0.25), (7, 0.5), (9, 0.25)]
    for policy, stagger in (("rolling", True), ("rolling", False), ("random", False), ("static", False)):
        plans = plan_round(cfg, clients, policy, 4, run_seed=5, stride=0.25, stagger=stagger)
        offset = 0.0
        for (p, w), plan in zip(clients, plans):
            assert plan == plan_slice(cfg, w, policy, 4, 0.25, offset, client_seed(5, 4, p))
            offset += w if stagger else 0.0


def test_owned_windows_stay_with_their_client_and_tile_the_target():
    cfg = _cfg()
    starts = owned_starts({p: 0.25 for p in range(8)})
    for rnd in (1, 2, 7):
        plans = plan_round(cfg, [(p, 0.25) for p in range(4)], "owned", rnd, run_seed=0, owned=starts)
        assert [pl.neurons for pl in plans] == [tuple(range(8 * p, 8 * p + 8)) for p in range(4)]
    assert plan_round(cfg, [(5, 0.25)], "owned", 3, 0, owned=starts)[0].neurons == tuple(range(8, 16))  # 5/4 mod 1
    mixed = owned_starts({0: 0.125, 1: 0.25, 2: 0.125, 3: 0.5})  # mixed widths still tile: no unit left out
    plans = plan_round(cfg, [(p, w) for p, w in ((0, 0.125), (1, 0.25), (2, 0.125), (3, 0.5))], "owned", 1, 0, owned=mixed)
    assert sorted(u for pl in plans for u in pl.neurons) == list(range(32))
    with pytest.raises(ValueError, match="owned_starts"):
        plan_round(cfg, [(0, 0.25)], "owned", 1, 0)


def test_owned_windows_with_a_core_tile_the_units_outside_it():
    """A floor (a core that every full-forward window trains) is left out: 6 windows of 1/8 tile the last 3/4 of
    the neurons, the 7th partition wraps round to the first of them, and no window starts inside the core."""
    cfg = _cfg()
    starts = owned_starts({p: 0.125 for p in range(7)}, floor=0.25)
    plans = plan_round(cfg, [(p, 0.125) for p in range(7)], "owned", 4, run_seed=0, owned=starts)
    assert sorted(u for pl in plans[:6] for u in pl.neurons) == list(range(8, 32))
    assert plans[6].neurons == plans[0].neurons == tuple(range(8, 12))
    with pytest.raises(ValueError, match="floor"):
        owned_starts({0: 0.5}, floor=1.0)


def test_full_forward_owned_windows_keep_the_core_and_their_own_units():
    """SubModelMethod with forward full, window_core and policy owned: every client's window is the core plus the
    same units of its own in every round, laid by the window width (not the tier's width) outside the core."""
    from fedfusion.fusion.base import Client
    from fedfusion.fusion.submodel.method import SubModelMethod

    cfg = _cfg()
    state = family_of(cfg).build(cfg).state_dict()
    method = SubModelMethod(cfg, {"t": 0.25}, state, policy="owned", forward="full", frozen="float32",
                            window_core=True, window_widths={"t": 0.125}, scale=False)
    method.observe({p: "t" for p in range(6)})
    neurons = {}
    for rnd in (1, 5):
        clients = [Client(partition=p, tier="t", seed=p) for p in range(6)]
        for p, payload in enumerate(method.payloads(rnd, state, clients)):
            got = payload.context[0].neurons
            assert neurons.setdefault(p, got) == got  # the same window every round
    core = set(range(8))
    assert all(core <= set(n) and len(n) == 12 for n in neurons.values())
    assert sorted(u for n in neurons.values() for u in set(n) - core) == list(range(8, 32))


def test_outer_state_survives_a_json_checkpoint_and_a_missing_one_is_refused():
    """The strategy's checkpoint is JSON: the outer optimizer's buffers must round-trip through it exactly."""
    import json

    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedfusion.devices.catalog import load_catalog
    from fedfusion.fusion.submodel.method import SubModelMethod
    from fedfusion.selection.participation import Participation
    from fedfusion.selection.selectors import make_selector
    from tests.test_strategy import FakeGrid, new_strategy

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    cfg = _cfg()

    torch.manual_seed(0)
    state = family_of(cfg).build(cfg).state_dict()

    def make(outer):
        method = SubModelMethod(cfg, {"phone": 0.5}, state, policy="rolling", stride=0.25, stagger=True, outer=outer)
        return new_strategy(
            {"phone": method}, clients_per_round=2, min_clients=1, query_config={"population": "{}"},
            participation=Participation(make_selector("random", seed=0), load_catalog()),
            train_config={"local-steps": 1, "lr": 0.1, "seed": 0}, wait_nodes_s=1.0)

    strategy = make(OuterConfig("nesterov", lr=0.7, momentum=0.9))
    grid = FakeGrid({11: "phone", 12: "phone"})
    msgs = list(strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), grid))
    metrics = MetricRecord({"num-examples": 4, "train_loss": 1.0, "train_s": 0.1})
    replies = [Message(RecordDict({"arrays": ArrayRecord({k: v + 0.01 for k, v in m.content["arrays"].to_torch_state_dict().items()}),
                                   "metrics": metrics}), reply_to=m) for m in msgs]
    strategy.aggregate_train(1, replies)
    saved = json.loads(json.dumps(strategy.run.state_dict()))  # what save_checkpoint writes
    resumed = make(OuterConfig("nesterov", lr=0.7, momentum=0.9))
    resumed.run.load_state_dict(saved, rounds_done=1)
    before, after = strategy.run.methods["phone"].outer, resumed.run.methods["phone"].outer
    assert after.steps == 1 and set(after.state) == set(before.state)
    assert all(torch.equal(after.state[k]["m"], before.state[k]["m"]) for k in before.state)
    plain = make(None).run.state_dict()
    with pytest.raises(ValueError, match="no outer-optimizer state"):
        make(OuterConfig("avgm")).run.load_state_dict(json.loads(json.dumps(plain)), rounds_done=1)
