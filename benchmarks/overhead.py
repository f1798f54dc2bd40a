"""Flower's overhead on a run: each round's wall time against the ideal of its clients' own training.

The ideal round is the clients' training (``train_s`` in clients.jsonl) packed onto the cores the simulation gave
them: ``max(longest client, sum of clients / cores)``, cores = how many clients run at once (the machine's CPUs
over ``engine.cpus_per_client``, at most the clients of the round). The ratio is the round's ``wall_s`` over it.
Each round's wall time is split into that ideal, the server's central evaluation (``eval_s``), the fold
(``aggregate_s``) and the rest: Flower's message handling, serialisation, Ray scheduling, the clients' own model
building and data loading, and the training the packing could not overlap.

    python benchmarks/overhead.py [RECIPE] [key=value ...] [--repeats 3] [--eval-every 4] [--out benchmarks/results]
    python benchmarks/overhead.py --name NAME --report-only     # rewrite NAME.md from NAME.json

runs the whole command ``python -m fedfusion run RECIPE ...`` ``--repeats`` times for each of four arms, interleaved
(repeat 1 of every arm, then repeat 2, ...: a drift in the machine's load touches every arm alike):

- ``default``: what the code did before the client model cache and ``train.eval_every``, every round scored and
  every client message building its model (``FEDFUSION_CLIENT_CACHE=0``, ``train.eval_every=1``);
- ``cache``: the clients keep their built models between messages (``clients/cache.py``; the default now);
- ``eval_every=N``: central evaluation on round 0, every N-th and the last round only (``train.eval_every=N``);
- ``both``: the two together;
- ``paced``: the quickstart as it ships now: the cache on, every round scored, and each round's messages paced onto
  the engine's slots longest first (``fedfusion.strategies.paced``; the four arms above run with
  ``FEDFUSION_PACED=0``, as before pacing);
- ``oracle``: ``paced`` with every client training the whole target (``quickstart_policies.py``'s oracle arm:
  slices of width 1.0 in their own forward pass from round 1, no growth, core or shared window). With ``paced`` beside
  it the report gives the whole command's ratio to the oracle's, repeat by repeat (goal <= 0.7x).

The model cache is on by default and switched off with an environment variable, not a recipe key: it changes no
result (``benchmarks/compare_runs.py`` finds no difference), so it is no part of what a recipe describes, and a
variable reaches Flower's Ray actors without entering every message's spec. Writes ``overhead.{json,md}``: per arm
the minimum, median and maximum of the whole command's seconds and of ``ratio_from_round_2`` (the rounds from 2 on,
summed wall over summed ideal; round 1 carries Ray's start-up), the machine and its load average around each run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quickstart_policies import ARMS as POLICY_ARMS

RESULTS = Path(__file__).resolve().parent / "results"
ORACLE = POLICY_ARMS["oracle"][1]  # every client trains the whole target


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


ARMS = ("default", "cache", "eval_every", "both", "paced", "oracle")


def one_run(recipe: str, overrides: list[str], cache: bool, cores: int, paced: bool = False) -> dict:
    """One whole command in a fresh process: its seconds, its per-round table and the ratio from round 2."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "fedfusion", "run", recipe, *overrides, "--out", str(run)]
        env = {**os.environ, "FEDFUSION_CLIENT_CACHE": "1" if cache else "0", "FEDFUSION_PACED": "1" if paced else "0"}
        load_before = os.getloadavg()
        start = time.perf_counter()
        for attempt in range(3):  # Ray gives its raylet 30 s to start: on a busy machine a start can time out
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
            if done.returncode == 0 or "timed out during startup" not in done.stderr or attempt == 2:
                break
            print("Ray timed out starting; the run again", flush=True)
            load_before, start = os.getloadavg(), time.perf_counter()
        if done.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
        command_s = time.perf_counter() - start
        summary = json.loads((run / "summary.json").read_text())
        table = round_table(run, cores)
        first = _rows(run / "metrics.jsonl")[0]
    later = [r for r in table if r["round"] >= 2]
    return {
        "command_s": command_s, "run_wall_s": summary.get("wall_s"),
        "before_round_0_s": command_s - (summary.get("wall_s") or 0.0), "round_0_eval_s": first.get("eval_s"),
        "ratio_from_round_2": (sum(r["wall_s"] for r in later) / sum(r["ideal_s"] for r in later)) if later else None,
        "final_eval_loss": summary.get("final", {}).get("eval_loss"),
        "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
        "totals_from_round_2": {k: sum(r[k] for r in later) for k in ("wall_s", "ideal_s", "eval_s", "aggregate_s",
                                                                     "rest_s")},
        "rounds": table,
    }


