"""The units mode's ledger: the server's own compute, its checks and its traffic, priced with
``price_work`` on its catalog tier, and the same step on the catalog's cloud GPU; in ``fedfusion plan`` and in a
run's report. Each priced item is there, non-zero, and follows its formula."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fedfusion.analysis.report import write_report
from fedfusion.cli import main
from fedfusion.config.recipe import load_recipe
from fedfusion.devices.catalog import load_catalog
from fedfusion.devices.energy import price_work
from fedfusion.run.check import load_checked
from fedfusion.run.run_dir import RunDir
from fedfusion.units import UnitDevice, UnitEngine, install
from fedfusion.units.ledger import price_server, server_timeline
from fedfusion.units.phases import OPTIMIZER_FLOPS, llama_phases, server_flops
from fedfusion.units.verify import VECTORS, Freivalds, check_flops
from tests.test_units_flower import plan_of

SHAPE = dict(hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, vocab=50)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny GEMMs on one thread, restored after


def gemm_flops(mode: str, tokens: int) -> int:
    return sum(g.flops for shapes, _ in llama_phases(**SHAPE, tokens=tokens, mode=mode) for g in shapes)


@pytest.mark.parametrize("mode", ["mlp", "all"])
def test_server_flops_items_follow_their_formulas(mode: str) -> None:
    tokens, seq, params = 96, 24, 12_345
    got = server_flops(**SHAPE, tokens=tokens, seq=seq, params=params, mode=mode)
    h, i, layers, heads, kv, vocab = 32, 64, 2, 4, 2 * 8, 50
    assert got["attention"] == 3 * 2 * (2 * tokens * seq * h) * layers  # QK^T and PV, forward x3
    per_token = layers * (2 * 4 * h + 3 * (h + kv) + 5 * heads * seq + 5 * i + 2 * h) + 4 * h + 5 * vocab
    assert got["elementwise"] == 3 * per_token * tokens
    assert got["optimizer"] == OPTIMIZER_FLOPS["adamw"] * params
    assert got["linear"] == gemm_flops("all", tokens) - gemm_flops(mode, tokens)  # what mlp offload leaves behind
    assert all(v > 0 for k, v in got.items() if k != "linear") and (got["linear"] > 0) == (mode == "mlp")
    sgd = server_flops(**SHAPE, tokens=tokens, seq=seq, params=params, mode=mode, optimizer="sgd")
    assert sgd["optimizer"] == OPTIMIZER_FLOPS["sgd"] * params


def test_engine_counts_the_flops_of_every_check() -> None:
    """An honest step: one check per GEMM of every phase, each at the module's formula."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, vocab_size=50,
                                         max_position_embeddings=64))
    engine = UnitEngine([UnitDevice(f"d{i}", 1e6, 1e9, 1e6, 5e5) for i in range(3)])
    install(model, engine, "all")
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    assert engine.trace and not any(rec.failed_devices for rec in engine.trace)
    for rec in engine.trace:
        assert rec.verify_flops == sum(check_flops(g.m, g.n, g.k) for g in rec.shapes) > 0
    a, b = torch.ones(5, 7), torch.ones(7, 3)
    assert Freivalds(seed=0).flops(a, b) == check_flops(5, 3, 7) == (VECTORS + 1) * 2 * (5 * 7 + 7 * 3 + 5 * 3)


