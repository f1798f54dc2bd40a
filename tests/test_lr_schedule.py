"""The clients' lr over rounds (``train.lr_schedule``): the schedule itself, and the strategy's messages carrying
each round's lr to every client in place of the recipe's constant one."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from transformers import LlamaForCausalLM

from fedfusion.devices.catalog import load_catalog
from fedfusion.fusion.base import Client
from fedfusion.fusion.rounds import round_lr
from fedfusion.fusion.submodel.method import SubModelMethod
from fedfusion.selection.participation import Participation
from fedfusion.selection.selectors import make_selector
from tests.conftest import tiny_config
from tests.test_strategy import FakeGrid, make_strategy, new_strategy, task_identity  # noqa: F401 (autouse fixture)


def test_constant_keeps_the_lr_every_round():
    assert [round_lr(3e-3, "constant", 0.1, r, 12) for r in range(1, 13)] == [3e-3] * 12


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_a_decay_starts_at_the_lr_ends_at_lr_final_and_never_rises(schedule):
    lrs = [round_lr(2.0, schedule, 0.25, r, 9) for r in range(1, 10)]
    assert lrs[0] == 2.0 and lrs[-1] == pytest.approx(0.5)
    assert all(a > b for a, b in zip(lrs, lrs[1:]))
    quarter = 0.75 if schedule == "linear" else 0.5 * (1 + math.cos(math.pi / 4))  # round 3 of 9: a quarter through
    assert lrs[2] == pytest.approx(2.0 * (0.25 + 0.75 * quarter))


def test_a_one_round_run_trains_at_the_lr_and_rounds_past_the_end_stay_at_lr_final():
    assert round_lr(1.0, "cosine", 0.1, 1, 1) == 1.0
    assert round_lr(1.0, "linear", 0.1, 15, 12) == pytest.approx(0.1)


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="'step' is not one of constant, cosine, linear"):
        round_lr(1.0, "step", 0.1, 1, 12)


def test_every_message_of_a_round_carries_that_rounds_lr():
    strategy, state = make_strategy()  # train_config's lr is 0.1
    grid = FakeGrid({11: "phone", 12: "desktop", 13: "phone"})
    assert {m.content["config"]["lr"] for m in strategy.configure_train(2, ArrayRecord(state), ConfigRecord({}), grid)} == {0.1}
    strategy.settings = replace(strategy.settings, client_lr=lambda server_round: 0.1 / server_round)
    for server_round in (1, 4):
        msgs = list(strategy.configure_train(server_round, ArrayRecord(state), ConfigRecord({}), grid))
        assert [m.content["config"]["lr"] for m in msgs] == [0.1 / server_round] * 3


@pytest.mark.parametrize("scheduled", [True, False])
@pytest.mark.parametrize("power", [0.5, 1.0])
def test_a_window_trains_at_the_rounds_lr_scaled_by_its_fraction_of_the_units(power, scheduled):
    """``fusion.window_lr_power``: a full-forward window of a fraction f of the units trains at lr x f^-power, each
    client its own (a phone's quarter at 2x or 4x, a desktop's half at 1.41x or 2x), the round's lr a schedule's or
    the spec's; the ledger row records it."""
    cfg = tiny_config(heads=4, kv_heads=4, hidden=32, inter=48)
    torch.manual_seed(0)
    state = LlamaForCausalLM(cfg).state_dict()
    method = SubModelMethod(cfg, {"phone": 0.25, "desktop": 0.5}, state, policy="rolling", stride=0.25,
                            forward="full", frozen="float32", lr_power=power)
    strategy = new_strategy(
        {"phone": method, "desktop": method}, clients_per_round=3, query_config={"population": "{}"},
        participation=Participation(make_selector("random", seed=0), load_catalog()),
        train_config={"local-steps": 1, "lr": 0.1, "seed": 0}, wait_nodes_s=1.0,
        client_lr=(lambda server_round: 0.1 / server_round) if scheduled else None)
    grid = FakeGrid({11: "phone", 12: "desktop", 13: "phone"})
    msgs = list(strategy.configure_train(2, ArrayRecord(state), ConfigRecord({}), grid))
    width = {"phone": 0.25, "desktop": 0.5}
    for m in msgs:
        f = width[grid.devices[m.metadata.dst_node_id]]
        assert m.content["config"]["lr"] == pytest.approx((0.05 if scheduled else 0.1) * f ** -power)
        assert strategy.run.round.rows[m.metadata.dst_node_id].extra["lr_scale"] == pytest.approx(f ** -power)


def test_the_grow_rounds_small_slice_trains_at_the_lr_and_a_core_counts_in_the_windows_fraction():
    """Before growth every client trains the small slice in its own forward pass: no scaling; after it, a window
    with the core trains window + core (the phone's 1/4 + the 1/4 core: half the units, lr x 2 at power 1)."""
    cfg = tiny_config(heads=4, kv_heads=4, hidden=32, inter=48)
    state = LlamaForCausalLM(cfg).state_dict()
    method = SubModelMethod(cfg, {"phone": 0.25, "desktop": 0.5}, state, forward="full", frozen="float32",
                            grow_round=2, window_core=True, outside_core=True, lr_power=1.0)
    clients = [Client(0, "phone", 0), Client(1, "desktop", 1)]
    assert [p.lr_scale for r in (1, 2) for p in method.payloads(r, state, clients)] == [1.0] * 4
    assert [p.lr_scale for p in method.payloads(3, state, clients)] == [pytest.approx(2.0), pytest.approx(4 / 3)]


def test_a_window_without_the_power_trains_at_the_lr_and_a_power_outside_a_window_is_refused():
    cfg = tiny_config(heads=4, kv_heads=4, hidden=32, inter=48)
    state = LlamaForCausalLM(cfg).state_dict()
    window = SubModelMethod(cfg, {"phone": 0.25}, state, forward="full", frozen="float32")
    assert [p.lr_scale for p in window.payloads(1, state, [Client(0, "phone", 0)])] == [1.0]
    with pytest.raises(ValueError, match="lr_power 0.5: a power in \\[0, 1\\] for a window of units"):
        SubModelMethod(cfg, {"phone": 0.25}, state, forward="slice", lr_power=0.5)
    with pytest.raises(ValueError, match="lr_power 0.5"):
        SubModelMethod(cfg, {"phone": 0.25}, state, forward="full", window_rank=2, lr_power=0.5)
