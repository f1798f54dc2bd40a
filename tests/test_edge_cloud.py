"""Edge vs cloud comparison: pricing through energy.price_work, totals, ratios, sensitivity, rendering."""

from __future__ import annotations

import dataclasses

import pytest

from fedfusion.analysis import seed_paper
from fedfusion.analysis.edge_cloud import (
    CARBON_VIEWS,
    EDGE_COLUMN,
    EDGE_PARTS,
    TierWork,
    assumptions,
    carbon_views,
    cloud_tiers,
    edge_breakdown,
    edge_cloud_markdown,
    edge_vs_cloud,
    flip_table,
    headline,
    markdown_table,
    sensitivity,
    solve,
    totals,
    work_from_clients,
)
from fedfusion.devices.catalog import Device, load_catalog
from fedfusion.devices.energy import GRID_G_PER_KWH, price_work

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


# A hand-checkable world: 1 g of embodied carbon per 1,000 busy seconds on the edge device, 10x that on the
# cloud GPU; 1,000 g/kWh everywhere.
YEAR_S = 365.25 * 24 * 3600
EDGE = Device("e", "edge", 1.0, tflops=1.0, train_w=10.0, idle_w=1.0, battery_wh=10.0, up_mbps=8.0, down_mbps=8.0,
              radio_w=1.0, embodied_kg=YEAR_S / 1e6, lifetime_years=1.0, zone="X", sources="assumed")
GPU = Device("cloud-x", "gpu", 1.0, tflops=10.0, train_w=100.0, idle_w=1.0, battery_wh=None, up_mbps=8.0,
             down_mbps=8.0, radio_w=1.0, embodied_kg=YEAR_S / 1e5, lifetime_years=1.0, zone="X", sources="assumed")
HAND = {"catalog": {"e": EDGE, "cloud-x": GPU}, "cloud": "cloud-x", "grid": {"X": 1000.0}, "pue": 1.5,
        "charger_efficiency": 0.5}
# 1e13 FLOPs: 10 s at 10 W on the edge; 1 MB down and up at 1 MB/s: 2 s at 1 W; wall 204 J (charger 50 %).
# The cloud trains the 0.5e13 useful FLOPs in 0.5 s at 100 W, x PUE 1.5 = 75 J.
HAND_WORK = [TierWork("e", 1e13, 1e6, 1e6, useful_flops=0.5e13)]
EDGE_OP, EDGE_EMB = 204 / 3600, 12e-3  # g: 204 J at 1,000 g/kWh; 12 busy s x 1e-3 g/s
CLOUD_OP, CLOUD_EMB = 75 / 3600, 0.5e-2  # g: 75 J; 0.5 busy s x 1e-2 g/s


def test_each_carbon_view_follows_its_formula_on_a_hand_case():
    views = {v["view"]: v for v in carbon_views(HAND_WORK, **HAND)}
    expected = {  # (edge, cloud) CO2e g
        "attributional": (EDGE_OP + EDGE_EMB, CLOUD_OP + CLOUD_EMB),
        "consequential (seed paper)": (EDGE_OP, CLOUD_OP + CLOUD_EMB),  # edge embodied sunk, cloud's not
        "attributional, edge busy 20 % of its life": (EDGE_OP + EDGE_EMB / 0.2, CLOUD_OP + CLOUD_EMB / 0.8),
        "attributional, edge busy 80 % of its life": (EDGE_OP + EDGE_EMB / 0.8, CLOUD_OP + CLOUD_EMB / 0.8),
    }
    assert set(views) == set(expected) == {v.name for v in CARBON_VIEWS}
    for name, (edge, cloud) in expected.items():
        assert views[name]["edge CO2e g"] == pytest.approx(edge)
        assert views[name]["cloud CO2e g"] == pytest.approx(cloud)
        assert views[name]["edge / cloud"] == pytest.approx(edge / cloud)
        assert views[name]["cheaper"] == ("edge" if edge < cloud else "cloud")
        assert views[name]["assumption"]


def test_edge_breakdown_splits_energy_and_carbon_on_a_hand_case():
    parts = {r[EDGE_COLUMN]: r for r in edge_breakdown(HAND_WORK, **HAND)}
    assert list(parts) == list(EDGE_PARTS)
    joules = {"compute (useful work)": 50.0, "idle + wasted work (stragglers, failures, cuts)": 50.0,
              "radio (transfers)": 2.0, "charger losses": 102.0}
    for part, j in joules.items():
        assert parts[part]["energy kWh"] == pytest.approx(j / 3.6e6)
        assert parts[part]["CO2e g"] == pytest.approx(j / 3600)
    assert parts["embodied, while computing"]["CO2e g"] == pytest.approx(10e-3)
    assert parts["embodied, while transferring"]["CO2e g"] == pytest.approx(2e-3)
    assert sum(r["CO2e g"] for r in parts.values()) == pytest.approx(EDGE_OP + EDGE_EMB)
    assert sum(r["energy share"] for r in parts.values()) == pytest.approx(1.0)


