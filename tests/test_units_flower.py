"""The exact (units) mode through ``fedfusion run`` on Flower's simulation engine: the server trains the
target centrally, the nodes compute its linear layers' GEMM tiles, and the loss curve is central training's."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from fp_bounds import assert_within, gamma
from model_bounds import Exact, ExactLM, State, Step, adamw_first_step_bound, assert_steps

from fedfusion.analysis.report import read_jsonl
from fedfusion.analysis.units_plan import units_plan
from fedfusion.cli import main
from fedfusion.config.recipe import Recipe, load_recipe
from fedfusion.data.population import data_spec, data_tokenizer, pooled_held_out
from fedfusion.data.text import encode_text, lm_windows
from fedfusion.devices.catalog import load_catalog
from fedfusion.devices.energy import price_work
from fedfusion.models.build import build_target
from fedfusion.run.units import price_step, step_batches, training_windows
from fedfusion.units import PhaseRecord
from fedfusion.wire.specs import Caps

pytestmark = pytest.mark.slow  # Flower's runtime (Ray): ~20 s to start, a few seconds per step

TINY = [
    "fusion.method=units", "units.steps=3", "population.num_clients=4",
    "model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=2", "model.intermediate_size=64",
    "model.num_layers=1", "train.batch_size=4", "train.seq_len=32", "train.weight_decay=0.1",
    "data.eval_chars=3000", "engine.cpus_per_client=1.0", "output.save_model=false",
    # a deadline a loaded 2-core host meets (the first message to each node starts its ClientApp): these runs test
    # exactness, bytes and pricing; the tests of missed deadlines set their own floor below their stall
    "units.deadline_floor_s=30",
]


class Central:
    """Central training of the recipe ``rolling + overrides``, step by step: the target's initial values, each step's
    batch, the held-out windows it is scored on, and :class:`model_bounds.ExactLM` (its loss and gradient at any
    values in float64, with the first-order bounds of a float32 computation of them)."""

    def __init__(self, overrides: list[str]) -> None:
        self.recipe = recipe = load_recipe("rolling", overrides)
        spec = data_spec(recipe.data_source())
        tokenizer = data_tokenizer(spec)
        model = build_target(recipe.model, tokenizer, recipe.seed)  # seeded: the run's target
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]  # the optimizer's order
        self.initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        self.batches = list(step_batches(recipe, training_windows(recipe)))
        self.held_out = lm_windows(encode_text(tokenizer, pooled_held_out(spec, recipe.data.eval_chars)),
                                   recipe.train.seq_len)
        # micro-batches: each part's gradient scaled by its share (one rounding) and the parts added (a regrouping
        # of the tokens' sum); 2 more roundings to be safe
        self.exact = ExactLM(None, {}, model=model, trained={n: n for n in self.names},
                             roundings=2 if recipe.units.micro_batches > 1 else 0)

    def scored(self, values: State) -> Exact:
        """The held-out loss at ``values`` (evaluate_lm: the mean next-token loss over every window), with its bound."""
        return self.exact.at(values, self.held_out)


@dataclass
class Recorded:
    """The server's optimizer steps in a run: per step the values it held and their gradients (optimizer order),
    the optimizer's state then; the values after the last."""

    steps: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=list)
    states: list[dict] = field(default_factory=list)
    final: list[torch.Tensor] = field(default_factory=list)

    def named(self, names: list[str]) -> list[Step]:
        assert all(len(v) == len(names) for v, _ in self.steps)
        return [(dict(zip(names, v)), dict(zip(names, g))) for v, g in self.steps]


