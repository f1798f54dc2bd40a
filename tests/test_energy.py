"""Pricing counted work: time, joules, carbon."""

from __future__ import annotations

import json
from dataclasses import replace
from importlib import resources
from pathlib import Path

import pytest

from fedfusion.devices.catalog import Device, load_catalog
from fedfusion.devices.energy import (
    GRID_G_PER_KWH,
    WorkCost,
    price_work,
    round_wall_time,
    train_flops,
)

YEAR_S = 365.25 * 24 * 3600

# Round numbers: 1 TFLOPS, 8 Mb/s up = 1 MB/s, 16 Mb/s down = 2 MB/s, 1 g of embodied carbon per busy second.
TOY = Device(
    name="toy", description="round numbers", memory_gb=1.0, tflops=1.0, train_w=10.0, idle_w=1.0,
    battery_wh=10.0, up_mbps=8.0, down_mbps=16.0, radio_w=0.5, embodied_kg=YEAR_S / 1000, lifetime_years=1.0,
    zone="TEST", sources="assumed",
)
GRID = {"TEST": 360.0}


def test_price_work_by_hand():
    cost = price_work(TOY, flops=2e12, bytes_down=4_000_000, bytes_up=3_000_000,
                      charger_efficiency=0.5, idle_s=10.0, grid=GRID)
    assert cost.compute_s == pytest.approx(2.0)  # 2e12 / 1e12
    assert cost.comm_s == pytest.approx(5.0)  # 4 MB at 2 MB/s + 3 MB at 1 MB/s
    assert cost.virtual_s == pytest.approx(7.0)
    assert cost.compute_j == pytest.approx(20.0)  # 2 s * 10 W
    assert cost.radio_j == pytest.approx(2.5)  # 5 s * 0.5 W
    assert cost.idle_j == pytest.approx(10.0)  # 10 s * 1 W
    assert cost.wall_j == pytest.approx(65.0)  # 32.5 J / 0.5
    assert cost.co2_operational_g == pytest.approx(65.0 / 3.6e6 * 360.0)
    assert cost.co2_embodied_g == pytest.approx(7.0)  # 1 g per busy second, idle excluded
    assert cost.co2_g == pytest.approx(cost.co2_operational_g + 7.0)
    row = cost.to_dict()
    assert row["virtual_s"] == pytest.approx(7.0) and row["wall_j"] == pytest.approx(65.0) and len(row) == 10


def test_train_flops_is_six_per_parameter_per_token():
    assert train_flops(125_000_000, 8192) == 6 * 125_000_000 * 8192


def test_charger_efficiency_raises_wall_joules_only():
    lossless = price_work(TOY, 1e12, 1000, 1000, charger_efficiency=1.0, grid=GRID)
    default = price_work(TOY, 1e12, 1000, 1000, grid=GRID)
    assert default.wall_j == pytest.approx(lossless.wall_j / 0.85)
    assert default.co2_operational_g == pytest.approx(lossless.co2_operational_g / 0.85)
    assert (default.compute_j, default.radio_j, default.co2_embodied_g, default.virtual_s) == (
        lossless.compute_j, lossless.radio_j, lossless.co2_embodied_g, lossless.virtual_s)


def test_zone_override_changes_only_operational_carbon():
    laptop = load_catalog()["laptop"]
    home = price_work(laptop, 1e15, 10**7, 10**7)
    assert home == price_work(laptop, 1e15, 10**7, 10**7, zone=laptop.zone)
    fra, pol = (price_work(laptop, 1e15, 10**7, 10**7, zone=z) for z in ("FRA", "POL"))
    assert fra.co2_operational_g / pol.co2_operational_g == pytest.approx(56.0 / 661.9)
    assert fra.co2_embodied_g == pol.co2_embodied_g == home.co2_embodied_g
    assert fra.wall_j == pol.wall_j == home.wall_j


def test_embodied_carbon_is_amortised_by_busy_time():
    one = price_work(TOY, 1e12, 0, 0, grid=GRID)
    two = price_work(TOY, 2e12, 0, 0, grid=GRID)
    waiting = price_work(TOY, 1e12, 0, 0, idle_s=100.0, grid=GRID)
    assert two.co2_embodied_g == pytest.approx(2 * one.co2_embodied_g)
    assert waiting.co2_embodied_g == one.co2_embodied_g and waiting.wall_j > one.wall_j
    longer_life = price_work(replace(TOY, lifetime_years=4.0), 1e12, 0, 0, grid=GRID)
    assert longer_life.co2_embodied_g == pytest.approx(one.co2_embodied_g / 4)


