"""A run beside a busy core: each round's wall time quiet and with one other CPU-bound process on the machine.

Runs ``python -m fedfusion run RECIPE rounds=R`` (default: the mixed recipe, whose server distils 100 steps a
round) under two server thread settings, each quiet and beside one ``while True`` Python process:

- ``auto``: ``engine.server_threads=0`` (the default): all of torch's threads where a short probe finds them
  clearly faster than one, else one, re-measured each round;
- ``all``: ``engine.server_threads=<cpus>``: torch's own default (one thread per core), the behaviour before.

For each run: every round's ``wall_s`` and the server's own seconds (``server_s``: distillation), the final
metrics (the thread count can move their last bits), and the busy/quiet ratio of each setting's round time
(rounds 2.., round 1 also carries Ray's start-up).

    python benchmarks/busy_core.py [--recipe mixed] [--rounds 2] [--arms auto all] [--out benchmarks/results]

writes ``busy_core.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SPINNER = "while True: pass"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def one_run(recipe: str, rounds: int, threads: int, busy: bool, work: Path) -> dict:
    """One whole command, optionally beside a spinning process; its rounds' times and final metrics."""
    run = work / f"{'busy' if busy else 'quiet'}-{threads}"
    cmd = [sys.executable, "-m", "fedfusion", "run", recipe, f"rounds={rounds}",
           f"engine.server_threads={threads}", "--out", str(run)]
    spinner = subprocess.Popen([sys.executable, "-c", SPINNER]) if busy else None
    load = os.getloadavg()[0]
    start = time.perf_counter()
    try:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    command_s = time.perf_counter() - start
    rows = _rows(run / "metrics.jsonl")
    final = rows[-1]
    return {"threads": threads, "busy": busy, "load_at_start": round(load, 2), "command_s": round(command_s, 1),
            "rounds": [{"round": r["round"], "wall_s": r["wall_s"], "server_s": r.get("server_s")}
                       for r in rows if r["round"] >= 1],
            "final": {k: final[k] for k in ("eval_loss", "eval_ppl", "eval_acc") if k in final}}


def steady_s(result: dict) -> float:
    """Mean wall time of rounds 2.. (round 1 alone where the run has one)."""
    later = [r["wall_s"] for r in result["rounds"] if r["round"] >= 2] or [r["wall_s"] for r in result["rounds"]]
    return sum(later) / len(later)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="mixed")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--arms", nargs="+", default=["auto", "all"], choices=["auto", "all"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cpus = os.cpu_count() or 1
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for arm in args.arms:
            for busy in (False, True):
                threads = 0 if arm == "auto" else cpus
                print(f"[{time.strftime('%H:%M:%S')}] {arm} {'busy' if busy else 'quiet'}", flush=True)
                runs.append({"arm": arm, **one_run(args.recipe, args.rounds, threads, busy, Path(tmp))})
    ratios = {}
    for arm in args.arms:
        quiet, busy = (next(r for r in runs if r["arm"] == arm and r["busy"] is b) for b in (False, True))
        ratios[arm] = {"round_1": busy["rounds"][0]["wall_s"] / quiet["rounds"][0]["wall_s"],
                       "steady": steady_s(busy) / steady_s(quiet)}
    command = shlex.join(["python", "benchmarks/busy_core.py", *(sys.argv[1:] if argv is None else argv)])
    run_command = f"python -m fedfusion run {args.recipe} rounds={args.rounds} engine.server_threads=T"
    result = {"machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": cpus},
              "command": command, "run_command": run_command, "busy_process": f"python -c '{SPINNER}'", "runs": runs,
              "busy_over_quiet": ratios}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "busy_core.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# A run beside a busy core", "",
             f"Machine: {result['machine']['platform']}, {cpus} CPUs, Python {result['machine']['python']}.", "",
             f"Command: `{command}`", "",
             f"Each run: `{run_command}` with T = 0 (`auto`, the default: all of torch's threads where a short probe "
             f"finds them clearly faster than one, else one, each round) or T = {cpus} (`all`: torch's default, the "
             f"behaviour before), each quiet and beside one `python -c '{SPINNER}'`.", "",
             "| setting | condition | load at start | round walls s | server s per round | steady round s | "
             "whole command s | final |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        walls = ", ".join(f"{x['wall_s']:.1f}" for x in r["rounds"])
        server = ", ".join(f"{x['server_s']:.1f}" for x in r["rounds"] if x["server_s"] is not None) or "-"
        final = ", ".join(f"{k} {v:.4f}" for k, v in r["final"].items())
        lines.append(f"| {r['arm']} | {'busy' if r['busy'] else 'quiet'} | {r['load_at_start']} | {walls} | {server} "
                     f"| {steady_s(r):.1f} | {r['command_s']:.0f} | {final} |")
    lines += ["", "Busy over quiet (the same setting's round time):", ""]
    lines += [f"- `{arm}`: round 1 {v['round_1']:.2f}x, rounds 2.. {v['steady']:.2f}x" for arm, v in ratios.items()]
    (args.out / "busy_core.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