def test_break_even_points_balance_the_two_sides():
    # edge CO2e = 204 J x g / 3.6e6 + 12e-3 (attributional) equals the cloud's at this grid intensity
    grid = solve(HAND_WORK, "edge_grid_g_per_kwh", **HAND)
    assert grid == pytest.approx((CLOUD_OP + CLOUD_EMB - EDGE_EMB) / (204 / 3.6e6))
    for knob, metric, ratio in (("cloud_tflops", "energy_kwh", 0.5), ("pue", "energy_kwh", 2.0),
                                ("cloud_utilisation", "co2_g", 2.0), ("lifetime_years", "co2_g", 0.5)):
        value = solve(WORK, knob, metric, ratio=ratio, cloud="cloud-a5000")
        options = {"cloud": "cloud-a5000"}
        if knob == "cloud_tflops":
            options["catalog"] = {**CAT, "cloud-a5000": dataclasses.replace(CAT["cloud-a5000"], tflops=value)}
        else:
            options[knob] = value
        edge, cloud = totals(WORK, **options)
        assert cloud[metric] == pytest.approx(ratio * edge[metric]), knob
    with pytest.raises(ValueError, match="knob: 'watts'"):
        solve(WORK, "watts")


def test_flip_table_and_headline_name_the_cloud_the_views_and_what_dominates():
    flips = {r["lever"].split(" (")[0]: r for r in flip_table(WORK, cloud="cloud-a5000")}
    energy = edge_vs_cloud(WORK, cloud="cloud-a5000")[-1]["energy_kwh"]
    assert flips["cloud sustained TFLOPS"]["break-even"] == f"{CAT['cloud-a5000'].tflops / energy:.3g}"
    assert "edge embodied share" in flips and "edge grid intensity, g/kWh" in flips
    text = headline(WORK, cloud="cloud-a5000")
    assert "Cloud reference: one cloud NVIDIA RTX A5000" in text and "`cloud-a5000`" in text
    assert "attributionally" in text and "consequentially" in text and "goes mostly to" in text
    section = edge_cloud_markdown(WORK, cloud="cloud-a5000")
    for title in ("### Carbon views", "### Where the edge's cost goes", "### What flips the verdict"):
        assert title in section


def test_unknown_cloud_lists_the_catalog_cloud_tiers():
    with pytest.raises(ValueError, match="its cloud tiers: cloud-a5000, cloud-a100, cloud-h100"):
        edge_vs_cloud(WORK, cloud="cloud-tpu")
    assert cloud_tiers(CAT) == ["cloud-a5000", "cloud-a100", "cloud-h100"]


def test_seed_paper_ratios_equal_a_hand_computation_from_the_catalog():
    res = seed_paper.results()
    flops = 6 * 125e6 * 100 * 16 * 512
    gpu = CAT["cloud-a5000"]
    cloud_s = flops / (gpu.tflops * 1e12)
    cloud_j = cloud_s * gpu.train_w * 1.2  # PUE 1.2
    cloud_g = cloud_j / 3.6e6 * GRID_G_PER_KWH[gpu.zone] + gpu.embodied_kg * 1e3 * cloud_s / (gpu.lifetime_years * YEAR_S)
    for tier in ("laptop", "phone"):
        d, dev = res["devices"][tier], CAT[tier]
        compute_s = flops / (dev.tflops * 1e12)
        radio_s = 500e6 * 8 / (dev.down_mbps * 1e6) + 500e6 * 8 / (dev.up_mbps * 1e6)  # fp32 model down and up
        edge_j = (compute_s * dev.train_w + radio_s * dev.radio_w) / 0.85
        edge_op = edge_j / 3.6e6 * GRID_G_PER_KWH[dev.zone]
        edge_emb = dev.embodied_kg * 1e3 * (compute_s + radio_s) / (dev.lifetime_years * YEAR_S)
        assert d["energy_advantage"] == pytest.approx(cloud_j / edge_j)
        assert d["carbon_advantage"]["consequential (seed paper)"] == pytest.approx(cloud_g / edge_op)
        assert d["carbon_advantage"]["attributional"] == pytest.approx(cloud_g / (edge_op + edge_emb))
        assert d["decomposition"][0][f"cloud / {tier}"] == pytest.approx(
            (gpu.train_w / gpu.tflops) / (dev.train_w / dev.tflops))
        # which side wins: the edge on energy and with its embodied carbon sunk, the cloud when it is charged
        assert d["energy_advantage"] > 1 and d["carbon_advantage"]["consequential (seed paper)"] > 1
        assert d["carbon_advantage"]["attributional"] < 1
        # the cloud throughput that would give the paper's lower bound (1.5x) does give it
        tflops = d["cloud_tflops_for_energy_range"][0]
        assert cloud_j * gpu.tflops / tflops / edge_j == pytest.approx(1.5)
    text = seed_paper.markdown(res)
    assert "laptop" in text and "cloud-a5000" in text and "in range" in text


def test_a_lever_without_a_crossing_says_which_side_wins_everywhere():
    # the seed paper's phone job: the edge's operational carbon alone is below the cloud's, so with its embodied
    # carbon sunk no cloud utilisation makes the cloud win
    flips = {r["lever"]: r["break-even"] for r in flip_table([seed_paper.work("phone")], cloud="cloud-a5000")}
    assert flips["cloud utilisation (consequential)"] == "always: the edge wins at any value"
    energy = solve([seed_paper.work("phone")], "cloud_tflops", "energy_kwh", cloud="cloud-a5000")
    assert flips["cloud sustained TFLOPS (energy; cloud-a5000)"] == f"{energy:.3g}"