def test_cloud_is_faster_and_joules_per_flop_follow_the_catalog():
    catalog = load_catalog()
    flops = train_flops(125_000_000, 16 * 512)  # one OPT-125m step, batch 16 x 512 tokens
    costs = {name: price_work(d, flops, 0, 0) for name, d in catalog.items()}
    assert costs["phone"].compute_s > 100 * costs["cloud-a100"].compute_s
    assert costs["cloud-h100"].compute_s < costs["cloud-a100"].compute_s < costs["cloud-a5000"].compute_s
    by_cost = sorted(catalog, key=lambda n: costs[n].compute_j / flops)
    assert by_cost == sorted(catalog, key=lambda n: catalog[n].train_w / catalog[n].tflops)


def test_builtin_zones_are_known():
    assert {d.zone for d in load_catalog().values()} <= set(GRID_G_PER_KWH)
    assert GRID_G_PER_KWH["USA"] == 369.5 and GRID_G_PER_KWH["WORLD"] == 475


def test_round_wall_time_is_the_slowest_client():
    fast, slow = price_work(TOY, 1e12, 0, 0, grid=GRID), price_work(TOY, 3e12, 2_000_000, 0, grid=GRID)
    assert round_wall_time([fast, slow, fast]) == pytest.approx(4.0)
    assert round_wall_time([]) == 0.0
    assert isinstance(fast, WorkCost)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown grid zone 'MARS'.*FRA.*USA"):
        price_work(load_catalog()["phone"], 1e9, 0, 0, zone="MARS")
    with pytest.raises(ValueError, match="TEST"):
        price_work(TOY, 1e9, 0, 0, zone="USA", grid=GRID)
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="charger_efficiency"):
            price_work(TOY, 1e9, 0, 0, charger_efficiency=bad, grid=GRID)
    with pytest.raises(ValueError, match="non-negative"):
        price_work(TOY, -1.0, 0, 0, grid=GRID)


def test_a_tier_training_through_executorch_is_priced_at_the_runtime_speed(tmp_path, capsys):
    """``runtime: executorch`` in a catalog tier: its compute seconds (and so joules) are the runtime's measured
    4.8x torch's (benchmarks/results/device_runtime.md); transfers are unchanged; ``fedfusion plan`` says so."""
    import yaml

    from fedfusion.cli import main
    from fedfusion.devices.energy import RUNTIME_SLOWDOWN, price_work

    phone = load_catalog()["phone"]
    assert phone.runtime == "torch"
    torch_cost = price_work(phone, 1e12, 10**6, 10**6)
    runtime_cost = price_work(replace(phone, runtime="executorch"), 1e12, 10**6, 10**6)
    measured = json.loads((Path(__file__).parents[1] / "benchmarks/results/device_runtime.json").read_text())
    row = next(r for r in measured["rows"] if r["tier"] == "phone")  # the factor is the results file's, to 2 digits
    assert RUNTIME_SLOWDOWN["executorch"] == pytest.approx(row["torch_steps_per_s"] / row["runtime_steps_per_s"], rel=0.01)
    assert runtime_cost.compute_s == pytest.approx(torch_cost.compute_s * RUNTIME_SLOWDOWN["executorch"])
    assert runtime_cost.comm_s == torch_cost.comm_s
    raw = yaml.safe_load(Path(str(resources.files("fedfusion.catalog").joinpath("devices.yaml"))).read_text())
    raw["phone"]["runtime"] = "executorch"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    assert load_catalog(tmp_path / "c.yaml")["phone"].runtime == "executorch"
    assert main(["plan", "quickstart", f"population.catalog={tmp_path / 'c.yaml'}"]) == 0
    assert "phone: trains through the executorch runtime, priced at its measured speed, 4.8x" in capsys.readouterr().out
    raw["phone"]["runtime"] = "onnx"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="runtime must be one of torch, executorch"):
        load_catalog(tmp_path / "c.yaml")
