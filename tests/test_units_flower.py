"""The exact (units) mode through ``fedfusion run`` on Flower's simulation engine: the server trains the
target centrally, the nodes compute its linear layers' GEMM tiles, and the loss curve is central training's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fedfusion.analysis.report import read_jsonl
from fedfusion.analysis.units_plan import units_plan
from fedfusion.cli import main
from fedfusion.config.recipe import load_recipe
from fedfusion.data.population import data_spec, data_tokenizer
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
]


def central_losses(overrides: list[str]) -> list[float]:
    """The same target on the same batches, trained by a plain torch loop on this process: no units, no Flower."""
    recipe = load_recipe("rolling", overrides)
    torch.manual_seed(0)
    model = build_target(recipe.model, data_tokenizer(data_spec(recipe.data_source())), recipe.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.train.lr, weight_decay=recipe.train.weight_decay)
    losses = []
    for batch in step_batches(recipe, training_windows(recipe)):
        opt.zero_grad()
        total = 0.0
        for part in batch.chunk(recipe.units.micro_batches):
            logits = model(input_ids=part[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), part[:, 1:].reshape(-1))
            (loss * len(part) / len(batch)).backward()
            total += loss.item() * len(part) / len(batch)
        opt.step()
        losses.append(total)
    return losses


def run_units(tmp_path: Path, extra: list[str], nodes: int = 4) -> tuple[list[dict], list[float]]:
    out = tmp_path / "units"
    assert main(["run", "rolling", *TINY, *extra, "--out", str(out)]) == 0
    return check_units_run(out, extra, nodes)


def check_units_run(out: Path, extra: list[str], nodes: int = 4) -> tuple[list[dict], list[float]]:
    """The ledgers of a finished units run of ``TINY + extra`` in ``out``, checked; its metrics rows and the loss
    curve of central training on the same batches."""
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
    return rows, central_losses([*TINY, *extra])


def assert_same_curve(rows: list[dict], central: list[float]) -> None:
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    got = [r["train_loss"] for r in rows[1:]]
    assert len(got) == len(central) == 3
    for step, (a, b) in enumerate(zip(got, central), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: units {a} vs central {b}"
    assert got[-1] < got[0]  # it trains


ALL_TWO = ["units.offload=all", "units.micro_batches=2"]  # every linear layer offloaded, 2 micro-batches a step
# the tests that read the one uninterrupted ALL_TWO run stay on one pytest-xdist worker (addopts: --dist loadgroup)
ON_THE_ALL_TWO_RUN = pytest.mark.xdist_group("test_units_flower.all_two_run")


@pytest.fixture(scope="module")
def all_two_run(tmp_path_factory) -> Path:
    """One uninterrupted units run of ``TINY + ALL_TWO``: checked against central training and, by the kill-and-resume
    test, against the resumed run."""
    out = tmp_path_factory.mktemp("all-two") / "units"
    assert main(["run", "rolling", *TINY, *ALL_TWO, "--out", str(out)]) == 0
    return out


@ON_THE_ALL_TWO_RUN
def test_units_run_equals_central_training_step_for_step(all_two_run):
    rows, central = check_units_run(all_two_run, ALL_TWO)
    assert_same_curve(rows, central)
    for row in rows[1:]:
        assert row["bytes_down"] > 0 and row["bytes_up"] > 0 and row["virtual_s"] > 0
        assert row["clients_ok"] >= 2 and row["server_fallback"] == 0 and not row["missed"]
        # all linear layers, 2 micro-batches: (q|k|v, o, gate|up, down) x (forward, backward) + lm_head's two, each
        assert row["phases"] == 2 * (4 * 2 + 2)
        assert row["formula_rel_down"] <= 0.05 and row["formula_rel_up"] <= 0.05  # bytes per device per phase
    assert "eval_loss" in rows[0] and "eval_loss" in rows[-1]
    # `fedfusion plan` prices the same step from the shape alone: its bytes and virtual seconds are the run's
    step, _ = units_plan(load_recipe("rolling", [*TINY, *ALL_TWO]))
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
    rows, central = run_units(tmp_path, extra, nodes=8)
    assert_same_curve(rows, central)
    step, _ = units_plan(load_recipe("rolling", [*TINY, *extra]))
    one, _ = units_plan(load_recipe("rolling", [*TINY, *extra[:2]]))
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


def test_a_device_silent_mid_phase_costs_one_deadline_and_the_loss_stays_exact(tmp_path):
    """Device 1 goes silent after 3 messages to each of its 2 SuperNodes (2 micro-batches in flight, one per node):
    each micro-batch that had a message out to it waits one deadline, then the device is offline for good. (With one
    SuperNode per device the same run misses once; the suite keeps this, the superset, for time. A stalled node
    sleeps in one of the simulation engine's actors: with 2 stalled nodes on a 2-core host, 0.5 CPU per node keeps
    actors free for the other devices.)"""
    floor, nodes = 1.5, 2
    extra = ["units.micro_batches=2", f"units.supernodes={nodes}", "engine.cpus_per_client=0.5"]
    rows, central = run_units(tmp_path, ["units.stall_partition=1", "units.stall_after=3", "units.stall_s=6",
                                         f"units.deadline_floor_s={floor}", *extra], nodes=4 * nodes)
    assert_same_curve(rows, central)
    missed = [m for r in rows[1:] for m in r["missed"]]
    assert 1 <= len(missed) <= nodes and all(m["devices"] == [1] for m in missed)  # offline, never asked again
    assert all(m["waited_s"] <= m["deadline_s"] + 0.5 and m["deadline_s"] == floor for m in missed)
    assert rows[-1]["offline"] == [1]
    assert sum(r["redispatched"] for r in rows[1:]) >= 1


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
    then resumed with `fedfusion run --resume`: steps 2 and 3 and the final evaluation are the uninterrupted run's
    (float tolerance: with micro-batches in flight a tile's last bits may vary, see run.units.train_step)."""
    whole = all_two_run
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "fedfusion.cli", "run", "rolling", *TINY, *ALL_TWO, "--out", str(out)],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state, deadline = out / "checkpoint" / "state.json", time.monotonic() + 400
    while proc.poll() is None and time.monotonic() < deadline and not state.is_file():
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert json.loads(state.read_text())["round"] == 1 and not (out / "summary.json").exists()
    assert main(["run", "--resume", str(out)]) == 0
    first, resumed = read_jsonl(whole / "metrics.jsonl"), read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert_same_curve(resumed, [r["train_loss"] for r in first[1:]])  # step for step, within float tolerance
    assert abs(resumed[-1]["eval_loss"] - first[-1]["eval_loss"]) <= 1e-5 * first[-1]["eval_loss"]
    assert json.loads((out / "summary.json").read_text())["status"] == "ok"