def spread(values: list[float]) -> dict[str, float]:
    """Minimum, median and maximum."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", nargs="?", default="quickstart")
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides (every arm)")
    parser.add_argument("--repeats", type=int, default=3, help="whole commands per arm")
    parser.add_argument("--eval-every", type=int, default=4, help="train.eval_every of the eval_every and both arms")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"which of {', '.join(ARMS)}")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="overhead", help="writes NAME.json and NAME.md into --out")
    parser.add_argument("--report-only", action="store_true", help="rewrite NAME.md from NAME.json")
    return parser


def check_args(args: argparse.Namespace) -> str:
    """What is wrong with the parsed command line that argparse does not see ("" when nothing): ``--arms``."""
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    return f"--arms: choose from {', '.join(ARMS)}" if not arms or set(arms) - set(ARMS) else ""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.report_only:
        write_report(json.loads((args.out / f"{args.name}.json").read_text()), args.out / f"{args.name}.md")
        return 0
    if bad := check_args(args):
        parser.error(bad)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    cores = os.cpu_count() or 1
    settings: dict[str, tuple[bool, int, bool, list[str]]] = {
        "default": (False, 1, False, []), "cache": (True, 1, False, []), "eval_every": (False, args.eval_every, False, []),
        "both": (True, args.eval_every, False, []), "paced": (True, 1, True, []), "oracle": (True, 1, True, ORACLE)}
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for repeat in range(args.repeats):
        for arm in arms:
            cache, every, paced, arm_overrides = settings[arm]
            overrides = [*args.overrides, *arm_overrides, f"train.eval_every={every}"]
            result = one_run(args.recipe, overrides, cache, cores, paced)
            runs[arm].append(result)
            print(f"repeat {repeat + 1}/{args.repeats} {arm}: {result['command_s']:.1f} s, rounds 2+ "
                  f"{result['ratio_from_round_2']:.3f}x of the ideal", flush=True)
    summary = {}
    for arm, results in runs.items():
        cache, every, paced, arm_overrides = settings[arm]
        ratios = [r["ratio_from_round_2"] for r in results if r["ratio_from_round_2"] is not None]
        totals = {k: statistics.median(r["totals_from_round_2"][k] / r["totals_from_round_2"]["ideal_s"]
                                       for r in results) for k in ("eval_s", "aggregate_s", "rest_s")}
        summary[arm] = {"client_cache": cache, "eval_every": every, "paced": paced, "overrides": arm_overrides,
                        "command_s": spread([r["command_s"] for r in results]),
                        "ratio_from_round_2": spread(ratios) if ratios else None,
                        "median_share_of_ideal": totals,
                        "final_eval_loss": sorted({r["final_eval_loss"] for r in results})}
    if "paced" in runs and "oracle" in runs:  # the recipe's whole command over its oracle's, repeat by repeat
        summary["paced"]["over_oracle"] = spread([p["command_s"] / o["command_s"]
                                                  for p, o in zip(runs["paced"], runs["oracle"])])
    loads = [x for rs in runs.values() for r in rs for x in (r["load_avg_before"][0], r["load_avg_after"][0])]
    result = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": cores,
                    "load_avg_1min": spread(loads)},
        "command": " ".join(["python benchmarks/overhead.py", args.recipe, *args.overrides,
                             f"--repeats {args.repeats} --eval-every {args.eval_every}",
                             *([f"--arms {','.join(arms)}"] if arms != list(ARMS) else []),
                             *([f"--name {args.name}"] if args.name != "overhead" else [])]),
        "run_command": " ".join(["python -m fedfusion run", args.recipe, *args.overrides]),
        "repeats": args.repeats, "arms": summary, "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    write_report(result, args.out / f"{args.name}.md")
    return 0


def write_report(result: dict, path: Path) -> None:
    """``result``'s markdown table (also printed)."""
    summary, runs, cores = result["arms"], result["runs"], result["machine"]["cpus"]
    load = result["machine"]["load_avg_1min"]
    lines = [
        "# Flower overhead: round wall time against the clients' own training", "",
        f"Command: `{result['command']}`", "",
        f"Each arm runs `{result['run_command']} train.eval_every=N` as a whole "
        f"command {result['repeats']} times, the arms interleaved. Machine: {result['machine']['platform']}, {cores} "
        f"CPUs, Python {result['machine']['python']}; 1-minute load average before and after the runs: min "
        f"{load['min']:.2f}, median {load['median']:.2f}, max {load['max']:.2f} (a run keeps about 2 processes busy "
        "itself: its two parallel clients and the server; the average also trails the run before)"
        + (" (**more load than cores: other jobs shared the machine, timings are not the quiet ones**)"
           if load["median"] > cores else "") + ".", "",
        "Ratio: rounds 2 on, their summed wall time over their summed ideal (the round's clients' `train_s` packed "
        "onto the parallel slots: max of the longest client and the sum over the slots; goal 1.10x).", "",
        "| arm | client model cache | train.eval_every | paced longest first | rounds 2+ wall / ideal: min / median / "
        "max | whole command s: min / median / max | central eval / ideal | fold / ideal | rest / ideal | final eval "
        "loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, s in summary.items():
        ratio = s["ratio_from_round_2"]
        r = f"{ratio['min']:.3f} / **{ratio['median']:.3f}** / {ratio['max']:.3f}" if ratio else "-"
        c, t = s["command_s"], s["median_share_of_ideal"]
        lines.append(f"| {arm} | {'on' if s['client_cache'] else 'off'} | {s['eval_every']} | "
                     f"{'yes' if s.get('paced') else 'no'} | {r} | "
                     f"{c['min']:.1f} / {c['median']:.1f} / {c['max']:.1f} | {t['eval_s']:.3f} | "
                     f"{t['aggregate_s']:.3f} | {t['rest_s']:.3f} | "
                     f"{', '.join(f'{x:.6f}' for x in s['final_eval_loss'])} |")
    if over := summary.get("paced", {}).get("over_oracle"):
        lines += ["", f"The recipe's whole command over its oracle's (`{' '.join(summary['oracle']['overrides'])}`), "
                  f"repeat by repeat: min {over['min']:.3f}, median **{over['median']:.3f}**, max {over['max']:.3f} "
                  "(goal 0.7)."]
    last_arm = "paced" if "paced" in summary else list(summary)[-1]
    median_run = sorted(runs[last_arm], key=lambda r: r["ratio_from_round_2"] or 0.0)[len(runs[last_arm]) // 2]
    lines += ["", "Final eval loss: the last round's score in each arm's runs (one value per arm: every repeat ended with "
              "the same target; the cache, eval_every and pacing change no training, so the arms that differ only in "
              "them end alike).", "",
              "Rest: Flower's message handling, serialisation, Ray scheduling, the clients' own model building "
              "(what the cache saves) and data loading, and the training the packing could not overlap.", "",
              f"Rounds of the median `{last_arm}` run:", "",
              "| round | clients | parallel slots | wall s | ideal s | eval s | fold s | rest s | wall / ideal |",
              "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['round']} | {r['clients']} | {r['slots']} | {r['wall_s']:.2f} | {r['ideal_s']:.2f} | "
              f"{r['eval_s']:.2f} | {r['aggregate_s']:.3f} | {r['rest_s']:.2f} | "
              f"{r['ratio']:.2f} |" if r["ratio"] else f"| {r['round']} | 0 | | {r['wall_s']:.2f} | | | | | |"
              for r in median_run["rounds"]]
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
