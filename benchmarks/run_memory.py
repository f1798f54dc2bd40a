"""Benchmark: the server's memory over a whole ``fedfusion run`` (Flower's simulation engine), on today's code and,
with ``--baseline REV``, on the code of git revision ``REV``, with the two runs' ledgers compared field by field.

Each arm runs ``python -m fedfusion run RECIPE rounds=N [overrides]`` in a fresh process (the baseline's package,
strategies, clients and recipes exported to a temporary folder first, on ``PYTHONPATH`` for the run and its Ray
workers) while this script reads the server process's ``/proc/PID/status`` every quarter second: the peak of its
anonymous memory (``RssAnon``: the process's own heap and tensors), of the shared memory it has touched
(``RssShmem``: Ray's object store, where the messages to and from the client actors pass) and the run's own
high-water mark (``server_peak_rss_mb`` in its summary: ``VmHWM``, both together). Memory does not depend on the
machine's load; the wall times do (stated, not compared). The arms run one after the other, never at once.

    python benchmarks/run_memory.py [--recipe finetune] [--rounds 2] [--baseline REV] [--work runs/bench-run-memory] [--out STEM]
        [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from compare_runs import compare
from server_memory import export

from fedfusion.devices.hardware import status_kb

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("VmRSS", "RssAnon", "RssShmem")
MB = 1024  # kB in a MiB


def run_arm(label: str, code: Path, recipe: str, rounds: int, overrides: list[str], out: Path) -> dict[str, Any]:
    """One whole run on the code under ``code``, its server's memory sampled while it runs."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    command = [sys.executable, "-m", "fedfusion", "run", recipe, f"rounds={rounds}", *overrides, "--out", str(out)]
    peaks = dict.fromkeys(FIELDS, 0)
    start = time.perf_counter()
    with open(out.parent / f"{out.name}.log", "w") as log:
        proc = subprocess.Popen(command, cwd=code, env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            for k in FIELDS:
                try:
                    peaks[k] = max(peaks[k], status_kb(k, proc.pid))
                except RuntimeError:  # the run has just exited
                    break
            time.sleep(0.25)
    if proc.returncode:
        raise RuntimeError(f"{label}: {' '.join(command)} failed ({proc.returncode}); see {out}.log")
    summary = json.loads((out / "summary.json").read_text())
    return {"code": label, "run": str(out), "wall_s": time.perf_counter() - start,
            "vmhwm_mb": summary["server_peak_rss_mb"], **{f"peak_{k}_mb": v / MB for k, v in peaks.items()},
            "final": summary["final"]}


def report(data: dict[str, Any]) -> str:
    lines = [f"# The server's memory over a whole run: {data['recipe']}, {data['rounds']} rounds", "",
             f"Machine: {data['machine']}, torch {data['torch']}, load before {data['load_before']}. Each arm a fresh "
             "`fedfusion run` (Flower's simulation engine) on its code, one after the other.", "",
             "| code | VmHWM MiB (run summary) | peak RssAnon MiB | peak RssShmem MiB | peak VmRSS MiB | wall s |",
             "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['code']} | {r['vmhwm_mb']:.0f} | {r['peak_RssAnon_mb']:.0f} | {r['peak_RssShmem_mb']:.0f} | "
                     f"{r['peak_VmRSS_mb']:.0f} | {r['wall_s']:.0f} |")
    if "ledgers" in data:
        lines += ["", f"Ledgers (`metrics.jsonl`, `clients.jsonl`) of {data['rows'][1]['code']} against "
                  f"{data['rows'][0]['code']}, every field but the host's timings: {data['ledgers']}."]
    lines += ["", "RssAnon: the server process's own memory (heap, tensors, Flower's records); RssShmem: the pages of "
              "Ray's shared object store it has touched (the messages to and from the client actors); VmHWM: the "
              "kernel's high-water mark of the two together, what `server_peak_rss_mb` reports. Peaks sampled every "
              "0.25 s (a shorter spike can be missed; VmHWM cannot)."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="finetune")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline", default=None, help="a git revision whose code is also measured (first)")
    parser.add_argument("--work", type=Path, default=Path("runs/bench-run-memory"))
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--out", default="run_memory", help="the results' file stem under --out-dir")
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides for every arm")
    return parser


def main() -> None:
    a = build_parser().parse_args()
    from results_files import run_facts, write_pair

    facts = run_facts("benchmarks/run_memory.py", sys.argv[1:])
    a.work.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        arms = [(ROOT, head)]
        if a.baseline:
            export(a.baseline, Path(tmp))
            arms.insert(0, (Path(tmp), a.baseline))
        for code, label in arms:
            rows.append(run_arm(label, code, a.recipe, a.rounds, a.overrides, (a.work / label).resolve()))
            print(json.dumps(rows[-1]), flush=True)
    data: dict[str, Any] = {**facts, "recipe": a.recipe, "rounds": a.rounds, "overrides": a.overrides, "rows": rows}
    if len(rows) == 2:
        diffs = [d for name in ("metrics.jsonl", "clients.jsonl")
                 for d in compare(Path(rows[0]["run"]), Path(rows[1]["run"]), name)[0]]
        data["ledgers"] = "identical" if not diffs else f"{len(diffs)} differences, first: {diffs[0]}"
    for r in rows:  # the results name no path of one machine
        r["run"] = os.path.relpath(r["run"], Path.cwd())
    write_pair(a.out_dir, a.out, data, report(data))


if __name__ == "__main__":
    main()
