"""Links emulated for real (``units.shape_links``): the units recipe on Flower's simulation engine with every device's
links shaped to a catalog tier's, the measured step against the timeline's prediction for the same links.

    python benchmarks/units_links.py [--steps 2] [--tiers phone phone-lowend] [--scales 1 0.1 0.05]
                                     [--deploy] [--name units_links] [--out benchmarks/results]

Per tier (all 8 devices of recipes/units.yaml that tier: ``population.mix={TIER: 1.0}``) one run with the links as
they are (loopback: what Flower, this machine's compute and the server cost a step without links) and per link scale
one run ``python -m fedfusion.cli run units units.steps=S population.mix={TIER: 1.0} units.shape_links=true
units.link_scale=X``: the transport pushes each message when the device's downlink (the tier's catalog rate times X,
half the 50 ms RTT) has delivered it and accepts each reply when its uplink has (``fedfusion.units.shaper``). Per
step, from metrics.jsonl: ``train_s`` (measured: the step's phases through Flower, the server's own compute and the
optimizer) against ``virtual_s`` (the timeline's step for the same devices, links and server), the transport's
wait (``transport_s``), re-dispatches and missed deadlines. The measured step minus the unshaped run's is what the
shaped links added; beside it the timeline's step. The 1-minute load average is taken before each run. Writes
``NAME.json`` and ``NAME.md``.

``--deploy`` runs each through ``fedfusion deploy`` instead (a loopback SuperLink and one SuperNode per device over
TLS, from the source tree: the same transport and shaper on a real Grid), with ``units.deadline_floor_s=120``: a
deployed SuperNode starts a fresh ClientApp process for every message, which the default 2 s floor would count as
missed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_files import run_facts, write_pair  # noqa: E402

from fedfusion.analysis.report import read_jsonl  # noqa: E402
from fedfusion.config.recipe import load_recipe  # noqa: E402
from fedfusion.devices.catalog import population_catalog  # noqa: E402
from fedfusion.units.devices import from_catalog  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
STEP_KEYS = ("step", "train_loss", "train_s", "virtual_s", "virtual_bound_s", "transport_s", "phases", "messages",
             "bytes_down", "bytes_up", "redispatched", "missed")


def overrides(steps: int, tier: str, scale: float | None) -> list[str]:
    """The run's overrides: ``scale`` None runs the links as they are."""
    shaped = [] if scale is None else ["units.shape_links=true", f"units.link_scale={scale:g}"]
    return [f"units.steps={steps}", f"population.mix={{{tier}: 1.0}}", *shaped]


DEPLOYED = ["units.deadline_floor_s=120"]  # a fresh ClientApp process per message on a deployed SuperNode


