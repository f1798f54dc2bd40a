"""Benchmark: how fast the quickstart could be on this machine: the compute its clients must do, against its wall time.

The quickstart's whole command is timed (``fedfusion run quickstart``, the shipped recipe), and its clients' work is
read from ``clients.jsonl``: each client's local steps (its tokens over the batch's) and its measured training
seconds. Beside it, in this process and one thread (a simulated client's ``cpus_per_client: 1``), the same
steps are timed on their own (:mod:`window_step`'s models, built from the strategy's own payloads): the whole target,
and the recipe's window with the core on the int8 frozen target, narrow and expanded. Then:

- **compute floor** = (the steps after growth x the fastest of those arms' step time, plus the grow rounds' measured
  client seconds) / the client slots (cores / ``engine.cpus_per_client``): the run's wall time if its clients did
  nothing but train, in parallel, at the isolated step's speed, and the server, evaluation and start-up cost nothing;
- **step in the simulation / isolated step**: what running inside the simulation (two clients at once, its data
  pipeline and messages) costs each step beyond the step itself.

A wall-time goal below the floor cannot be met at the recipe's budget (rounds, clients, steps, batch) on this
machine, whatever the engine does.

Then the same command with every client training the whole target (``overhead.py``'s ``oracle`` arm), and for
both the machine's busy core-seconds while the command ran (``/proc/stat``, every process: on a quiet machine, the
command's own work). Busy core-seconds over the cores is the wall time the command's work needs if nothing ever
waits, a floor for any engine; the clients' training seconds of each, side by side, show what a cheaper client step
can give: where the rest (start-up, evaluation, messages) costs both commands the same, their wall-time ratio lies
above their clients' training ratio.

The rounds' barriers are counted too: each round's measured client seconds packed longest first on the slots
(the round cannot end before its slowest slot), summed over the rounds, beside the rounds' wall time, evaluation
and start-up.

    python benchmarks/quickstart_floor.py [--work runs/bench-qs-floor] [--reuse] [--steps 4] [--reps 5]

writes ``benchmarks/results/quickstart_floor.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from overhead import ORACLE
from results_files import run_facts, write_pair
from window_step import arm_model, setting

from fedfusion.config.recipe import load_recipe
from fedfusion.models.families import family_of
from fedfusion.train.loop import train_steps

RESULTS = Path(__file__).parent / "results"
ARMS = ("full", "core", "core-expanded")
GOAL_S = 90.0  # the shipped 12 rounds on 2 quiet cores


def busy_core_s() -> float | None:
    """Seconds the machine's cores have spent busy since boot, all processes (Linux ``/proc/stat``; else None)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user .. steal (guest time is counted in user)


def run_quickstart(out: Path, reuse: bool, overrides: tuple[str, ...] = ()) -> dict[str, float | None]:
    """The quickstart's whole command (with ``overrides``), timed, and the machine's busy core-seconds while it ran
    (kept in ``out``, so ``reuse`` reads a finished run's figures back)."""
    timed = out / "command.json"
    if reuse and timed.is_file() and (out / "summary.json").is_file():
        return json.loads(timed.read_text())
    busy, start = busy_core_s(), time.perf_counter()
    subprocess.run([sys.executable, "-m", "fedfusion.cli", "run", "quickstart", *overrides, "--out", str(out)],
                   check=True, stdout=subprocess.DEVNULL)
    wall, after = time.perf_counter() - start, busy_core_s()
    figures = {"wall_s": wall, "busy_core_s": None if busy is None or after is None else after - busy}
    timed.write_text(json.dumps(figures) + "\n")
    return figures


def makespan(seconds: list[float], slots: int) -> float:
    """The time ``slots`` parallel workers need for jobs of ``seconds``, each placed longest first on the least
    loaded worker (within 4/3 of the best packing; the bound max(longest, sum / slots) is never beaten)."""
    load = [0.0] * slots
    for s in sorted(seconds, reverse=True):
        load[load.index(min(load))] += s
    return max(load)


