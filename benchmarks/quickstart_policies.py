"""Benchmark: slicing policies on a recipe (default the quickstart; small-to-large: every client <= 1/2 of the
target), and the recipe's target against the small model the same devices could train together.

Runs the real CLI (Flower simulation engine) once per (arm, seed) and writes
``benchmarks/results/<out>.{json,md}`` with the machine and settings. Every arm has the recipe's budget (its
rounds, clients per round, local steps, optimizer and data); only ``fusion.*`` differs:

- the policies in their own small forward pass (``static``, ``rolling-shared``, ``rolling-staggered``: the policy of
  ``recipes/rolling.yaml``, ``random``);
- ``smallest-only``: every round trains the smallest width's static slice inside a target silenced around it
  (``fusion.grow_round`` = the recipe's rounds), so the scored target *is* the model every device can hold;
- ``grow-core``: smallest-only for the first third of the rounds, then full-forward windows around the small model's
  units (``fusion.forward=full fusion.window_core=true``): on the quickstart, the recipe as it ships;
- ``grow-core-fixed``: as ``grow-core``, each window drawn from the units outside the core
  (``fusion.window_outside_core=true``), so core + window has one size every round (a device program's shape);
- ``grow-small``: as ``grow-core``, the core trained in the small model's own forward pass
  (``fusion.core_forward=small``): the core takes exactly smallest-only's steps, the rest learns what the target adds;
- ``oracle``: every client trains the whole target (width 1.0 for every tier; no device of the recipe holds it).

Every arm names all the fusion settings it differs in (``--recipe rolling`` gives the old quickstart's devices).
Every run's per-round perplexities are kept; with smallest-only beside them the grow arms are checked round by
round (equal to smallest-only up to growth, and which rounds after it end worse).

    python benchmarks/quickstart_policies.py --seeds 0 1 2 [--reuse] [extra key=value overrides]
    python benchmarks/quickstart_policies.py --arms smallest-only rolling-staggered grow-core oracle --seeds 0 1 2 \
        --work runs/bench-default --out quickstart_default --reuse
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from fedfusion.config.recipe import load_recipe

# every arm names all the fusion settings it differs in, so that its meaning does not depend on the base recipe
SLICES = ["fusion.grow_round=0", "fusion.forward=slice", "fusion.window_core=false", "fusion.window_shared=false"]
GROW = ["fusion.policy=rolling", "fusion.stagger=false", "fusion.grow_round={third}", "fusion.forward=full",
        "fusion.window_core=true", "fusion.window_shared=true"]
ARMS = {  # id -> (label, overrides)
    "static": ("static (HeteroFL prefix)", [*SLICES, "fusion.policy=static"]),
    "rolling-shared": ("rolling, shared start (FedRolex)", [*SLICES, "fusion.policy=rolling", "fusion.stagger=false"]),
    "rolling-staggered": ("rolling, staggered (the policy of recipes/rolling.yaml)",
                          [*SLICES, "fusion.policy=rolling", "fusion.stagger=true"]),
    "random": ("random (Federated Dropout)", [*SLICES, "fusion.policy=random"]),
    "smallest-only": ("smallest-only (the 1/8 model every device holds)",
                      ["fusion.policy=static", "fusion.grow_round={rounds}", "fusion.forward=slice",
                       "fusion.window_core=false", "fusion.window_shared=false"]),
    "grow-core": ("grow after a third, then core windows", [*GROW, "fusion.core_forward=full",
                                                             "fusion.window_outside_core=false"]),
    "grow-core-fixed": ("grow after a third, then core windows of one size (each window drawn outside the core)",
                        [*GROW, "fusion.core_forward=full", "fusion.window_outside_core=true"]),
    "grow-small": ("grow after a third, then core windows, the core in its own forward pass",
                   [*GROW, "fusion.core_forward=small", "fusion.window_outside_core=false"]),
    "oracle": ("oracle (every client trains the whole target)", [*SLICES, "fusion.policy=static", "fusion.widths.phone=1.0",
                                                                "fusion.widths.laptop=1.0", "fusion.widths.desktop=1.0"]),
}
POLICIES = ["static", "rolling-shared", "rolling-staggered", "random"]
RESULTS = Path(__file__).resolve().parent / "results"


def run_arm(recipe: str, overrides: list[str], out: Path, reuse: bool) -> dict:
    """One CLI run (or, with ``reuse``, the finished run already in ``out``); returns its summary.json."""
    summary_path = out / "summary.json"
    if not (reuse and summary_path.is_file() and json.loads(summary_path.read_text()).get("status") == "ok"):
        cmd = [sys.executable, "-m", "fedfusion.cli", "run", recipe, *overrides, "--out", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(summary_path.read_text())


def round_ppl(out: Path) -> dict[int, float]:
    """Held-out perplexity after each scored round (round 0: before training)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["round"]: r["eval_ppl"] for r in rows if "eval_ppl" in r}


