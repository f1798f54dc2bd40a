"""Benchmark: bytes on the wire. What do int8 / int4 payloads and uploads (``fusion.wire_dtype``, ``fusion.wire_up``,
``fusion.error_feedback``; :mod:`fedfusion.wire.quantize`) cost the target against float32, and what do they save?

Two tasks, the same wire arms, paired by seed:

- ``quickstart``: the quickstart's task through the real CLI on ``RECIPE`` (``fedfusion run rolling``, Flower's
  simulation engine), so the bytes are what the messages carried (``clients.jsonl``'s ``bytes_down`` / ``bytes_up``)
  and error feedback lives where a deployment keeps it (each node's ``context.state``); metric: the target's
  held-out ``eval_loss`` (nats per character, lower is better), mean of the last 3 rounds.
- ``knowledge``: the federated-knowledge benchmark's ``phones`` regime, ``rolling`` arm
  (:func:`benchmarks.knowledge.run_arm`, its in-process round loop at its default settings), with the wire arms'
  settings; metrics: ``probe_acc`` (higher is better) and ``answer_loss``, means of the last 3 evaluations.

``loss vs float32`` is the paired relative change of the metric against the float32 arm of the same seed, signed so
that positive is worse; the noise next to it: ``spread`` (the largest round-to-round change of the metric over the
last 3 evaluations of the float32 arm) and the float32 arm's standard deviation over seeds.

    python benchmarks/wire_quant.py [--seeds 0 1 2] [--arms float32 int8 ...] [--tasks quickstart knowledge] [key=value ...]
        [--jobs 2] [--out wire_quant] [--smoke]

``--smoke`` runs 2 ``RECIPE`` rounds of 2 clients x 2 steps and 20 knowledge rounds (seed 0): it checks the script,
it measures nothing. Finished runs are kept in ``<out>.partial.json`` (until both tasks are done), so an interrupted
run resumes and the two tasks can run at different times (``--tasks knowledge``, then ``--tasks quickstart``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is not a package
import knowledge  # noqa: E402

from fedfusion.config.recipe import load_recipe  # noqa: E402

# results measured on the rolling slices (the quickstart's recipe until it switched to growth); the slice wire is its
RECIPE = "rolling"
RESULTS = Path(__file__).resolve().parent / "results"
ARMS = {  # id -> (down, up, error feedback)
    "float32": ("float32", "float32", True),
    "int8": ("int8", "int8", True),
    "int8-down-int4-up": ("int8", "int4", True),
    "int4": ("int4", "int4", True),
    "int4-no-ef": ("int4", "int4", False),
}
METRICS = {"quickstart": ("eval_loss", False), "knowledge": ("probe_acc", True)}  # task -> (metric, higher is better)
SMOKE_QUICKSTART = ["rounds=2", "selection.clients_per_round=2", "train.local_steps=2", "data.eval_chars=4000"]
SMOKE_KNOWLEDGE = {"rounds": 20, "eval_every": 5, "people": 100}


def wire_overrides(arm: str) -> list[str]:
    down, up, feedback = ARMS[arm]
    return [f"fusion.wire_dtype={down}", f"fusion.wire_up={up}", f"fusion.error_feedback={str(feedback).lower()}"]


def quickstart_run(arm: str, seed: int, extra: list[str]) -> dict:
    """One real ``RECIPE`` run of ``arm``: last-3-round metric, its spread, bytes each way (every client row)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "fedfusion.cli", "run", RECIPE, f"seed={seed}", *wire_overrides(arm),
               *extra, "--out", str(out)]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        clients = [json.loads(line) for line in (out / "clients.jsonl").read_text().splitlines() if line.strip()]
    last = [r["eval_loss"] for r in rows if r["round"] > 0][-3:]
    return {"eval_loss": statistics.mean(last), "spread": max(last) - min(last),
            "bytes_down": sum(c["bytes_down"] for c in clients), "bytes_up": sum(c["bytes_up"] for c in clients),
            "clients_ok": sum(c["status"] == "ok" for c in clients), "client_rows": len(clients), "wall_s": wall}


def knowledge_run(job: dict) -> dict:
    """One knowledge run (``phones`` regime, ``rolling`` arm) with the job's wire settings."""
    down, up, feedback = ARMS[job["wire"]]
    out = knowledge.run_arm({"regime": "phones", "arm": "rolling", "seed": job["seed"],
                             "args": {**job["args"], "wire_down": down, "wire_up": up, "error_feedback": feedback}})
    return {k: out[k] for k in ("probe_acc", "answer_loss", "spread", "bytes_down", "bytes_up", "wall_s")}


def knowledge_args(smoke: bool) -> dict:
    """benchmarks/knowledge.py's defaults (one people count), smaller with ``smoke``."""
    a = vars(knowledge.arguments().parse_args([]))
    a["people"] = a["people"][0]
    return {**a, **(SMOKE_KNOWLEDGE if smoke else {})}


