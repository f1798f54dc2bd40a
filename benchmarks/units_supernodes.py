"""Several SuperNodes per device on Flower (``units.supernodes``): the step's virtual time, bytes and losses.

    python benchmarks/units_supernodes.py [--steps 3] [--settings 1x1 2x1 2x2 4x2 4x4] [--out benchmarks/results]

Each setting ``MxK`` runs ``python -m fedfusion run units units.steps=S units.micro_batches=M units.supernodes=K``
(recipes/units.yaml: the quickstart's target, every linear layer offloaded, 8 devices of phones, laptops and desktops,
K SuperNodes each on Flower's simulation engine; micro-batch c on each device's node c mod K) and reads each step's
row of metrics.jsonl: ``virtual_s`` (the step on the devices' catalog links and speeds, each SuperNode holding one
message at a time, the server's links queued) and ``virtual_bound_s`` (what no schedule of that step's messages
beats under the timeline), bytes down / up, ``wall_s`` and the training loss. Beside it ``fedfusion plan``'s step for
the same setting: its lower bound and busiest-link utilisation (the server's links included). Every setting trains
the same batches, so the losses must agree (float tolerance); the table gives the largest relative difference from
the first setting. Writes ``units_supernodes.json`` and ``units_supernodes.md``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_files import run_facts, write_pair  # noqa: E402

from fedfusion.analysis.report import read_jsonl  # noqa: E402
from fedfusion.analysis.units_plan import units_plan  # noqa: E402
from fedfusion.config.recipe import load_recipe  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse(setting: str) -> tuple[int, int]:
    """``"4x2"`` -> (4 micro-batches, 2 SuperNodes per device)."""
    micro, nodes = setting.lower().split("x")
    return int(micro), int(nodes)


def run(steps: int, micro: int, nodes: int) -> dict:
    """One units run: its per-step rows and the plan's step for the same setting."""
    overrides = [f"units.steps={steps}", f"units.micro_batches={micro}", f"units.supernodes={nodes}"]
    recipe = load_recipe("units", overrides)
    plan = units_plan(recipe.units, recipe.train, recipe.population, recipe.model, recipe.report, recipe.data_source())[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        subprocess.run([sys.executable, "-m", "fedfusion.cli", "run", "units", *overrides, "--out", str(out)],
                       check=True, capture_output=True)
        rows = [r for r in read_jsonl(out / "metrics.jsonl") if r["step"] > 0]
    return {"micro_batches": micro, "supernodes": nodes,
            "plan": {k: plan[k] for k in ("step_s", "lower_bound_s", "bound_by", "link_utilisation",
                                          "server_link_utilisation", "MB down", "MB up")},
            "steps": [{k: r[k] for k in ("step", "train_loss", "virtual_s", "virtual_bound_s", "bytes_down", "bytes_up",
                                         "wall_s", "redispatched", "server_fallback")} for r in rows]}


def spread(values: list[float], fmt: str = ".2f") -> str:
    lo, hi = min(values), max(values)
    return f"{lo:{fmt}}" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}}-{hi:{fmt}}"


def markdown(data: dict) -> str:
    runs = data["runs"]
    base = [s["train_loss"] for s in runs[0]["steps"]]
    lines = ["# units mode on Flower: several SuperNodes per device", "",
             f"Machine: {data['machine']}; torch {data['torch']}; load average before {data['load_before']}; "
             f"{data['seconds']:.0f} s in all.", "", f"Command: `{data['command']}`", "",
             "Each row one setting of `fedfusion run units` (recipes/units.yaml: 8 devices, every linear layer "
             "offloaded, Flower's simulation engine with devices x SuperNodes nodes; micro-batch c on each device's "
             "node c mod K, each node with its own weight blocks and running sums). Virtual: the run's step on the "
             "devices' catalog links and speeds, each SuperNode one message at a time, the server's links queued; step / "
             "bound: the run's steps' virtual step over its lower bound (the worst step). Lower bound and utilisation: "
             "`fedfusion plan`'s for the setting (no churn). Loss diff: the largest relative difference of a step's "
             "training loss from the first setting's (the same batches).", "",
             "| micro-batches | SuperNodes / device | virtual step (s) | plan step (s) | plan lower bound (s) | "
             "step / bound | busiest-link utilisation | MB down / step | MB up / step | wall / step (s) | loss diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        steps, p = r["steps"], r["plan"]
        virtual = [s["virtual_s"] for s in steps]
        diff = max(abs(s["train_loss"] - b) / abs(b) for s, b in zip(steps, base))
        lines.append(f"| {r['micro_batches']} | {r['supernodes']} | {spread(virtual)} | {p['step_s']:.2f} | "
                     f"{p['lower_bound_s']:.2f} | {max(s['virtual_s'] / s['virtual_bound_s'] for s in steps):.2f} | "
                     f"{p['link_utilisation']:.2f} | "
                     f"{spread([s['bytes_down'] / 1e6 for s in steps], '.1f')} | "
                     f"{spread([s['bytes_up'] / 1e6 for s in steps], '.1f')} | {spread([s['wall_s'] for s in steps])} | "
                     f"{diff:.1e} |")
    one = next((r for r in runs if r["micro_batches"] == 1 and r["supernodes"] == 1), None)
    if one is not None:
        ref = max(s["virtual_s"] for s in one["steps"])
        lines += ["", "## Summary", ""]
        for r in runs:
            if r is one:
                continue
            worst = max(s["virtual_s"] for s in r["steps"])
            lines.append(f"- {r['micro_batches']} micro-batches on {r['supernodes']} SuperNode(s) per device: step "
                         f"{worst:.2f} s, {worst / ref:.2f}x one micro-batch on one SuperNode ({ref:.2f} s); "
                         f"busiest link {r['plan']['link_utilisation']:.2f} busy.")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--settings", nargs="+", default=["1x1", "2x1", "2x2", "4x2", "4x4"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    facts = run_facts("benchmarks/units_supernodes.py", argv)
    start = time.time()
    runs = [run(args.steps, *parse(s)) for s in args.settings]
    data = {**facts, "seconds": time.time() - start, "runs": runs}
    write_pair(args.out, "units_supernodes", data, markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