def round_times(out: Path, slots: int) -> dict:
    """Per round: the clients' makespan on the slots (their measured training seconds, packed longest first), the
    round's wall, evaluation and aggregation seconds (metrics.jsonl)."""
    rows = [json.loads(line) for line in (out / "clients.jsonl").read_text().splitlines() if line.strip()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    per: dict[int, list[float]] = {}
    for r in rows:
        if r["status"] == "ok":
            per.setdefault(r["round"], []).append(r["train_s"])
    return {"makespan_s": sum(makespan(t, slots) for t in per.values()),
            "rounds_wall_s": sum(m["wall_s"] for m in metrics if m["round"] > 0),
            "eval_s": sum(m["eval_s"] for m in metrics), "aggregate_s": sum(m["aggregate_s"] for m in metrics),
            "round1_wall_s": next(m["wall_s"] for m in metrics if m["round"] == 1)}


def client_work(out: Path, tokens_per_step: int) -> dict:
    """The run's client rows: steps and training seconds before growth (a slice in its own forward pass) and after."""
    rows = [json.loads(line) for line in (out / "clients.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["status"] == "ok"]
    grown = [r for r in rows if r.get("forward") == "full"]
    small = [r for r in rows if r.get("forward") != "full"]
    steps = [r["tokens"] / tokens_per_step for r in grown]
    return {"train_s": sum(r["train_s"] for r in rows),
            "step_ms": [1000 * r["train_s"] * tokens_per_step / r["tokens"] for r in rows if r["tokens"]],
            "grown_steps": sum(steps), "grown_train_s": sum(r["train_s"] for r in grown),
            "grown_step_ms": [1000 * r["train_s"] / s for r, s in zip(grown, steps)],
            "small_steps": sum(r["tokens"] / tokens_per_step for r in small),
            "small_train_s": sum(r["train_s"] for r in small), "clients": len(rows)}


def isolated_steps(steps: int, reps: int) -> dict[str, float]:
    """Median ms per step of each arm, one thread, arms interleaved (as benchmarks/window_step.py times them)."""
    torch.set_num_threads(1)
    s = setting("quickstart")
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in family_of(s["config"]).build(s["config"]).state_dict().items()}
    data = torch.randint(0, s["config"].vocab_size, (max(64, 4 * s["batch"]), s["seq"] + 1))
    models = {arm: arm_model(arm, s, state) for arm in ARMS}
    kw = {"lr": 1e-4, "batch_size": s["batch"]}
    for model in models.values():
        train_steps(model, data, steps=1, seed=0, **kw)  # warm-up
    times: dict[str, list[float]] = {arm: [] for arm in models}
    for rep in range(reps):
        for arm, model in models.items():
            start = time.perf_counter()
            train_steps(model, data, steps=steps, seed=1 + rep, **kw)
            times[arm].append(1000 * (time.perf_counter() - start) / steps)
    return {arm: statistics.median(t) for arm, t in times.items()}


def report(data: dict) -> str:
    w, iso, rt = data["work"], data["isolated_ms"], data["rounds_timing"]
    fastest = min(iso.values())
    sim = statistics.median(w["grown_step_ms"])
    lines = ["# How fast the quickstart could be: its clients' compute against its wall time", "",
             f"Machine: {data['machine']}, torch {data['torch']}, load before {data['load_before']}. "
             f"`fedfusion run quickstart` (the shipped recipe: {data['rounds']} rounds, {w['clients']} client "
             f"rounds, batch {data['batch']} x {data['seq']}), {data['slots']} client slots "
             f"({data['cpus']} cores / engine.cpus_per_client {data['cpus_per_client']:g}); isolated steps: one thread, "
             f"{data['steps']} steps x {data['reps']} repetitions per arm, interleaved.", "",
             "| quantity | value |", "|---|---|",
             f"| whole command, wall s | {data['wall_s']:.1f} |",
             f"| the run's own wall s (summary.json) | {data['run_wall_s']:.1f} |",
             f"| client steps before growth / after | {w['small_steps']:.0f} / {w['grown_steps']:.0f} |",
             f"| client training s before growth / after (sum over clients) | {w['small_train_s']:.1f} / "
             f"{w['grown_train_s']:.1f} |",
             *(f"| isolated step ms, {arm} | {ms:.1f} |" for arm, ms in iso.items()),
             f"| step ms in the simulation after growth (median over client rounds; range) | {sim:.1f} "
             f"({min(w['grown_step_ms']):.1f}-{max(w['grown_step_ms']):.1f}) |",
             f"| step in the simulation / fastest isolated step | {sim / fastest:.2f}x |",
             f"| compute floor s (steps after growth x {fastest:.1f} ms + grow rounds' client s, over "
             f"{data['slots']} slots) | {data['floor_s']:.1f} |",
             f"| the rounds' client makespan s (each round's measured client seconds packed longest first on "
             f"the slots, summed: the floor with the round barriers) | {rt['makespan_s']:.1f} |",
             f"| the rounds' wall s, rounds 1-{data['rounds']} (round 1: {rt['round1_wall_s']:.1f}, client actors "
             f"starting) | {rt['rounds_wall_s']:.1f} |",
             f"| central evaluation s, rounds 0-{data['rounds']} / aggregation s | {rt['eval_s']:.1f} / "
             f"{rt['aggregate_s']:.1f} |",
             f"| before the run's clock starts (imports, data, Ray start-up) s | "
             f"{data['wall_s'] - data['run_wall_s']:.1f} |",
             f"| goal s | {GOAL_S:g} |", "",
             "The floor counts only the clients' training at the isolated step's speed, perfectly parallel: no "
             "server, evaluation, messages or start-up. A goal below it cannot be met at this recipe's budget on this "
             "machine; the distance from the floor to the wall time is what the engine and the simulation add. The "
             "makespan packs the measured client seconds longest first, within 4/3 of the best packing: an estimate "
             "with the round barriers, not a bound."]
    o, ow = data["oracle"], data["oracle"]["work"]
    busy = [data["busy_core_s"], o["busy_core_s"]]
    q_step, o_step = sim, statistics.median(ow["step_ms"])
    lines += ["", "## Against its oracle", "",
              f"The same command with every client training the whole target (`{' '.join(o['overrides'])}`), run "
              "after it. Busy core-seconds: every process's CPU time while the command ran (`/proc/stat`), so on a "
              "quiet machine the command's own work; over the cores, the wall time that work needs if nothing ever "
              "waits.", "",
              "| quantity | quickstart | oracle | quickstart / oracle |", "|---|---|---|---|",
              f"| whole command, wall s | {data['wall_s']:.1f} | {o['wall_s']:.1f} | {data['wall_s'] / o['wall_s']:.3f} |",
              f"| clients' training s (sum over client rounds) | {w['train_s']:.1f} | {ow['train_s']:.1f} | "
              f"{w['train_s'] / ow['train_s']:.3f} |",
              f"| step ms in the simulation (median; the quickstart's after growth) | {q_step:.1f} | {o_step:.1f} | "
              f"{q_step / o_step:.3f} |"]
    if None not in busy:
        lines += [f"| machine busy core-s | {busy[0]:.1f} | {busy[1]:.1f} | {busy[0] / busy[1]:.3f} |",
                  f"| busy core-s / {data['cpus']} cores (the work perfectly packed) s | {busy[0] / data['cpus']:.1f} "
                  f"| {busy[1] / data['cpus']:.1f} | |",
                  f"| the rest: busy core-s beyond the clients' training | {busy[0] - w['train_s']:.1f} | "
                  f"{busy[1] - ow['train_s']:.1f} | |"]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="runs/bench-qs-floor", help="where the quickstart run goes")
    parser.add_argument("--reuse", action="store_true", help="keep a finished run in --work and its timed wall")
    parser.add_argument("--steps", type=int, default=4, help="isolated steps per arm per repetition")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of the isolated steps")
    parser.add_argument("--out", default="quickstart_floor", help="results file stem under benchmarks/results")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    facts = run_facts("benchmarks/quickstart_floor.py", argv)
    recipe = load_recipe("quickstart")
    out = Path(args.work)
    oracle_out = out.with_name(out.name + "-oracle")
    command = run_quickstart(out, args.reuse)
    oracle = run_quickstart(oracle_out, args.reuse, tuple(ORACLE))
    wall = float(command["wall_s"] or 0.0)  # always timed (only the busy core-seconds can be missing)
    summary = json.loads((out / "summary.json").read_text())
    tokens_per_step = recipe.train.batch_size * recipe.train.seq_len
    work, oracle_work = client_work(out, tokens_per_step), client_work(oracle_out, tokens_per_step)
    iso = isolated_steps(args.steps, args.reps)
    cpus = os.cpu_count() or 1
    slots = max(1, int(cpus // recipe.engine.cpus_per_client))
    floor = (work["grown_steps"] * min(iso.values()) / 1000 + work["small_train_s"]) / slots
    data = {**facts, "rounds": recipe.rounds, "batch": recipe.train.batch_size, "seq": recipe.train.seq_len,
            "cpus": cpus, "cpus_per_client": recipe.engine.cpus_per_client, "slots": slots,
            "steps": args.steps, "reps": args.reps, "wall_s": wall, "busy_core_s": command["busy_core_s"],
            "oracle": {**oracle, "work": oracle_work, "overrides": list(ORACLE)},
            "run_wall_s": summary["wall_s"], "work": work,
            "isolated_ms": iso, "floor_s": floor, "rounds_timing": round_times(out, slots)}
    write_pair(RESULTS, args.out, data, report(data))


if __name__ == "__main__":
    main()