def last_over_best(rounds: dict[int, float]) -> float:
    """The last scored round's perplexity over the best (lowest) of rounds 1.. minus 1 (the goal: <= 2 %)."""
    trained = {k: v for k, v in rounds.items() if k >= 1}
    return trained[max(trained)] / min(trained.values()) - 1


def rounds_against_smallest(rows: list[dict], arms: list[str], grow: int) -> list[str]:
    """Round by round against smallest-only of the same seed, for the arms that grow: up to the growth round they
    must equal it (the target *is* the small model then), after it say which rounds end worse (higher perplexity)."""
    small = {r["seed"]: r["rounds"] for r in rows if r["arm"] == "smallest-only"}
    lines = []
    for arm in (a for a in arms if a.startswith("grow")):
        for r in (r for r in rows if r["arm"] == arm and r["seed"] in small):
            ref, mine = small[r["seed"]], r["rounds"]
            before = max((abs(mine[k] - ref[k]) for k in mine if k <= grow and k in ref), default=float("nan"))
            worse = [f"{k} (+{mine[k] - ref[k]:.3f})" for k in sorted(mine) if k > grow and k in ref and mine[k] > ref[k]]
            lines.append(f"- {arm} seed {r['seed']}: rounds 0-{grow} differ from smallest-only by at most {before:.2e} "
                         f"in perplexity; after growth, rounds worse than smallest-only: {', '.join(worse) or 'none'}")
    if lines:
        lines = [f"Round by round against smallest-only (growth after round {grow}):", "", *lines, ""]
    return lines


def against_smallest(rows: list[dict], arms: list[str]) -> list[str]:
    """Per seed, each arm's final log-perplexity (nats/char) minus smallest-only's (negative: better than the small
    model), and the gap closure (smallest - arm) / (smallest - oracle) in nats where the oracle ran and beat it."""
    if "smallest-only" not in arms:
        return []
    nats = {(r["arm"], r["seed"]): math.log(r["eval_ppl"]) for r in rows}
    lines = ["Against smallest-only, per seed (final nats/char, arm minus smallest-only; gap closure where the oracle "
             "ran and ends below smallest-only):", ""]
    for arm in (a for a in arms if a != "smallest-only"):
        parts = []
        for seed in sorted({s for a, s in nats if a == arm}):
            small, mine, oracle = nats.get(("smallest-only", seed)), nats[(arm, seed)], nats.get(("oracle", seed))
            if small is None:
                continue
            gap = f", closure {(small - mine) / (small - oracle):.2f}" if oracle is not None and oracle < small else ""
            parts.append(f"s{seed} {mine - small:+.3f}{gap}")
        lines.append(f"- {arm}: " + "; ".join(parts))
    return [*lines, "", *oracle_verdict(nats)]


def oracle_verdict(nats: dict[tuple[str, int], float]) -> list[str]:
    """A sentence on the budget, where the oracle ran: where every client training the whole target does not end below
    smallest-only, the target's extra capacity does not pay at this budget even when trained whole."""
    seeds = sorted(s for a, s in nats if a == "oracle" and ("smallest-only", s) in nats)
    if not seeds:
        return []
    behind = [s for s in seeds if nats[("oracle", s)] >= nats[("smallest-only", s)]]
    if not behind:
        return [f"The oracle ends below smallest-only in every seed run ({len(seeds)}): the budget lets the whole "
                "target beat the small model.", ""]
    return [f"**The whole target does not beat the small model here**: the oracle (every client trains the whole target) "
            f"ends at or above smallest-only in {len(behind)} of {len(seeds)} seeds (seeds {', '.join(map(str, behind))}): "
            "at this budget the target's extra capacity does not pay even when every client trains all of it, so no "
            "way of folding the devices' work into it can be expected to beat the small model (a longer budget, or a "
            "task the small model cannot hold, is needed first).", ""]


