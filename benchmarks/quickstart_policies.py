"""Benchmark: slicing policies on the quickstart recipe (small-to-large: every client <= 1/2 of the target).

Runs the real CLI (Flower simulation engine) once per (arm, seed) and writes
``benchmarks/results/quickstart_policies.{json,md}`` with the machine and settings.

    python benchmarks/quickstart_policies.py --seeds 0 1 2 [--reuse] [extra key=value overrides]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from fedfusion.config.recipe import load_recipe

ARMS = {  # id -> (label, overrides)
    "static": ("static (HeteroFL prefix)", ["fusion.policy=static"]),
    "rolling-shared": ("rolling, shared start (FedRolex)", ["fusion.policy=rolling", "fusion.stagger=false"]),
    "rolling-staggered": ("rolling, staggered (fedfusion default)", ["fusion.policy=rolling", "fusion.stagger=true"]),
    "random": ("random (Federated Dropout)", ["fusion.policy=random"]),
}
RESULTS = Path(__file__).resolve().parent / "results"


def run_arm(overrides: list[str], out: Path, reuse: bool) -> dict:
    """One CLI run (or, with ``reuse``, the finished run already in ``out``); returns its summary.json."""
    summary_path = out / "summary.json"
    if not (reuse and summary_path.is_file() and json.loads(summary_path.read_text()).get("status") == "ok"):
        cmd = [sys.executable, "-m", "fedfusion.cli", "run", "quickstart", *overrides, "--out", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(summary_path.read_text())


def last_rounds_ppl(out: Path, n: int = 3) -> float:
    """Mean held-out perplexity of the last ``n`` rounds: the final round alone is noisy for unstable arms."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return statistics.mean(r["eval_ppl"] for r in rows[-n:])


def _mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--work", default="runs/bench-policies")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs found in --work")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    rows = []
    for arm, (_, arm_overrides) in ARMS.items():
        for seed in args.seeds:
            out = Path(args.work) / f"{arm}-s{seed}"
            summary = run_arm([*arm_overrides, f"seed={seed}", *args.overrides], out, args.reuse)
            rows.append({"arm": arm, "seed": seed, **summary["final"], "initial_ppl": summary["initial"]["eval_ppl"],
                         "last3_ppl": last_rounds_ppl(out), "wall_s": summary["wall_s"],
                         "energy_j": summary.get("energy_j"), "run_dir": str(out)})
            print(f"{arm} seed {seed}: ppl {summary['final']['eval_ppl']:.3f}", flush=True)
    per_seed = {arm: {r["seed"]: round(r["eval_ppl"], 3) for r in rows if r["arm"] == arm} for arm in ARMS}
    report = {
        "benchmark": "quickstart_policies",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {"recipe": "quickstart", "overrides": args.overrides, "seeds": args.seeds},
        "runs": rows,
        "final_ppl_by_seed": per_seed,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "quickstart_policies.json").write_text(json.dumps(report, indent=2))
    recipe = load_recipe("quickstart", args.overrides)
    lines = [
        "# Slicing policies on the quickstart (small-to-large)", "",
        f"Machine: {report['machine']['platform']}, {report['machine']['cpus']} CPUs. Recipe: quickstart "
        f"{' '.join(args.overrides)}: {recipe.rounds} rounds x {recipe.train.local_steps} local steps, "
        f"{recipe.selection.clients_per_round} of {recipe.population.num_clients} clients per round, widths "
        f"{dict(recipe.fusion.widths)}, target {recipe.model.hidden_size} hidden x {recipe.model.num_layers} layers; "
        f"seeds {args.seeds}. The target is evaluated at full width on pooled held-out text.", "",
        "| arm | final ppl (mean ± std) | last-3-rounds ppl (mean ± std) | final next-char acc | run wall s |",
        "|---|---|---|---|---|",
    ]
    for arm, (label, _) in ARMS.items():
        mine = [r for r in rows if r["arm"] == arm]
        ppl, last3 = [r["eval_ppl"] for r in mine], [r["last3_ppl"] for r in mine]
        acc = [r["eval_acc"] for r in mine]
        lines.append(f"| {label} | {_mean_sd(ppl)} | {_mean_sd(last3)} | {statistics.mean(acc):.4f} | "
                     f"{statistics.mean(r['wall_s'] for r in mine):.0f} |")
    lines += ["", "Final perplexity per seed: " + "; ".join(
        f"{arm}: " + ", ".join(f"s{s}={v}" for s, v in seeds.items()) for arm, seeds in per_seed.items()),
        "", f"Round-0 perplexity (seed {rows[0]['seed']}): {rows[0]['initial_ppl']:.2f}.", ""]
    (RESULTS / "quickstart_policies.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
