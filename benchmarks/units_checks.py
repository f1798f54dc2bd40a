"""What the server's Freivalds checks cost in a real units run on Flower, against the server's time per step.

    python benchmarks/units_checks.py [--steps 4] [--micro-batches 1 2 4] [--out benchmarks/results]

Runs ``python -m fedfusion run units units.steps=S units.micro_batches=M`` (recipes/units.yaml: the quickstart's
target, every linear layer offloaded, 8 simulated nodes of phones, laptops and desktops, Flower's simulation engine)
for each M, and reads each step's row of metrics.jsonl: ``verify_s`` (the CPU seconds of the server's checks,
measured by the engine), ``wall_s`` (the server's wall time for the step: planning, messages, waiting, checks, the
model's own compute and the optimizer) and ``virtual_s`` (the step as the recipe's devices would take it, from the
catalog's links and speeds, for devices that hold one message at a time: ``units.lanes: 1``, Flower's SuperNode).
Beside it, ``fedfusion plan``'s step for devices that hold two (``units.lanes=2``, the count's messages overlap; the
plan's virtual step is the run's, tests/test_units_flower.py). Writes ``units_checks.json`` and ``units_checks.md``
with the ratios per step.
The wall time on the simulation engine is mostly its message sweeps, so the virtual step is the stricter
denominator.
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


def run(steps: int, micro: int) -> list[dict]:
    """One units run at ``micro`` micro-batches: per step the checks' CPU seconds, the wall and virtual seconds (and
    the plan's virtual step on devices that hold two messages)."""
    r = load_recipe("units", [f"units.micro_batches={micro}", "units.lanes=2"])
    two_lanes = units_plan(r.units, r.train, r.population, r.model, r.report, r.data_source())[0]["step_s"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"micro{micro}"
        subprocess.run([sys.executable, "-m", "fedfusion.cli", "run", "units", f"units.steps={steps}",
                        f"units.micro_batches={micro}", "--out", str(out)], check=True, capture_output=True)
        rows = [r for r in read_jsonl(out / "metrics.jsonl") if r.get("verify_s") is not None]
    return [{"micro_batches": micro, "step": r["step"], "verify_s": r["verify_s"], "wall_s": r["wall_s"],
             "virtual_s": r["virtual_s"], "virtual_bound_s": r["virtual_bound_s"], "virtual_2_lanes_s": two_lanes,
             "train_loss": r["train_loss"]} for r in rows]


def markdown(data: dict) -> str:
    rows = data["rows"]
    lines = ["# units mode on Flower: the server's checks against its time per step", "",
             f"Machine: {data['machine']}; torch {data['torch']}; load average before {data['load_before']}.", "",
             f"Command: `{data['command']}`", "",
             "Each row one step of `fedfusion run units` (recipes/units.yaml, 8 simulated nodes, Flower's simulation "
             "engine). Checks: CPU seconds of the server's Freivalds checks (`verify_s`); wall: the server's wall "
             "seconds for the step; virtual: the step on the recipe's devices' links and speeds, devices holding one "
             "message at a time (`units.lanes: 1`, Flower's SuperNode), the server's links queued; step / bound: the "
             "virtual step over what no schedule of its messages beats under the timeline; 2 lanes: `fedfusion plan`'s "
             "step for devices that hold two.", "",
             "| micro-batches | step | train loss | checks (CPU s) | wall (s) | checks / wall | virtual (s) | "
             "step / bound | checks / virtual | virtual, 2 lanes (s) | checks / virtual, 2 lanes |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['micro_batches']} | {r['step']} | {r['train_loss']:.4f} | {r['verify_s']:.4f} | {r['wall_s']:.2f} | "
              f"{r['verify_s'] / r['wall_s']:.2%} | {r['virtual_s']:.2f} | {r['virtual_s'] / r['virtual_bound_s']:.2f} | "
              f"{r['verify_s'] / r['virtual_s']:.2%} | "
              f"{r['virtual_2_lanes_s']:.2f} | {r['verify_s'] / r['virtual_2_lanes_s']:.2%} |" for r in rows]
    lines += ["", "## Summary", ""]
    for micro in sorted({r["micro_batches"] for r in rows}):
        mine = [r for r in rows if r["micro_batches"] == micro]
        wall = [r["verify_s"] / r["wall_s"] for r in mine]
        virtual = [r["verify_s"] / r["virtual_s"] for r in mine]
        two = [r["verify_s"] / r["virtual_2_lanes_s"] for r in mine]
        lines.append(f"- {micro} micro-batch(es), {len(mine)} steps: checks {min(wall):.2%}-{max(wall):.2%} of the "
                     f"server's wall time, {min(virtual):.2%}-{max(virtual):.2%} of the virtual step "
                     f"({min(two):.2%}-{max(two):.2%} on devices holding two messages).")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    facts = run_facts("benchmarks/units_checks.py", argv)
    start = time.time()
    rows = [r for micro in args.micro_batches for r in run(args.steps, micro)]
    data = {**facts, "seconds": time.time() - start, "rows": rows}
    write_pair(args.out, "units_checks", data, markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
