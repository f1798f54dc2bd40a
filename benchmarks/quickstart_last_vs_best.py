"""Benchmark: does the quickstart end at its best? Its last round's held-out perplexity against its best
round's, per seed: with the clients' lr constant over rounds and no cap on their local epochs, with the recipe's lr
schedule and no cap (before), and as the recipe stands, lr schedule and ``train.max_epochs`` (after).

Runs the real CLI (Flower simulation engine) once per (arm, seed), one run at a time, and writes
``benchmarks/results/quickstart_last_vs_best.{json,md}`` with each run's per-round curve, the machine and its load.

    python benchmarks/quickstart_last_vs_best.py --seeds 0 1 2 [--recipe NAME] [--arms ARM ...] [--work DIR] [--reuse]

``--recipe`` (default ``rolling``) is the recipe every arm runs and ``--out`` (default
``quickstart_last_vs_best``) names the results files; the script refuses to write over results of another recipe.
The stored results file was measured on the quickstart before it switched to growth, what is now
``--recipe rolling`` (the defaults):

    python benchmarks/quickstart_last_vs_best.py --seeds 0 1 2 --recipe rolling
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
    "constant": ("constant client lr, no epoch cap", ["train.lr_schedule=constant", "train.max_epochs=0"]),
    "schedule": ("the lr schedule, no epoch cap (before)", ["train.max_epochs=0"]),
    "recipe": ("the recipe: lr schedule and epoch cap (after)", []),
}
GOAL = 0.02  # the goal: last round within 2 % of the best round
RESULTS = Path(__file__).resolve().parent / "results"


def run(recipe: str, overrides: list[str], out: Path, reuse: bool) -> tuple[list[dict], dict]:
    """One CLI run of ``recipe`` (or, with ``reuse``, the finished run already in ``out``): its metrics.jsonl rows, and its wall
    seconds and the 1-minute load average before and after it (None for a reused run)."""
    summary = out / "summary.json"
    load: list[float | None] = [None, None]
    if not (reuse and summary.is_file() and json.loads(summary.read_text()).get("status") == "ok"):
        load[0] = os.getloadavg()[0]
        cmd = [sys.executable, "-m", "fedfusion.cli", "run", recipe, *overrides, "--out", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        load[1] = os.getloadavg()[0]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows, {"wall_s": json.loads(summary.read_text())["wall_s"], "load1_before": load[0], "load1_after": load[1]}


def last_round_smallest(out: Path, rows: list[dict], tokens_per_step: int) -> dict:
    """The last round's client with the fewest training windows: its tier, windows, the local steps it took (its
    tokens over ``tokens_per_step``) and its own training loss, against the target's held-out loss before that round
    (a client far below it has fit its own speaker)."""
    clients = [json.loads(line) for line in (out / "clients.jsonl").read_text().splitlines() if line.strip()]
    last = rows[-1]["round"]
    small = min((c for c in clients if c["round"] == last and c["status"] == "ok"), key=lambda c: c["examples"])
    return {"device": small["device"], "windows": small["examples"], "steps": small["tokens"] // tokens_per_step,
            "train_loss": small["train_loss"], "held_out_loss_before": rows[-2]["eval_loss"]}


def client_tokens(out: Path) -> int:
    """Tokens the run's clients trained (their replies' counts, summed over every client round that folded in):
    the work an epoch cap saves."""
    clients = [json.loads(line) for line in (out / "clients.jsonl").read_text().splitlines() if line.strip()]
    return sum(c["tokens"] for c in clients if c["status"] == "ok")


def last_vs_best(rows: list[dict]) -> dict:
    """Best trained round's perplexity (round 0, the untrained target, excluded), the last round's, and their gap."""
    trained = [r for r in rows if r["round"] > 0]
    best = min(trained, key=lambda r: r["eval_ppl"])
    last = trained[-1]
    return {"best_round": best["round"], "best_ppl": best["eval_ppl"], "last_ppl": last["eval_ppl"],
            "gap": last["eval_ppl"] / best["eval_ppl"] - 1, "curve": [round(r["eval_ppl"], 3) for r in trained]}


def _sd(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--recipe", default="rolling",
                        help="the recipe every arm runs (default rolling: the stored results' recipe)")
    parser.add_argument("--work", default="runs/bench-last-vs-best")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS),
                        help="the arms to run, in this order (default all); the reports hold these arms' runs")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs found in --work")
    parser.add_argument("--out", default="quickstart_last_vs_best",
                        help="results/<out>.{json,md} (default: the stored results, measured with --recipe rolling)")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    t = load_recipe(args.recipe).train
    load_before = os.getloadavg()
    saved = RESULTS / f"{args.out}.json"  # a reused run keeps the loads measured when it ran
    previous = json.loads(saved.read_text()) if saved.is_file() else {"runs": []}
    if previous.get("settings", {}).get("recipe", args.recipe) != args.recipe:
        parser.error(f"{saved} holds runs of --recipe {previous['settings']['recipe']}, not {args.recipe}: "
                     f"pass --out NAME for another results file (nothing was run or written)")
    measured = {r["run_dir"]: r for r in previous["runs"]}
    ran = False
    rows: list[dict] = []
    for seed in args.seeds:  # seed by seed: each pair of arms runs under about the same load
        for arm in args.arms:
            overrides = ARMS[arm][1]
            out = Path(args.work) / f"{arm}-s{seed}"
            metrics, cost = run(args.recipe, [*overrides, f"seed={seed}"], out, args.reuse)
            result = last_vs_best(metrics)
            ran |= cost["load1_before"] is not None
            if cost["load1_before"] is None and str(out) in measured:
                cost |= {k: measured[str(out)][k] for k in ("load1_before", "load1_after")}
            smallest = last_round_smallest(out, metrics, t.batch_size * t.seq_len)
            rows.append({"arm": arm, "seed": seed, **result, **cost, "client_tokens": client_tokens(out),
                         "last_round_smallest": smallest, "run_dir": str(out)})
            print(f"{arm} seed {seed}: best {result['best_ppl']:.3f} (round {result['best_round']}), "
                  f"last {result['last_ppl']:.3f}, gap {100 * result['gap']:+.2f} %", flush=True)
            # after every run: an interrupted benchmark keeps what it measured; reports remade from reused runs alone
            # keep the loads of the benchmark that ran them
            machine = previous["machine"] if not ran and "machine" in previous else None
            write_results(args.out, args.recipe, rows, load_before, machine)


def write_results(out: str, name: str, rows: list[dict], load_before: tuple[float, float, float],
                  machine: dict | None = None) -> None:
    """``results/<out>.{json,md}``: the reports of the runs so far of recipe ``name`` (``machine``: the machine and
    loads to report, when given)."""
    seeds = sorted({r["seed"] for r in rows})
    recipe = load_recipe(name)
    t = recipe.train
    command = (f"nice -n 10 python benchmarks/quickstart_last_vs_best.py --seeds {' '.join(map(str, seeds))} "
               f"--recipe {name} --out {out}")
    report = {
        "command": command,
        "benchmark": "quickstart_last_vs_best",
        "machine": machine or {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                               "loadavg_1_5_15_at_start": load_before, "loadavg_1_5_15_at_end": os.getloadavg()},
        "settings": {"recipe": name, "seeds": seeds, "goal": GOAL, "lr": t.lr,
                     "recipe_lr_schedule": t.lr_schedule, "recipe_lr_final": t.lr_final,
                     "recipe_max_epochs": t.max_epochs,
                     "arms": {arm: overrides for arm, (_, overrides) in ARMS.items()}},
        "runs": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{out}.json").write_text(json.dumps(report, indent=2))
    m = report["machine"]
    lines = [
        f"# The {name} recipe's last round against its best", "",
        f"Machine: {m['platform']}, {m['cpus']} CPUs, shared with other jobs (load average 1/5/15 min "
        f"{' / '.join(f'{x:.2f}' for x in m['loadavg_1_5_15_at_start'])} at the start, "
        f"{' / '.join(f'{x:.2f}' for x in m['loadavg_1_5_15_at_end'])} at the end); runs one at a time under "
        "`nice -n 10`.", "", f"Command: `{command}`", "",
        f"Each run `fedfusion run {name} seed=S [override]` ({recipe.rounds} "
        f"rounds, {recipe.selection.clients_per_round} of {recipe.population.num_clients} clients per round, "
        f"{t.local_steps} local AdamW steps at train.lr {t.lr:g}). The after arm is the recipe as it stands: "
        f"train.lr_schedule {t.lr_schedule}, train.lr_final {t.lr_final:g}, train.max_epochs {t.max_epochs:g} (a client "
        f"takes at most {t.max_epochs:g} passes over its own windows a round: fewer than {t.local_steps} steps of "
        f"{t.batch_size} when it holds fewer than {t.local_steps * t.batch_size / t.max_epochs:g} windows); the "
        f"before arm the same with no cap (train.max_epochs=0). Perplexity: the target at full width on "
        f"the pooled held-out text after each round; best = the lowest of rounds 1-{recipe.rounds}; goal: "
        f"last / best - 1 <= {100 * GOAL:.0f} %.", "",
        "| arm | seed | best ppl (round) | last ppl | last / best - 1 | goal met |",
        "|---|---|---|---|---|---|",
    ]
    for arm, (label, _) in ARMS.items():
        for r in (r for r in rows if r["arm"] == arm):
            lines.append(f"| {label} | {r['seed']} | {r['best_ppl']:.3f} ({r['best_round']}) | {r['last_ppl']:.3f} | "
                         f"{100 * r['gap']:+.2f} % | {'yes' if r['gap'] <= GOAL else 'no'} |")
    lines += ["", "| arm | mean last ppl ± sd | mean best ppl ± sd | worst last / best - 1 | client tokens per run (M) |",
              "|---|---|---|---|---|"]
    for arm, (label, _) in ARMS.items():
        mine = [r for r in rows if r["arm"] == arm]
        if not mine:
            continue
        last, best = [r["last_ppl"] for r in mine], [r["best_ppl"] for r in mine]
        lines.append(f"| {label} | {statistics.mean(last):.3f} ± {_sd(last):.3f} | "
                     f"{statistics.mean(best):.3f} ± {_sd(best):.3f} | {100 * max(r['gap'] for r in mine):+.2f} % | "
                     f"{statistics.mean(r['client_tokens'] for r in mine) / 1e6:.1f} |")
    lines += ["", f"Per-round perplexity (rounds 1-{recipe.rounds}):", ""]
    lines += [f"- {r['arm']} seed {r['seed']}: {', '.join(f'{v:.2f}' for v in r['curve'])} ({r['wall_s']:.0f} s; "
              f"1-min load {_load(r['load1_before'])} before, {_load(r['load1_after'])} after)" for r in rows]
    lines += ["", "The last round's client with the fewest training windows: the local steps it took, and its own training "
              "loss over them (their mean) against the target's held-out loss before the round (nats/char):", ""]
    lines += [f"- {r['arm']} seed {r['seed']}: a {s['device']} with {s['windows']} windows, {s['steps']} steps, "
              f"training loss {s['train_loss']:.2f} against held-out {s['held_out_loss_before']:.2f}"
              for r in rows for s in [r["last_round_smallest"]]]
    (RESULTS / f"{out}.md").write_text("\n".join(lines) + "\n")


def _load(value: float | None) -> str:
    return "n/a (a reused run)" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    main()
