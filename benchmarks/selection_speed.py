"""How long selecting 100 clients from 100,000 candidates takes, per selector (the goal: under 50 ms).

A population of 100,000 virtual devices (catalog tiers phone/laptop/desktop 60/30/10, five grid zones),
each priced for one quickstart-sized round with ``price_work``; battery and power state from the
availability model. Every selector runs 30 rounds of select + feedback (so Oort's explored set grows);
we time ``select`` alone, and separately building the :class:`Candidates` view and one availability
query over all devices. Writes benchmarks/results/selection_speed.{json,md}.

    python benchmarks/selection_speed.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from fedfusion.devices.availability import AvailabilityModel
from fedfusion.devices.catalog import assign_tiers, load_catalog
from fedfusion.devices.energy import price_work
from fedfusion.selection.selectors import Candidates, Outcome, make_selector

N, K, ROUNDS, SEED = 100_000, 100, 30, 0
ZONES = ("USA", "DEU", "FRA", "IND", "SWE")
OUT = Path(__file__).parent / "results"


def machine() -> str:
    """CPU model, core count, load (other work on the machine slows the timings), Python and numpy versions."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", load average {:.1f}".format(os.getloadavg()[0]) if hasattr(os, "getloadavg") else ""
    return f"{model}, {os.cpu_count()} logical CPUs{load}, Python {platform.python_version()}, numpy {np.__version__}"


def timed(fn, *args) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn(*args)
    return (time.perf_counter() - start) * 1e3, result


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line, no options (tests/test_results_commands.py parses the results' commands with it)."""
    return argparse.ArgumentParser(description=__doc__.split("\n\n")[0])


def main() -> None:
    build_parser().parse_args()
    catalog = load_catalog()
    rng = np.random.default_rng(SEED)
    tiers = np.array(assign_tiers({"phone": 0.6, "laptop": 0.3, "desktop": 0.1}, N, SEED))
    zones = rng.choice(ZONES, N)
    avail = AvailabilityModel.for_tiers(list(tiers), catalog, seed=SEED, zones=list(zones))
    avail_ms, state = timed(avail.state, 1, 3 * 3600.0)
    groups = np.char.add(np.char.add(tiers.astype(str), "@"), zones.astype(str))
    costs = {g: price_work(catalog[g.split("@")[0]], 6 * 300_000 * 40 * 16 * 64, 1_200_000, 1_200_000,
                           zone=g.split("@")[1]) for g in np.unique(groups)}
    build_ms, cand = timed(lambda: Candidates.from_costs(np.arange(N), groups, costs, battery=state.battery,
                                                         plugged=state.plugged, zone=zones))
    per_zone = float(np.median(cand.energy_j)) * 40  # each zone affords ~40 median clients per round
    options = {"carbon_budget": {"budgets_j": {z: per_zone for z in ZONES}}}
    utility = rng.uniform(1, 100, N)
    results = {}
    for name in ("random", "oort", "energy", "carbon_budget"):
        sel = make_selector(name, seed=SEED, **options.get(name, {}))
        times = []
        for r in range(1, ROUNDS + 1):
            ms, picks = timed(sel.select, cand, K, r)
            times.append(ms)
            sel.feedback(r, [Outcome(c, "ok", utility=float(utility[c]), duration_s=float(cand.duration_s[c]),
                                     energy_j=float(cand.energy_j[c])) for c in picks])
        results[name] = {"median_ms": statistics.median(times), "p95_ms": float(np.percentile(times, 95)),
                         "max_ms": max(times), "picked_last_round": len(picks)}
    report = {"command": "python benchmarks/selection_speed.py", "machine": machine(), "candidates": N, "k": K, "rounds": ROUNDS,
              "candidates_build_ms": build_ms, "availability_state_ms": avail_ms, "selectors": results}
    OUT.mkdir(exist_ok=True)
    (OUT / "selection_speed.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# Selecting {K} of {N:,} candidates",
        "",
        f"Machine: {report['machine']}. {ROUNDS} rounds of select + feedback per selector; `select` timed alone.",
        "",
        f"Command: `{report['command']}`",
        "",
        "| selector | median ms | p95 ms | max ms | picked |",
        "|---|---|---|---|---|",
        *[f"| {n} | {v['median_ms']:.1f} | {v['p95_ms']:.1f} | {v['max_ms']:.1f} | {v['picked_last_round']} |"
          for n, v in results.items()],
        "",
        f"Building the Candidates view of {N:,} devices: {build_ms:.1f} ms; one availability query over all of "
        f"them: {avail_ms:.1f} ms.",
        "",
    ]
    (OUT / "selection_speed.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