def summarise(results: dict) -> dict:
    """Per task and arm: the metric and bytes over seeds, bytes ratio and metric loss vs the float32 arm, paired by
    seed."""
    out: dict = {}
    for task, arms in results.items():
        metric, higher = METRICS[task]
        base = {r["seed"]: r for r in arms.get("float32", [])}
        out[task] = {}
        for arm, runs in arms.items():
            paired = [r for r in runs if r["seed"] in base]
            ratio = [(r["bytes_down"] + r["bytes_up"]) / (base[r["seed"]]["bytes_down"] + base[r["seed"]]["bytes_up"])
                     for r in paired]
            sign = -1.0 if higher else 1.0  # positive = worse than float32
            worse = [sign * (r[metric] - base[r["seed"]][metric]) for r in paired]
            loss = [w / abs(base[r["seed"]][metric]) for w, r in zip(worse, paired) if base[r["seed"]][metric]]
            out[task][arm] = {
                "seeds": [r["seed"] for r in runs], metric: _stats([r[metric] for r in runs]),
                "spread": statistics.mean(r["spread"] for r in runs),
                "bytes_down": statistics.mean(r["bytes_down"] for r in runs),
                "bytes_up": statistics.mean(r["bytes_up"] for r in runs),
                "bytes_ratio": _stats(ratio), "loss_vs_float32": _stats(loss), "worse_by": _stats(worse),
                "down_ratio": _stats([r["bytes_down"] / base[r["seed"]]["bytes_down"] for r in paired]),
                "up_ratio": _stats([r["bytes_up"] / base[r["seed"]]["bytes_up"] for r in paired]),
                "wall_s": statistics.mean(r["wall_s"] for r in runs),
            }
            if task == "knowledge":  # probe_acc moves in steps of one probe; answer_loss is the smoother measure
                out[task][arm]["answer_loss"] = _stats([r["answer_loss"] for r in runs])
                out[task][arm]["answer_loss_vs_float32"] = _stats(
                    [(r["answer_loss"] - base[r["seed"]]["answer_loss"]) / base[r["seed"]]["answer_loss"] for r in paired])
            else:  # a client whose reply failed or was rejected would make an arm look cheap
                out[task][arm]["clients_ok"] = f"{sum(r['clients_ok'] for r in runs)}/{sum(r['client_rows'] for r in runs)}"
    return out


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "sd": None}
    return {"mean": statistics.mean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0}


def _fmt(s: dict, digits: int = 3, pct: bool = False) -> str:
    if s["mean"] is None:
        return "-"
    if pct:
        return f"{100 * s['mean']:+.2f} % ± {100 * s['sd']:.2f}"
    return f"{s['mean']:.{digits}f} ± {s['sd']:.{digits}f}"