def test_price_server_prices_each_item_on_its_tier() -> None:
    catalog = load_catalog()
    server, cloud = catalog["cloud-a5000"], catalog["cloud-h100"]
    flops = server_flops(**SHAPE, tokens=64, seq=32, params=10_000, mode="mlp")
    own = sum(flops.values())
    step = price_server(server, cloud, flops, 3e6, 5_000_000, 2_000_000, 4e8)
    row = step.row()
    assert row["server_flops"] == own and row["server_verify_flops"] == 3e6
    assert row["server_compute_s"] == pytest.approx(price_work(server, own, 0, 0).compute_s)
    assert row["server_verify_s"] == pytest.approx(price_work(server, 3e6, 0, 0).compute_s)
    # the server sends what the devices download (its uplink) and receives what they upload
    assert row["server_comm_s"] == pytest.approx(price_work(server, 0, 2_000_000, 5_000_000).comm_s)
    assert row["server_energy_j"] == pytest.approx(price_work(server, own, 0, 0).wall_j + price_work(
        server, 3e6, 0, 0).wall_j + price_work(server, 0, 2_000_000, 5_000_000).wall_j)
    assert row["cloud_flops"] == 4e8 + own  # no checks, no transfers: the cloud holds model and data
    assert row["cloud_step_s"] == pytest.approx(price_work(cloud, 4e8 + own, 0, 0).compute_s)
    assert row["cloud_energy_j"] == pytest.approx(price_work(cloud, 4e8 + own, 0, 0).wall_j)
    assert all(v > 0 for k, v in row.items() if isinstance(v, float) and k != "server_linear_flops")
    gap, opt = server_timeline(server, flops, 3e6, phases=10)
    assert opt == pytest.approx(flops["optimizer"] / (server.tflops * 1e12))
    assert gap == pytest.approx((own - flops["optimizer"] + 3e6) / (server.tflops * 1e12) / 10)


def test_plan_shows_the_server_and_the_cloud_step() -> None:
    recipe = load_recipe("units")
    step, rows = plan_of(recipe)
    s = step["server"]
    u, m = recipe.units, recipe.model
    seq, micro = recipe.train.seq_len, u.micro_batches
    tokens = recipe.train.batch_size // micro * seq
    for item in ("attention", "elementwise", "optimizer"):
        assert s[f"server_{item}_flops"] > 0
    assert s["server_attention_flops"] == 3 * 4 * tokens * micro * seq * m.hidden_size * m.num_layers
    assert s["server_egress_bytes"] == pytest.approx(step["MB down"] * 1e6, rel=1e-9)
    assert s["server_ingress_bytes"] == pytest.approx(step["MB up"] * 1e6, rel=1e-9)
    for key in ("server_verify_flops", "server_compute_s", "server_verify_s", "server_comm_s", "server_energy_j",
                "cloud_step_s", "cloud_energy_j"):
        assert s[key] > 0, key
    assert s["server_device"] == u.server_device and s["cloud_device"] == recipe.report.cloud
    for row in rows[:-2]:  # each device tier: its units per step and the largest, rows x columns x inner length
        assert row["units/step"] > 0 and len(row["largest unit"].split("x")) == 3
    tiers = [r["tier"] for r in rows]
    assert f"server ({u.server_device})" in tiers and f"{recipe.report.cloud} (the same step)" in tiers
    # the server's time is in the step: a slow server lengthens it by at least its optimizer step
    slow, _ = plan_of(load_recipe("units", ["units.server_device=phone-lowend"]))
    assert slow["step_s"] >= step["step_s"] + s["server_optimizer_flops"] / 0.1e12 * 0.999
    assert slow["server"]["server_compute_s"] > 100 * s["server_compute_s"]


def test_the_plan_prices_the_devices_lanes() -> None:
    """``units.lanes`` reaches the plan's timeline: with 2 micro-batches in flight a device that holds one message at
    a time (Flower's SuperNode, the default) overlaps nothing, so its step is slower than one that holds two, whose
    step equals the no-limit runtime's (two chains never queue a third message); the bytes are the same."""
    steps = {lanes: plan_of(load_recipe("units", ["units.micro_batches=2", f"units.lanes={lanes}"]))[0]
             for lanes in (0, 1, 2)}
    assert steps[0]["step_s"] == steps[2]["step_s"] < steps[1]["step_s"]
    assert steps[0]["MB down"] == steps[1]["MB down"] and steps[0]["MB up"] == steps[1]["MB up"]
    assert load_recipe("units").units.lanes == 1