def run(steps: int, tier: str, scale: float | None, deployed: bool = False) -> dict:
    """One ``fedfusion run units`` (or ``fedfusion deploy units``): its per-step rows, the links it shaped and the
    load before it."""
    args = overrides(steps, tier, scale) + (DEPLOYED if deployed else [])
    device = from_catalog(population_catalog(load_recipe("units", args).population)[tier], link_scale=scale or 1.0)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        how = ["deploy", "units", *args, "--out", str(out), "--workdir", str(Path(tmp) / "deploy")] if deployed else [
            "run", "units", *args, "--out", str(out)]
        done = subprocess.run([sys.executable, "-m", "fedfusion.cli", *how], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1])  # deploy bundles the source tree's app
        if done.returncode != 0:
            raise SystemExit(f"fedfusion {' '.join(how[:2])} failed ({done.returncode}):\n{done.stdout[-3000:]}"
                             f"{done.stderr[-3000:]}")
        rows = [r for r in read_jsonl(out / "metrics.jsonl") if r["step"] > 0]
    return {"tier": tier, "scale": scale, "overrides": args, "deployed": deployed, "load_1min": load,
            "link": {"down_MBps": device.down_bps / 1e6, "up_MBps": device.up_bps / 1e6, "rtt_s": device.rtt_s},
            "steps": [{k: r[k] for k in STEP_KEYS} for r in rows]}


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def markdown(data: dict) -> str:
    floors = {r["tier"]: mean([s["train_s"] for s in r["steps"]]) for r in data["runs"] if r["scale"] is None}
    deployed = any(r.get("deployed") for r in data["runs"])
    engine = ("`fedfusion deploy` (a loopback SuperLink with TLS and one SuperNode per device, each message a fresh "
              "ClientApp process; `units.deadline_floor_s=120`)" if deployed else "Flower's simulation engine")
    lines = ["# units mode with its links emulated for real: measured step against the timeline", "",
             f"Machine: {data['machine']}; torch {data['torch']}; load average before {data['load_before']}; "
             f"{data['seconds']:.0f} s in all.", "", f"Command: `{data['command']}`", "",
             "recipes/units.yaml (the quickstart target, every linear layer offloaded, one micro-batch) on "
             f"{engine}, all 8 devices one catalog tier. Shaped: `units.shape_links=true "
             "units.link_scale=X`, each message pushed when the device's downlink has delivered it and each reply "
             "accepted when its uplink has (the tier's catalog rates times X, RTT 50 ms; the server's 10 Gb/s links "
             "queued too). Unshaped: loopback as it is. Measured: the step's `train_s` (every phase through Flower, "
             "the server's own compute, the optimizer); predicted: the run's `virtual_s` (the timeline on the same "
             "devices, links and server, the server's compute priced on its catalog tier). Per setting the mean "
             "over the run's steps; load: the 1-minute load average before the run. Links added: the measured step "
             "less the unshaped run's.", "",
             "| tier | link scale | down / up MB/s | load | measured step (s) | predicted step (s) | "
             "measured / predicted | measured - predicted (s) | links added (s) | links added / predicted | "
             "transport wait (s) | re-dispatched | missed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["runs"]:
        steps, link, tier = r["steps"], r["link"], r["tier"]
        measured, predicted = mean([s["train_s"] for s in steps]), mean([s["virtual_s"] for s in steps])
        tail = (f"{mean([s['transport_s'] for s in steps]):.2f} | {sum(s['redispatched'] for s in steps)} | "
                f"{sum(len(s['missed']) for s in steps)} |")
        if r["scale"] is None:
            lines.append(f"| {tier} | unshaped | loopback | {r['load_1min']:.2f} | {measured:.2f} | - | - | - | - | - | "
                         f"{tail}")
            continue
        added = measured - floors[tier]
        lines.append(f"| {tier} | {r['scale']:g} | {link['down_MBps']:.3g} / {link['up_MBps']:.3g} | "
                     f"{r['load_1min']:.2f} | {measured:.2f} | {predicted:.2f} | {measured / predicted:.3f} | "
                     f"{measured - predicted:.2f} | {added:.2f} | {added / predicted:.3f} | {tail}")
    lines += ["", "## Per step", "", "| tier | link scale | step | measured (s) | predicted (s) | transport wait (s) | "
              "phases | MB down | MB up | train loss |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["runs"]:
        scale = "unshaped" if r["scale"] is None else f"{r['scale']:g}"
        for s in r["steps"]:
            lines.append(f"| {r['tier']} | {scale} | {s['step']} | {s['train_s']:.2f} | {s['virtual_s']:.2f} | "
                         f"{s['transport_s']:.2f} | {s['phases']} | {s['bytes_down'] / 1e6:.1f} | "
                         f"{s['bytes_up'] / 1e6:.1f} | {s['train_loss']:.4f} |")
    return "\n".join(lines + summary(data["runs"], floors)) + "\n"


def summary(runs: list[dict], floors: dict[str, float]) -> list[str]:
    """The settings within 15 % of the prediction, what the measured step adds to it, and what the links added."""
    shaped = [r for r in runs if r["scale"] is not None]
    measured = {id(r): mean([s["train_s"] for s in r["steps"]]) for r in shaped}
    predicted = {id(r): mean([s["virtual_s"] for s in r["steps"]]) for r in shaped}
    ratio = {id(r): measured[id(r)] / predicted[id(r)] for r in shaped}
    within = [f"{r['tier']} x {r['scale']:g} ({ratio[id(r)]:.3f})" for r in shaped if ratio[id(r)] <= 1.15]
    outside = [f"{r['tier']} x {r['scale']:g} ({ratio[id(r)]:.3f})" for r in shaped if ratio[id(r)] > 1.15]
    over = [measured[id(r)] - predicted[id(r)] for r in shaped]
    added = [(measured[id(r)] - floors[r["tier"]]) / predicted[id(r)] for r in shaped]
    return ["", "## Summary", "",
            f"- Measured step within 15 % of the prediction: {', '.join(within) or 'none'}; outside: "
            f"{', '.join(outside) or 'none'}.",
            f"- Measured less predicted: {min(over):.2f}-{max(over):.2f} s a step at every link setting; the unshaped "
            f"step: {min(floors.values()):.2f}-{max(floors.values()):.2f} s.",
            f"- The links added (measured less the unshaped step) {min(added):.3f}-{max(added):.3f} of the predicted "
            "step."]


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tiers", nargs="+", default=["phone", "phone-lowend"])
    parser.add_argument("--scales", nargs="+", type=float, default=[1.0, 0.1, 0.05])
    parser.add_argument("--deploy", action="store_true", help="through `fedfusion deploy` instead of the simulation")
    parser.add_argument("--name", default="units_links", help="the results files' name")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    facts = run_facts("benchmarks/units_links.py", argv)
    start = time.time()
    runs = [run(args.steps, tier, scale, args.deploy) for tier in args.tiers for scale in (None, *args.scales)]
    data = {**facts, "seconds": time.time() - start, "runs": runs}
    write_pair(args.out, args.name, data, markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