@contextmanager
def server_steps() -> Iterator[Recorded]:
    """Every optimizer step this process takes inside the block: the units mode's server trains in the ServerApp's
    thread here (the simulation engine's ClientApps, in Ray's workers, train nothing; their GEMM tiles reach the
    server's step as its products)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    rec = Recorded()

    def params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p for group in opt.param_groups for p in group["params"]]

    def before(opt: torch.optim.Optimizer, *_: Any) -> None:
        rec.steps.append(([p.detach().clone() for p in params(opt)], [p.grad.detach().clone() for p in params(opt)]))
        rec.states.append(copy.deepcopy(opt.state_dict()))

    def after(opt: torch.optim.Optimizer, *_: Any) -> None:
        rec.final = [p.detach().clone() for p in params(opt)]

    hooks = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
    try:
        yield rec
    finally:
        for hook in hooks:
            hook.remove()


def run_units(tmp_path: Path, extra: list[str], nodes: int = 4) -> tuple[list[dict], Recorded]:
    out = tmp_path / "units"
    with server_steps() as rec:
        assert main(["run", "rolling", *TINY, *extra, "--out", str(out)]) == 0
    return check_units_run(out, nodes), rec


def check_units_run(out: Path, nodes: int = 4) -> list[dict]:
    """The ledgers of a finished units run in ``out``, checked; its metrics rows."""
    rows = read_jsonl(out / "metrics.jsonl")
    ledger = read_jsonl(out / "clients.jsonl")  # every device's priced work, per step
    for row in rows[1:]:
        mine = [r for r in ledger if r["round"] == row["step"]]
        assert mine and all(r["flops"] > 0 and r["energy_j"] > 0 for r in mine)
        # the devices' work and the server's own (its compute, checks and traffic: fedfusion.units.ledger)
        assert row["energy_j"] == pytest.approx(sum(r["energy_j"] for r in mine) + row["server_energy_j"])
        assert row["server_energy_j"] > 0 and row["server_verify_flops"] > 0 and row["cloud_step_s"] > 0
    assert (out / "report.md").is_file() and (out / "nodes.jsonl").read_text().count("\n") == nodes
    for step in {r["round"] for r in ledger}:  # one ledger row per device (client) and step, not per node
        parts = [r["partition"] for r in ledger if r["round"] == step]
        assert len(parts) == len(set(parts)) and set(parts) <= set(range(4))
    return rows


def assert_central_steps(rows: list[dict], rec: Recorded, central: Central) -> float:
    """The run trained central training's steps: each step's loss (its row) and gradient, at the values the server
    held then, within the float32 bounds of the exact ones on that step's batch (model_bounds.assert_steps); the
    values each step started from are torch's AdamW of the gradients before, from the optimizer's state at the
    first recorded step (empty in a fresh run, the checkpoint's after a resume), replayed bit for bit (one
    optimizer, one code path, equal inputs), ending at the final values; the last row's held-out loss within its
    bound of the exact one at those. A fresh run starts at the target's initial values, bit for bit.

    Per step and not against central training's loss curve: after an AdamW step the two trajectories differ by what
    ``g / (|g| + eps)`` makes of rounding-level gradient differences, which no rounding bound covers
    (tests/model_bounds.py); at each step's own values both compute one function. Returns the worst ratio of
    difference to bound."""
    first = len(central.batches) - len(rec.steps) + 1  # a resumed run records its steps after the checkpoint
    assert [r["step"] for r in rows] == list(range(len(central.batches) + 1)) and first >= 1
    steps = rec.named(central.names)
    if first == 1:
        assert all(torch.equal(v, central.initial[k]) for k, v in steps[0][0].items())
    losses = [r["train_loss"] for r in rows[first:]]
    worst = assert_steps(central.exact, steps, losses, central.batches[first - 1:])
    values = [v.clone().requires_grad_(True) for v in rec.steps[0][0]]
    opt = torch.optim.AdamW(values)
    opt.load_state_dict(copy.deepcopy(rec.states[0]))  # the run's groups and moments (a copy: its step counts on)
    for (held, grads) in rec.steps:
        assert all(torch.equal(v.detach(), h) for v, h in zip(values, held))
        for v, g in zip(values, grads):
            v.grad = g
        opt.step()
    assert all(torch.equal(v.detach(), f) for v, f in zip(values, rec.final))
    want = central.scored(dict(zip(central.names, rec.final)))
    worst = max(worst, assert_within(torch.tensor(rows[-1]["eval_loss"]), torch.tensor(want.loss), want.loss_bound))
    assert rows[-1]["train_loss"] < rows[1]["train_loss"]  # it trains
    return worst


def assert_restored(resumed: Recorded, whole: Recorded, central: Central) -> float:
    """A resumed run's state at its first step (the checkpoint after step 1) is the uninterrupted run's then, up to
    rounding: both took AdamW's first step from the initial values with gradients each within the float32 bound
    ``B`` of the exact one (ExactLM), so within ``2B`` of each other (the uninterrupted run's is recorded). The
    values: within model_bounds.adamw_first_step_bound of that. The moments ``m = (1 - b1) g`` and
    ``v = (1 - b2) g^2``: within ``(1 - b1) 2B`` and ``(1 - b2) (2 |g| + 2B) 2B`` of each other, plus each side's
    roundings (lerp: 2, relative; the square, its scaling and the add: 3); the step count and the groups equal (as
    the checkpoint's JSON holds them: betas a list).
    Returns the worst ratio of difference to bound."""
    f32 = torch.float32
    restored, after_one = resumed.states[0], whole.states[1]
    assert json.loads(json.dumps(restored["param_groups"])) == json.loads(json.dumps(after_one["param_groups"]))
    group = after_one["param_groups"][0]
    (b1, b2), lr, eps = group["betas"], group["lr"], group["eps"]
    start, grads = whole.named(central.names)[0]
    d = {k: 2 * b for k, b in central.exact.at(start, central.batches[0]).grad_bounds.items()}
    worst = 0.0
    for i, name in enumerate(central.names):
        g, mine, theirs = grads[name].double().abs(), restored["state"][i], after_one["state"][i]
        assert torch.equal(mine["step"], theirs["step"])
        step_bound = adamw_first_step_bound(grads[name], d[name], whole.steps[1][0][i], lr, eps, f32)
        worst = max(worst, assert_within(resumed.steps[0][0][i], whole.steps[1][0][i], step_bound))
        m_bound = (1 - b1) * (d[name] + 2 * gamma(2, f32) * (g + d[name]))
        worst = max(worst, assert_within(mine["exp_avg"], theirs["exp_avg"], m_bound))
        v_bound = (1 - b2) * ((2 * g + d[name]) * d[name] + 2 * gamma(3, f32) * (g + d[name]) ** 2)
        worst = max(worst, assert_within(mine["exp_avg_sq"], theirs["exp_avg_sq"], v_bound))
    return worst


def plan_of(recipe: Recipe) -> tuple[dict, list[dict]]:
    """The units plan of ``recipe``: :func:`units_plan` on the sections it reads, as ``fedfusion plan`` gives them."""
    return units_plan(recipe.units, recipe.train, recipe.population, recipe.model, recipe.report, recipe.data_source())


ALL_TWO = ["units.offload=all", "units.micro_batches=2"]  # every linear layer offloaded, 2 micro-batches a step
# the tests that read the one uninterrupted ALL_TWO run stay on one pytest-xdist worker (addopts: --dist loadgroup)
ON_THE_ALL_TWO_RUN = pytest.mark.xdist_group("test_units_flower.all_two_run")


@pytest.fixture(scope="module")
def all_two_run(tmp_path_factory) -> tuple[Path, Recorded]:
    """One uninterrupted units run of ``TINY + ALL_TWO`` and its server's steps: checked against central training
    and, by the kill-and-resume test, against the resumed run."""
    out = tmp_path_factory.mktemp("all-two") / "units"
    with server_steps() as rec:
        assert main(["run", "rolling", *TINY, *ALL_TWO, "--out", str(out)]) == 0
    return out, rec


@ON_THE_ALL_TWO_RUN
def test_units_run_equals_central_training_step_for_step(all_two_run):
    out, rec = all_two_run
    rows = check_units_run(out)
    assert_central_steps(rows, rec, Central([*TINY, *ALL_TWO]))
    for row in rows[1:]:
        assert row["bytes_down"] > 0 and row["bytes_up"] > 0 and row["virtual_s"] > 0
        assert row["clients_ok"] >= 2 and row["server_fallback"] == 0 and not row["missed"]
        # all linear layers, 2 micro-batches: (q|k|v, o, gate|up, down) x (forward, backward) + lm_head's two, each
        assert row["phases"] == 2 * (4 * 2 + 2)
        assert row["formula_rel_down"] <= 0.05 and row["formula_rel_up"] <= 0.05  # bytes per device per phase
    assert "eval_loss" in rows[0] and "eval_loss" in rows[-1]
    # `fedfusion plan` prices the same step from the shape alone: its bytes and virtual seconds are the run's
    step, _ = plan_of(load_recipe("rolling", [*TINY, *ALL_TWO]))
    for row in rows[1:]:
        if row["redispatched"]:  # a unit re-sent after its deadline (a loaded host) travels twice: more than planned
            assert row["bytes_down"] > step["MB down"] * 1e6 * 0.99
        else:
            assert abs(row["bytes_down"] - step["MB down"] * 1e6) <= 0.01 * row["bytes_down"]
            assert abs(row["bytes_up"] - step["MB up"] * 1e6) <= 0.01 * row["bytes_up"]
            assert abs(row["virtual_s"] - step["step_s"]) <= 0.02 * step["step_s"]
        for key in ("server_flops", "server_verify_flops", "cloud_flops"):  # the server's work as planned
            assert row[key] == pytest.approx(step["server"][key], rel=1e-6), key


def test_two_supernodes_per_device_train_central_trainings_curve(tmp_path):
    """units.supernodes=2: the simulation runs 8 nodes for 4 devices, micro-batch c goes to each device's node
    c mod 2 (own weight cache, own running sums): the loss curve is central training's, and the bytes and virtual
    seconds are what `fedfusion plan` prices for two SuperNodes per device."""
    extra = ["units.offload=all", "units.micro_batches=2", "units.supernodes=2"]
    rows, rec = run_units(tmp_path, extra, nodes=8)
    assert_central_steps(rows, rec, Central([*TINY, *extra]))
    step, _ = plan_of(load_recipe("rolling", [*TINY, *extra]))
    one, _ = plan_of(load_recipe("rolling", [*TINY, *extra[:2]]))
    assert step["MB down"] > one["MB down"]  # each node receives its own weight blocks
    for row in rows[1:]:
        assert row["server_fallback"] == 0 and not row["missed"] and row["formula_rel_down"] <= 0.05
        if not row["redispatched"]:
            assert abs(row["bytes_down"] - step["MB down"] * 1e6) <= 0.01 * row["bytes_down"]
            assert abs(row["bytes_up"] - step["MB up"] * 1e6) <= 0.01 * row["bytes_up"]
            assert abs(row["virtual_s"] - step["step_s"]) <= 0.02 * step["step_s"]
        # each node's weight-gradient sums are checked once per step: the server's work as planned
        for key in ("server_flops", "server_verify_flops", "cloud_flops"):
            assert row[key] == pytest.approx(step["server"][key], rel=1e-6), key
    assert step["server"]["server_verify_flops"] > one["server"]["server_verify_flops"]  # two sums' checks, not one


def test_shaped_links_make_the_real_step_take_the_links_time_and_the_loss_stays_exact(tmp_path):
    """``units.shape_links`` with the catalog's links slowed 500x (20 kB/s): the transport holds each message and
    reply for its device's links (``fedfusion.units.shaper``), so each measured step is no shorter than the
    timeline's step on those links (it leaves out only the messages' fixed overhead), which is far longer than
    loopback's; the steps stay central training's."""
    shaped = ["units.steps=2", "units.shape_links=true", "units.link_scale=0.002", "units.deadline_floor_s=60"]
    rows, rec = run_units(tmp_path, shaped)
    assert_central_steps(rows, rec, Central([*TINY, *shaped]))
    for row in rows[1:]:
        assert row["virtual_s"] >= 8.0 and row["train_s"] >= 0.95 * row["virtual_s"]
        assert not row["missed"] and not row["redispatched"]


def test_a_device_silent_mid_phase_costs_one_deadline_and_the_loss_stays_exact(tmp_path):
    """Device 1 goes silent after 3 messages to each of its 2 SuperNodes (2 micro-batches in flight, one per node):
    each micro-batch that had a message out to it waits one deadline, then the device is offline for good
    (``units.rejoin_after=0``: never asked again). (With one
    SuperNode per device the same run misses once; the suite keeps this, the superset, for time. A stalled node
    sleeps in one of the simulation engine's actors: with 2 stalled nodes on a 2-core host, 0.5 CPU per node keeps
    actors free for the other devices.)"""
    floor, nodes = 3.0, 2
    extra = ["units.micro_batches=2", f"units.supernodes={nodes}", "engine.cpus_per_client=0.5"]
    stalled = ["units.stall_partition=1", "units.stall_after=3", "units.stall_s=9", f"units.deadline_floor_s={floor}",
               "units.rejoin_after=0", *extra]
    rows, rec = run_units(tmp_path, stalled, nodes=4 * nodes)
    assert_central_steps(rows, rec, Central([*TINY, *stalled]))
    missed = [m for r in rows[1:] for m in r["missed"]]
    assert 1 <= len(missed) <= nodes and all(m["devices"] == [1] for m in missed)  # offline, never asked again
    assert all(m["waited_s"] <= m["deadline_s"] + 0.5 and m["deadline_s"] == floor for m in missed)
    assert rows[-1]["offline"] == [1]
    assert sum(r["redispatched"] for r in rows[1:]) >= 1


def test_a_device_that_misses_a_deadline_and_comes_back_takes_units_again_and_the_loss_stays_exact(tmp_path):
    """Device 1 sleeps past its deadline on its 4th message only (``units.stall_messages=1``): it goes offline in
    that step, rejoins at the next (``units.rejoin_after=1``) with its weight blocks sent anew, and computes units
    in every step after; the run is central training's step for step and ends with no device offline."""
    stalled = ["units.stall_partition=1", "units.stall_after=3", "units.stall_s=8", "units.stall_messages=1",
               "units.deadline_floor_s=3", "units.rejoin_after=1"]
    rows, rec = run_units(tmp_path, stalled)
    assert_central_steps(rows, rec, Central([*TINY, *stalled]))
    went = [r["step"] for r in rows[1:] if r["clients_failed"]]
    back = [r["step"] for r in rows[1:] if r["rejoined"]]
    assert len(went) == 1 and back == [went[0] + 1] and rows[went[0]]["offline"] == [1]
    assert all(r["rejoined"] == [1] for r in rows[1:] if r["rejoined"])
    ledger = read_jsonl(tmp_path / "units" / "clients.jsonl")
    assert all(any(r["partition"] == 1 for r in ledger if r["round"] == step) for step in range(back[0], 4))
    assert all(not r["missed"] for r in rows[back[0]:]) and rows[-1]["offline"] == []


def test_each_step_prices_every_device_it_sent_units_to():
    """clients.jsonl gets one row per device and step: the FLOPs of the units it was sent (re-sends too) and its
    bytes, priced on its catalog profile; a device that went offline in the step is charged, as wasted work."""
    catalog = load_catalog()
    caps = {11: Caps("phone", 0, 10), 12: Caps("laptop", 1, 10), 13: Caps("phone", 2, 10)}
    trace = [PhaseRecord(0, [], [], None, down_bytes={0: 100, 1: 300}, up_bytes={0: 40, 1: 90}, flops={0: 2e9, 1: 6e9}),
             PhaseRecord(0, [], [], None, down_bytes={0: 50}, up_bytes={}, flops={0: 1e9})]
    rows = price_step(3, trace, [11, 12, 13], caps, catalog, failed={0})
    assert [(r["node"], r["status"], r["wasted"]) for r in rows] == [(11, "failed", True), (12, "ok", False)]
    phone = price_work(catalog["phone"], 3e9, 150, 40)
    assert (rows[0]["flops"], rows[0]["bytes_down"], rows[0]["bytes_up"]) == (3e9, 150, 40)
    assert rows[0]["energy_j"] == pytest.approx(phone.wall_j) and rows[0]["co2_g"] == pytest.approx(phone.co2_g)
    assert rows[1]["energy_j"] == pytest.approx(price_work(catalog["laptop"], 6e9, 300, 90).wall_j)


@ON_THE_ALL_TWO_RUN
def test_a_units_run_killed_after_step_one_resumes_to_the_uninterrupted_curve(all_two_run, tmp_path):
    """Killed (SIGKILL: the CLI, Ray and its workers) once step 1's checkpoint (target, AdamW moments) is written,
    then resumed with `fedfusion run --resume`: steps 2 and 3 and the final evaluation are central training's from
    the checkpoint's values and moments (assert_central_steps), and the checkpoint holds the uninterrupted run's
    state after step 1 up to rounding (assert_restored). Not the two curves against each other: with micro-batches
    in flight a tile's last bits may vary (run.units.train_step), and AdamW's steps bound no such difference."""
    _, uninterrupted = all_two_run
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "fedfusion.cli", "run", "rolling", *TINY, *ALL_TWO, "--out", str(out)],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state, deadline = out / "checkpoint" / "state.json", time.monotonic() + 400
    while proc.poll() is None and time.monotonic() < deadline and not state.is_file():
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert json.loads(state.read_text())["round"] == 1 and not (out / "summary.json").exists()
    with server_steps() as rec:
        assert main(["run", "--resume", str(out)]) == 0
    resumed = read_jsonl(out / "metrics.jsonl")
    central = Central([*TINY, *ALL_TWO])
    assert len(rec.steps) == 2 and len(uninterrupted.steps) == 3
    assert_central_steps(resumed, rec, central)
    assert_restored(rec, uninterrupted, central)
    assert json.loads((out / "summary.json").read_text())["status"] == "ok"