@pytest.mark.slow  # two plans of the units recipe: ~2.5 s
def test_the_plan_prices_supernodes_per_device() -> None:
    """``units.supernodes=2`` reaches the plan's timeline and its step line: with 2 micro-batches each device works on
    two messages at once (faster than one SuperNode), and each node receives its own weight blocks (more bytes)."""
    from fedfusion.analysis.units_plan import units_view

    one = plan_of(load_recipe("units", ["units.micro_batches=2"]))[0]
    recipe = load_recipe("units", ["units.micro_batches=2", "units.supernodes=2"])
    two = plan_of(recipe)[0]
    assert two["step_s"] < one["step_s"] and two["MB down"] > one["MB down"]
    view = units_view(recipe.name, recipe.units, recipe.train, recipe.population, recipe.model, recipe.report,
                      recipe.data_source())
    assert "devices running 2 SuperNodes of one message each: units.supernodes" in view.notes[0]


@pytest.mark.slow  # a plan at every divisor of the batch, then the chooser and `fedfusion plan`: 4-11 s here
def test_micro_batches_zero_is_the_choosers_count_on_the_plans_steps(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``units.micro_batches: 0`` resolves to ``timeline.choose_micro_batches``'s count for the recipe's devices and
    batch, here re-derived from the plan at every divisor of the batch (the same devices, phases and server time):
    the smallest whose busiest link is >= 0.70 busy without a slower step than one micro-batch, else the fastest;
    the run directory's recipe.yaml records it and ``fedfusion plan`` prints the count and steps with it."""
    batch = load_recipe("units").train.batch_size
    plans = {m: plan_of(load_recipe("units", [f"units.micro_batches={m}"]))[0]
             for m in range(1, batch + 1) if batch % m == 0}
    ok = [m for m, p in plans.items() if p["link_utilisation"] >= 0.7 and p["step_s"] <= plans[1]["step_s"]]
    expected = ok[0] if ok else min(plans, key=lambda m: (plans[m]["step_s"], m))
    checked = load_checked("units", ["units.micro_batches=0"])
    assert checked.units.micro_batches == expected
    assert RunDir.reopen(RunDir(tmp_path / "run", checked).path).recipe.units.micro_batches == expected
    assert main(["plan", "units", "units.micro_batches=0"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    chosen = plans[expected]
    assert f"units.micro_batches: {expected} (0:" in out
    assert (f"one step: {expected} micro-batch{'es' if expected > 1 else ''}, {chosen['phases']} phases, "
            f"{chosen['step_s']:.2f} virtual s") in out


def test_units_report_has_the_server_and_cloud_section(tmp_path: Path) -> None:
    row = {"round": 1, "step": 1, "train_loss": 4.0, "bytes_down": 10, "bytes_up": 5, "virtual_s": 2.0,
           "virtual_bound_s": 1.6, "server_link_utilisation": 0.5, "energy_j": 3.0, "server_energy_j": 1.0,
           "server_flops": 5e8, "server_compute_s": 1e-5,
           "server_verify_flops": 1e8, "server_verify_s": 1e-6, "server_egress_bytes": 10, "server_ingress_bytes": 5,
           "server_comm_s": 1e-8, "cloud_step_s": 0.001}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"round": 0, "step": 0}) + "\n" + json.dumps(row) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed", "mode": "units", "server_device": "cloud-a100",
                                                       "cloud_device": "cloud-a5000", "cloud_energy_j": 0.3,
                                                       "server_energy_j": 1.0}))
    text = write_report(tmp_path).read_text()
    assert "## Server and cloud (units.server_device `cloud-a100`, report.cloud `cloud-a5000`)" in text
    assert "| step / bound | missed deadlines |" in text and "| 1.25 | 0 |" in text  # virtual_s / virtual_bound_s
    assert "| 2000x |" in text and "take 0.001 s on cloud-a5000" in text and "2 virtual s (2000x), 2 J on the devices" in text


def test_an_unknown_server_device_is_refused() -> None:
    from fedfusion.config.sections import RecipeError

    with pytest.raises(RecipeError, match="units.server_device: unknown device 'nope'"):
        load_checked("units", ["units.server_device=nope"])
