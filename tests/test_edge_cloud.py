"""Edge vs cloud comparison: pricing through energy.price_work, totals, ratios, sensitivity, rendering."""

from __future__ import annotations

import pytest

from fedfusion.devices import load_catalog
from fedfusion.edge_cloud import (
    TierWork, assumptions, edge_cloud_markdown, edge_vs_cloud, markdown_table, sensitivity, work_from_clients,
)
from fedfusion.energy import GRID_G_PER_KWH, price_work

CAT = load_catalog()
WORK = [TierWork("phone", 4e15, 2e8, 2e8, useful_flops=3e15), TierWork("laptop", 6e15, 3e8, 3e8)]


def by_device(rows):
    return {(r["side"], r["device"]): r for r in rows}


def test_each_side_is_priced_by_price_work():
    rows = by_device(edge_vs_cloud(WORK, cloud="cloud-a100", pue=1.25, charger_efficiency=0.8))
    phone = price_work(CAT["phone"], 4e15, int(2e8), int(2e8), charger_efficiency=0.8)
    assert rows[("edge", "phone")]["energy_kwh"] == pytest.approx(phone.wall_j / 3.6e6)
    assert rows[("edge", "phone")]["co2_g"] == pytest.approx(phone.co2_g)
    gpu = CAT["cloud-a100"]
    cloud_j = 9e15 / (gpu.tflops * 1e12) * gpu.train_w * 1.25  # only useful FLOPs, times the PUE
    assert rows[("cloud", "cloud-a100")]["flops"] == 9e15
    assert rows[("cloud", "cloud-a100")]["energy_kwh"] == pytest.approx(cloud_j / 3.6e6)
    assert rows[("cloud", "cloud-a100")]["co2_operational_g"] == pytest.approx(cloud_j / 3.6e6 * GRID_G_PER_KWH["USA"])


def test_totals_and_ratios_add_up():
    rows = edge_vs_cloud(WORK, data_upload_bytes=1e9)
    edge = [r for r in rows if r["side"] == "edge" and r["device"] != "total"]
    cloud = [r for r in rows if r["side"] == "cloud" and r["device"] != "total"]
    t = by_device(rows)
    for key in ("energy_kwh", "co2_g", "co2_embodied_g", "busy_h"):
        assert t[("edge", "total")][key] == pytest.approx(sum(r[key] for r in edge))
        assert t[("cloud", "total")][key] == pytest.approx(sum(r[key] for r in cloud))
        assert rows[-1][key] == pytest.approx(t[("edge", "total")][key] / t[("cloud", "total")][key])
    uploads = [r for r in cloud if r["device"].startswith("data upload")]
    assert len(uploads) == 2 and all(r["energy_kwh"] > 0 for r in uploads)


def test_pue_embodied_share_and_grid_move_the_right_parts():
    base = by_device(edge_vs_cloud(WORK, pue=1.0))
    hot = by_device(edge_vs_cloud(WORK, pue=1.5))
    assert hot[("cloud", "total")]["energy_kwh"] == pytest.approx(1.5 * base[("cloud", "total")]["energy_kwh"])
    assert hot[("edge", "total")]["energy_kwh"] == base[("edge", "total")]["energy_kwh"]
    free = by_device(edge_vs_cloud(WORK, edge_embodied_share=0.0))
    assert free[("edge", "total")]["co2_embodied_g"] == 0
    assert free[("cloud", "total")]["co2_embodied_g"] == base[("cloud", "total")]["co2_embodied_g"] > 0
    clean = by_device(edge_vs_cloud(WORK, edge_grid_g_per_kwh=50.0))
    assert clean[("edge", "phone")]["co2_operational_g"] == pytest.approx(
        base[("edge", "phone")]["co2_operational_g"] * 50.0 / GRID_G_PER_KWH["USA"])


def test_sensitivity_is_monotone_in_lifetime_and_grid():
    table = sensitivity(WORK, lifetimes=(1.0, 3.0, 6.0), grids=(30.0, 475.0))
    assert [r["edge lifetime (years)"] for r in table] == [1.0, 3.0, 6.0]
    for row in table:
        assert row["30 g/kWh"] < row["475 g/kWh"]
    assert table[0]["30 g/kWh"] > table[1]["30 g/kWh"] > table[2]["30 g/kWh"]
    direct = edge_vs_cloud(WORK, lifetime_years=3.0, edge_grid_g_per_kwh=475.0)[-1]["co2_g"]
    assert table[1]["475 g/kWh"] == pytest.approx(direct)


def test_work_from_client_rows_follows_the_ledger_rule():
    rows = [
        {"device": "phone", "params": 1000, "tokens": 10, "bytes_down": 400, "bytes_up": 400, "status": "ok"},
        {"device": "phone", "params": 1000, "tokens": 10, "bytes_down": 400, "bytes_up": 400, "status": "failed"},
        {"device": "laptop", "params": 2000, "tokens": 5, "bytes_down": 800, "bytes_up": 800, "status": "rejected"},
        {"device": "desktop", "params": 2000, "tokens": 5, "bytes_down": 800, "bytes_up": 0, "status": "cut"},
    ]
    work = {w.tier: w for w in work_from_clients(rows)}
    assert work["phone"].flops == 2 * 6 * 1000 * 10 and work["phone"].useful == 6 * 1000 * 10
    assert (work["phone"].bytes_down, work["phone"].bytes_up) == (800, 400)  # a failed client uploads nothing
    assert work["laptop"].useful == 0 and work["laptop"].bytes_up == 800
    assert work["desktop"].bytes_up == 800  # a cut client's reply is still sent, the size of what it got
    with pytest.raises(ValueError, match="lacks 'tokens'"):
        work_from_clients([{"device": "phone", "params": 1, "status": "ok"}])


def test_markdown_holds_both_tables_and_the_assumptions():
    text = edge_cloud_markdown(WORK, cloud="cloud-h100", pue=1.1)
    assert "## Edge vs cloud" in text and "| edge / cloud | ratio |" in text
    assert "| edge lifetime (years) | 30 g/kWh |" in text
    assert "PUE 1.1" in text and "H100" in text
    assert len(assumptions()) >= 6
    assert markdown_table([{"a": 1.23456, "b": "x"}]) == "| a | b |\n|---|---|\n| 1.23 | x |"


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="tier 'toaster'"):
        edge_vs_cloud([TierWork("toaster", 1.0)])
    with pytest.raises(ValueError, match="cloud: 'tpu'"):
        edge_vs_cloud(WORK, cloud="tpu")
    with pytest.raises(ValueError, match="pue: must be >= 1"):
        edge_vs_cloud(WORK, pue=0.9)
    with pytest.raises(ValueError, match="work: no edge work"):
        edge_vs_cloud([])
    with pytest.raises(ValueError, match="useful_flops"):
        TierWork("phone", 1.0, useful_flops=2.0)
    with pytest.raises(ValueError, match="unknown grid zone"):
        edge_vs_cloud(WORK, cloud_zone="MARS")
