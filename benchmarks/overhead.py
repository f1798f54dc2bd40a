"""Flower's overhead on a run: each round's wall time against the ideal of its clients' own training.

The ideal round is the clients' training (``train_s`` in clients.jsonl) packed onto the cores the simulation gave
them: ``max(longest client, sum of clients / cores)``, cores = how many clients run at once (the machine's CPUs
over ``engine.cpus_per_client``, at most the clients of the round). The ratio is the round's ``wall_s`` over it.
Each round's wall time is split into that ideal, the server's central evaluation (``eval_s``), the fold
(``aggregate_s``) and the rest: Flower's message handling, serialisation, Ray scheduling, the clients' own model
building and data loading, and the training the packing could not overlap.

    python benchmarks/overhead.py [RECIPE] [key=value ...] [--out benchmarks/results]

writes ``overhead.{json,md}``; the JSON's ``ratio_from_round_2`` is the headline (round 1 carries Ray's start-up).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def round_table(run: Path, cores_total: int) -> list[dict]:
    """Per round (1..): wall, ideal, ratio and the split of the wall time."""
    from fedfusion.config.recipe import load_recipe

    recipe_cpus = load_recipe(str(run / "recipe.yaml")).engine.cpus_per_client
    clients = _rows(run / "clients.jsonl")
    table = []
    for row in _rows(run / "metrics.jsonl"):
        if row["round"] == 0:
            continue
        trained = [c["train_s"] for c in clients if c["round"] == row["round"] and c.get("train_s")]
        slots = max(1, min(len(trained) or 1, int(cores_total / recipe_cpus)))
        ideal = max(max(trained, default=0.0), sum(trained) / slots)
        wall, eval_s, agg = row["wall_s"], row.get("eval_s", 0.0), row.get("aggregate_s", 0.0)
        table.append({"round": row["round"], "clients": len(trained), "slots": slots, "wall_s": wall,
                      "ideal_s": ideal, "eval_s": eval_s, "aggregate_s": agg,
                      "rest_s": wall - ideal - eval_s - agg, "ratio": wall / ideal if ideal else None})
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", nargs="?", default="quickstart")
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "fedfusion", "run", args.recipe, *args.overrides, "--out", str(run)]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        command_s = time.perf_counter() - start
        summary = json.loads((run / "summary.json").read_text())
        cores = os.cpu_count() or 1
        table = round_table(run, cores)
        first = _rows(run / "metrics.jsonl")[0]
    later = [r for r in table if r["round"] >= 2]
    ratio2 = sum(r["wall_s"] for r in later) / sum(r["ideal_s"] for r in later) if later else None
    result = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": cores,
                    "load_avg_at_end": os.getloadavg()},
        "command": " ".join(["python -m fedfusion run", args.recipe, *args.overrides]),
        "ratio_from_round_2": ratio2,
        "command_s": command_s, "run_wall_s": summary.get("wall_s"),
        "before_round_0_s": command_s - (summary.get("wall_s") or 0.0),
        "round_0_eval_s": first.get("eval_s"),
        "rounds": table,
        "totals_from_round_2": {k: sum(r[k] for r in later) for k in ("wall_s", "ideal_s", "eval_s", "aggregate_s",
                                                                     "rest_s")},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_text(json.dumps(result, indent=2))
    t = result["totals_from_round_2"]
    lines = [
        "# Flower overhead: round wall time against the clients' own training", "",
        f"Command: `{result['command']}` (`python benchmarks/overhead.py`); machine: {result['machine']['platform']}, "
        f"{cores} CPUs, Python {result['machine']['python']}, load average at the end "
        f"{', '.join(f'{x:.2f}' for x in result['machine']['load_avg_at_end'])}.", "",
        f"**Rounds 2+: wall / ideal = {ratio2:.2f}x** (goal 1.10x). Of their {t['wall_s']:.1f} s: ideal training "
        f"{t['ideal_s']:.1f} s, central evaluation {t['eval_s']:.1f} s, fold {t['aggregate_s']:.2f} s, the rest "
        f"(Flower messaging, Ray scheduling, clients building models and loading data) {t['rest_s']:.1f} s.", "",
        f"Whole command {command_s:.1f} s; before the run's clock starts (imports, recipe, target, Ray start-up is "
        f"inside round 1) {result['before_round_0_s']:.1f} s.", "",
        "| round | clients | parallel slots | wall s | ideal s | eval s | fold s | rest s | wall / ideal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['round']} | {r['clients']} | {r['slots']} | {r['wall_s']:.2f} | {r['ideal_s']:.2f} | "
              f"{r['eval_s']:.2f} | {r['aggregate_s']:.3f} | {r['rest_s']:.2f} | "
              f"{r['ratio']:.2f} |" if r["ratio"] else f"| {r['round']} | 0 | | {r['wall_s']:.2f} | | | | | |"
              for r in table]
    lines += ["", "Ideal: the round's clients' `train_s` packed onto the parallel slots "
              "(max of the longest client and the sum over the slots).", "",
              "## What is left above the ideal, and why", "",
              f"- Central evaluation, {t['eval_s'] / t['ideal_s']:.2f}x of the ideal: the target is scored on the "
              "pooled held-out text after every round, while the clients wait (Flower's `evaluate_fn` runs between "
              "rounds). It is kept every round because every metrics row, the best-round report and the plots carry "
              "the target's score; a run that wants less of it caps the text with `data.eval_chars`.",
              f"- The rest, {t['rest_s'] / t['ideal_s']:.2f}x: Flower's simulation engine hands queued messages to "
              "its workers by sweeping its nodes, not in the order the strategy sent them, so the ideal's perfect "
              "packing of unequal clients (phones 1/8, desktops 1/2 of the target) onto the slots is not reached; "
              "plus each message's serialisation and the clients' model building.",
              f"- The fold, {t['aggregate_s'] / t['ideal_s']:.2f}x: the selective average of the round's slices."]
    (args.out / "overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