def report(payload: dict) -> str:
    """The markdown table of each task."""
    smoke = " **SMOKE SETTING: checks the script, measures nothing.**" if payload["smoke"] else ""
    lines = [
        "# Bytes on the wire: int8 / int4 payloads and uploads against float32", "",
        f"Machine: {payload['machine']}. Seeds {payload['seeds']}.{smoke}", "",
        "Command: `" + payload.get("command", " ".join(["python benchmarks/wire_quant.py", *payload["argv"]])) + "`", "",
        "Arms: down / up format, error feedback on the quantised uplink (blockwise absmax, 64 values per float16 "
        "scale; vectors go float16; `fedfusion.wire.quantize`). `bytes ratio` = (down + up bytes) / the float32 arm's, "
        "paired by seed. `worse by` = the paired change of the metric against float32, signed so that positive = worse; "
        "`loss vs float32` = the same relative to the float32 arm's value. `spread` = "
        "the largest round-to-round change of the metric over the last 3 evaluations (mean over seeds): the noise "
        "next to any difference.", "",
    ]
    for task, arms in payload["summary"].items():
        metric, higher = METRICS[task]
        if task == "quickstart":
            shipped = " ".join(payload["quickstart_overrides"]) or "recipe as shipped"
            lines += [f"## quickstart: `fedfusion run {RECIPE}` (real CLI run, Flower simulation): {shipped}",
                      "", f"Metric: the target's held-out `{metric}` (nats/char, lower is better), mean of the last "
                      "3 rounds; bytes from clients.jsonl (what the messages carried).", ""]
        else:
            a = payload["knowledge_args"]
            lines += [f"## knowledge (phones regime, rolling arm of benchmarks/knowledge.py): {a['rounds']} rounds, "
                      f"{a['people']} people, {a['clients']} clients", "",
                      f"Metric: `{metric}` (higher is better), mean of the last 3 evaluations; `answer_loss` beside "
                      "it; bytes counted by the in-process driver from the arrays each client got and sent.", ""]
        extra = " | answer_loss | answer_loss vs float32" if task == "knowledge" else ""
        lines += [f"| arm (down/up, EF) | {metric}{extra} | worse by | loss vs float32 | spread | MB down | MB up "
                  "| bytes ratio | down ratio | up ratio | wall s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if extra else "")]
        for arm, s in arms.items():
            down, up, ef = ARMS[arm]
            cells = [f"{arm} ({down}/{up}{', EF' if ef and up != 'float32' else ''})", _fmt(s[metric])]
            if extra:
                cells += [_fmt(s["answer_loss"]), _fmt(s["answer_loss_vs_float32"], pct=True)]
            cells += [_fmt(s["worse_by"], 4), _fmt(s["loss_vs_float32"], pct=True), f"{s['spread']:.4f}",
                      f"{s['bytes_down'] / 2**20:.2f}",
                      f"{s['bytes_up'] / 2**20:.2f}", _fmt(s["bytes_ratio"]), _fmt(s["down_ratio"]),
                      _fmt(s["up_ratio"]), f"{s['wall_s']:.0f}"]
            lines.append("| " + " | ".join(cells) + " |")
        if task == "quickstart":
            run = load_recipe(RECIPE, payload["quickstart_overrides"])
            lines += ["", "Client rows ok (all seeds): " + ", ".join(f"{arm} {s['clients_ok']}" for arm, s in arms.items())
                      + ". Error feedback carries over only when a client is sampled again (the "
                      f"{RECIPE} recipe samples {run.selection.clients_per_round} of {run.population.num_clients} "
                      "clients a round)."]
        lines.append("")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--tasks", nargs="+", default=list(METRICS), choices=list(METRICS))
    parser.add_argument("--jobs", type=int, default=2, help="knowledge runs at once (1 torch thread each)")
    parser.add_argument("--smoke", action="store_true", help="a few rounds of seed 0: checks the script only")
    parser.add_argument("--out", default=None, help="results name (default wire_quant, or wire_quant_smoke)")
    parser.add_argument("overrides", nargs="*", help=f"key=value overrides of every quickstart-task run ({RECIPE})")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if "float32" not in args.arms:
        parser.error("--arms needs float32: every other arm is compared with it")
    seeds = [0] if args.smoke else args.seeds
    name = args.out or ("wire_quant_smoke" if args.smoke else "wire_quant")
    extra = [*(SMOKE_QUICKSTART if args.smoke else []), *args.overrides]
    k_args = knowledge_args(args.smoke)
    machine = f"{platform.platform()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"
    partial = RESULTS / f"{name}.partial.json"
    settings = {"smoke": args.smoke, "quickstart_overrides": extra, "knowledge_args": k_args}
    saved = json.loads(partial.read_text()) if partial.is_file() else {**settings, "results": {}, "machine": machine}
    if any(saved.get(k) != v for k, v in settings.items()):
        raise SystemExit(f"{partial} was run with other settings; use another --out or delete it")
    results: dict = saved["results"]
    RESULTS.mkdir(exist_ok=True)

    def keep(task: str, arm: str, seed: int, out: dict) -> None:
        results.setdefault(task, {}).setdefault(arm, []).append({"seed": seed, **out})
        partial.write_text(json.dumps({**settings, "results": results, "machine": saved["machine"]}))
        metric = METRICS[task][0]
        print(f"{task} {arm} seed {seed}: {metric} {out[metric]:.4f}, {(out['bytes_down'] + out['bytes_up']) / 2**20:.2f} "
              f"MB ({out['wall_s']:.0f}s)", flush=True)

    def todo(task: str) -> list[tuple[str, int]]:
        done = {(arm, r["seed"]) for arm, runs in results.get(task, {}).items() for r in runs}
        return [(arm, s) for arm in args.arms for s in seeds if (arm, s) not in done]

    if "knowledge" in args.tasks:  # in-process runs, several at once
        with ProcessPoolExecutor(args.jobs) as pool:
            futures = {pool.submit(knowledge_run, {"wire": arm, "seed": s, "args": k_args}): (arm, s)
                       for arm, s in todo("knowledge")}
            for future in as_completed(futures):
                keep("knowledge", *futures[future], future.result())
    if "quickstart" in args.tasks:  # each run uses every core (Ray), so one at a time
        for arm, s in todo("quickstart"):
            keep("quickstart", arm, s, quickstart_run(arm, s, extra))
    for arms in results.values():
        for runs in arms.values():
            runs.sort(key=lambda r: r["seed"])
    payload = {"command": shlex.join(["python", "benchmarks/wire_quant.py", *sys.argv[1:]]), **settings,
               "argv": sys.argv[1:], "seeds": seeds, "machine": saved["machine"], "results": results,
               "summary": summarise(results)}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=1))
    (RESULTS / f"{name}.md").write_text(report(payload))
    if all(not todo(task) for task in METRICS):  # every task done: a later call with --tasks starts afresh
        partial.unlink(missing_ok=True)
    print(report(payload))


if __name__ == "__main__":
    main()