def _mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recipe", default="quickstart", help="the base recipe every arm overrides")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--work", default="runs/bench-policies")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs found in --work")
    parser.add_argument("--arms", nargs="+", default=POLICIES, choices=list(ARMS))
    parser.add_argument("--out", default="quickstart_policies", help="results file name under benchmarks/results/")
    parser.add_argument("overrides", nargs="*")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    rounds = load_recipe(args.recipe, args.overrides).rounds
    rows = []
    for arm in args.arms:
        arm_overrides = [o.format(rounds=rounds, third=rounds // 3) for o in ARMS[arm][1]]
        for seed in args.seeds:
            out = Path(args.work) / f"{arm}-s{seed}"
            summary = run_arm(args.recipe, [*arm_overrides, f"seed={seed}", *args.overrides], out, args.reuse)
            scored = round_ppl(out)
            rows.append({"arm": arm, "seed": seed, **summary["final"], "initial_ppl": summary["initial"]["eval_ppl"],
                         "last3_ppl": statistics.mean(v for _, v in sorted(scored.items())[-3:]),
                         "rounds": scored, "wall_s": summary["wall_s"],
                         "energy_j": summary.get("energy_j"), "run_dir": str(out)})
            print(f"{arm} seed {seed}: ppl {summary['final']['eval_ppl']:.3f}", flush=True)
    per_seed = {arm: {r["seed"]: round(r["eval_ppl"], 3) for r in rows if r["arm"] == arm} for arm in args.arms}
    report = {
        "command": shlex.join(["python", "benchmarks/quickstart_policies.py", *sys.argv[1:]]),
        "benchmark": args.out,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_1min_at_end": round(os.getloadavg()[0], 2)},
        "settings": {"recipe": args.recipe, "overrides": args.overrides, "seeds": args.seeds, "arms": args.arms,
                     "arm_overrides": {a: [o.format(rounds=rounds, third=rounds // 3) for o in ARMS[a][1]]
                                       for a in args.arms}},
        "runs": rows,
        "final_ppl_by_seed": per_seed,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(report, indent=2))
    recipe = load_recipe(args.recipe, args.overrides)
    lines = [
        f"# Slicing policies on {args.recipe} (small-to-large)" if args.arms == POLICIES else
        f"# The {args.recipe} recipe's target against the small model every device holds (equal budget)", "",
        f"Machine: {report['machine']['platform']}, {report['machine']['cpus']} CPUs (1-minute load at the end "
        f"{report['machine']['load_1min_at_end']}; the perplexities do not depend on it). Recipe: {args.recipe} "
        f"{' '.join(args.overrides)}: {recipe.rounds} rounds x {recipe.train.local_steps} local steps, "
        f"{recipe.selection.clients_per_round} of {recipe.population.num_clients} clients per round, widths "
        f"{dict(recipe.fusion.widths)}, target {recipe.model.hidden_size} hidden x {recipe.model.num_layers} layers; "
        f"seeds {args.seeds}. The target is evaluated at full width on pooled held-out text.", "",
        f"Command: `{report['command']}`", "",
        "| arm | final ppl (mean ± std) | last-3-rounds ppl (mean ± std) | final next-char acc | last / best round - 1 "
        "(worst seed) | run wall s |",
        "|---|---|---|---|---|---|",
    ]
    for arm in args.arms:
        label, mine = ARMS[arm][0], [r for r in rows if r["arm"] == arm]
        ppl, last3 = [r["eval_ppl"] for r in mine], [r["last3_ppl"] for r in mine]
        acc = [r["eval_acc"] for r in mine]
        lines.append(f"| {label} | {_mean_sd(ppl)} | {_mean_sd(last3)} | {statistics.mean(acc):.4f} | "
                     f"{max(last_over_best(r['rounds']) for r in mine):+.2%} | "
                     f"{statistics.mean(r['wall_s'] for r in mine):.0f} |")
    lines += ["", "Final perplexity per seed: " + "; ".join(
        f"{arm}: " + ", ".join(f"s{s}={v}" for s, v in seeds.items()) for arm, seeds in per_seed.items()),
        "", f"Round-0 perplexity (seed {rows[0]['seed']}): {rows[0]['initial_ppl']:.2f}.", ""]
    lines += against_smallest(rows, args.arms)
    lines += rounds_against_smallest(rows, args.arms, rounds // 3)
    lines += ["Arm overrides: " + "; ".join(f"{a}: `{' '.join(o)}`" for a, o in report["settings"]["arm_overrides"].items()),
              ""]
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
