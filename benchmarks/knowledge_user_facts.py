"""The knowledge recipe on facts a user brings: every arm through the real CLI (``fedfusion run knowledge``).

Writes facts files with ``benchmarks/other_facts.py`` (towns, not the library's people), then runs, one at a
time, each arm on each file as ``fedfusion run knowledge data.path=... data.probes=... population.num_clients=16
seed=S <arm's overrides>`` on the recipe's own budget (its rounds, clients per round, local steps, lr and
optimizer; ``rounds: 0`` gives one round per ``data.facts_per_round`` facts), and collects each run directory's
``summary.json`` and ``metrics.jsonl`` into ``benchmarks/results/<out>.{md,json}``. A run directory that already
finished is reused, so an interrupted invocation resumes.

Arms (``fusion.widths.phone`` stays the recipe's 0.125 except for the oracle):

- ``smallest_only``: ``fusion.method=submodel fusion.grow_round=<rounds>``: every round trains the smallest
  width's static slice inside a target silenced around it, so the scored target *is* that small model: the
  model the phones can train together, at the same budget.
- ``generative``: generative distillation on the sampled tokens alone (``generative.top_k=0``).
- ``generative_topk``: the recipe as it ships (``generative.top_k=8``: the samples carry each position's 8
  likeliest tokens and their log-probabilities).
- ``generative_topk_t07``: the recipe with ``generative.temperature=0.7`` (colder samples).
- ``grow_core``: smallest-only for ``--grow-round`` rounds, then full-forward windows with the small model's
  units as a core plus a rolling window (FedRolex's shared start, ``stagger=false``) and embeddings and norms.
- ``grow_small``: ``grow_core`` with ``fusion.core_forward=small``: the core trains in the small model's own forward
  pass (exactly smallest-only's steps), the rest of the window beside it with the target's gradient.
- ``oracle``: ``fusion.method=submodel fusion.widths.phone=1.0``: every client trains the whole target.

    python benchmarks/knowledge_user_facts.py                        # 1,200 and 2,400 facts, seed 0, every arm
    python benchmarks/knowledge_user_facts.py --seeds 1 --arms smallest_only grow_core   # a second seed
    python benchmarks/knowledge_user_facts.py --rounds 60 --work runs/user_facts_r60 --out knowledge_user_facts_r60
    python benchmarks/knowledge_user_facts.py --collect-only         # rewrite the results from the run dirs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

from fedfusion.analysis.report import still_rising
from fedfusion.config.sections import DataConfig
from fedfusion.run.check import facts_rounds

sys.path.insert(0, str(Path(__file__).parent))
from other_facts import write as write_facts  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
ARMS = ("smallest_only", "grow_core", "grow_small", "generative", "generative_topk", "generative_topk_t07", "oracle")
FILES = ("1200:7", "2400:13")  # facts:generator seed


def recipe_rounds(facts: int) -> int:
    """The rounds the knowledge recipe gives ``facts`` facts: the budget every arm shares (its ``rounds``, or with
    ``rounds: 0`` one round per ``data.facts_per_round`` facts, as a run resolves it)."""
    recipe = yaml.safe_load((ROOT / "recipes" / "knowledge.yaml").read_text())
    per_round = recipe.get("data", {}).get("facts_per_round", DataConfig.facts_per_round)
    return int(recipe["rounds"]) or facts_rounds(facts, per_round)


def overrides(arm: str, rounds: int, grow_round: int) -> list[str]:
    """The ``fedfusion run`` overrides that make ``arm`` out of the knowledge recipe."""
    return {
        "smallest_only": ["fusion.method=submodel", "fusion.policy=static", f"fusion.grow_round={rounds}"],
        "generative": ["fusion.method=generative", "generative.top_k=0"],
        "generative_topk": ["fusion.method=generative", "generative.top_k=8"],
        "generative_topk_t07": ["fusion.method=generative", "generative.top_k=8", "generative.temperature=0.7"],
        "grow_core": ["fusion.method=submodel", "fusion.policy=rolling", "fusion.stagger=false",
                      f"fusion.grow_round={grow_round}", "fusion.forward=full", "fusion.window_core=true",
                      "fusion.window_shared=true"],
        "oracle": ["fusion.method=submodel", "fusion.policy=static", "fusion.widths.phone=1.0"],
    }[arm] if arm != "grow_small" else [*overrides("grow_core", rounds, grow_round), "fusion.core_forward=small"]


def command(data: Path, facts: int, arm: str, seed: int, rounds: int, grow_round: int, run: Path) -> list[str]:
    budget = [] if rounds == recipe_rounds(facts) else [f"rounds={rounds}"]
    return ["fedfusion", "run", "knowledge", f"data.path={data / 'train.jsonl'}", f"data.probes={data / 'probes.jsonl'}",
            "population.num_clients=16", f"seed={seed}", *budget, *overrides(arm, rounds, grow_round), "--out", str(run)]


def finished(run: Path) -> dict | None:
    """A finished run's summary, else None."""
    path = run / "summary.json"
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    return summary if summary.get("status") == "ok" else None


def collect(run: Path) -> dict:
    """Final and best recall, the round-by-round probe accuracy and the wall time of one run directory."""
    summary = finished(run)
    assert summary is not None, run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = [round(r["probe_acc"], 4) for r in rows if r.get("probe_acc") is not None]
    meta = json.loads((run / "bench.json").read_text()) if (run / "bench.json").exists() else {}
    return {"final": summary["facts"]["probe_acc"], "best": summary["facts"]["best_probe_acc"],
            "largest_client_share": summary["facts"]["largest_client_share"], "curve": curve,
            "rising": still_rising(curve), "wall_s": summary["wall_s"], **meta}


def write_results(out: str, work: Path, files: list[tuple[int, int]], arms: list[str], seeds: list[int],
                  commands: list[str] | tuple[str, ...] = ()) -> None:
    """Collect every finished run under ``work`` into ``benchmarks/results/<out>.{md,json}``; ``commands``: the
    invocations whose runs these are, the latest first (each a Command line, the first one the JSON's command)."""
    runs: dict[str, dict] = {}
    for facts, _ in files:
        for arm in arms:
            for seed in seeds:
                run = work / f"{facts}-{arm}-s{seed}"
                if finished(run):
                    runs[run.name] = {"facts": facts, "arm": arm, "seed": seed, **collect(run)}
    machine = f"{platform.platform()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    budgets = {f: next((len(r["curve"]) - 1 for r in runs.values() if r["facts"] == f), recipe_rounds(f))
               for f, _ in files}
    budget = "; ".join(f"{f} facts: {n} rounds" + ("" if n == recipe_rounds(f) else f" instead of its {recipe_rounds(f)}")
                       for f, n in budgets.items())
    data = {**({"command": commands[0], "earlier_commands": list(commands[1:])} if commands else {}),
            "machine": machine, "files": [{"facts": f, "generator_seed": s} for f, s in files], "runs": runs}
    lines = ["# The knowledge recipe on user facts files, every arm through `fedfusion run knowledge`", "",
             f"Machine: {machine}; every run alone (one at a time), the cores possibly shared with other "
             "engineers' jobs: `load` is the 1-minute load average as each run started (2 cores, so above 2 the runs "
             "waited for CPU). Wall times are the runs' own `wall_s`: compare them within this table only.", "",
             *(line for c in commands for line in (f"Command: `{c}`", "")),
             "Facts: `python benchmarks/other_facts.py DIR --facts F --seed S` (fictional towns, four attributes, "
             "Zipf-skewed over 16 clients): " + ", ".join(f"{f} facts (seed {s})" for f, s in files) + ". "
             f"Budget: the recipe's ({budget}; x 6 of 16 clients x 20 local AdamW steps, lr 0.003). "
             "Command per arm: `fedfusion run knowledge data.path=DIR/train.jsonl data.probes=DIR/probes.jsonl "
             "population.num_clients=16 seed=S` plus:", ""]
    for f, rounds in budgets.items():
        grow = next((r.get("grow_round") for r in runs.values() if r.get("grow_round") and r["facts"] == f), rounds // 3)
        lines += [f"- `{arm}` ({f} facts): `{' '.join(overrides(arm, rounds, grow))}`" for arm in arms]
    lines += ["", "Final recall = the share of all probes the target answers after the last round (the report's "
              "headline); gap closure = (arm - smallest_only) / (oracle - smallest_only) on the final recall of "
              "the same seed, shown only where the oracle ends above smallest_only (else there is no gap to close). "
              "`smallest_only` grows at its last round, so every round trains the smallest width's "
              "static slice inside a target silenced around it and the scored target *is* that small model (a "
              "slice without growth would be scored inside a target whose other units keep their random "
              "initialisation). Rising: the gain over the last "
              "evaluations where the report's check (`fedfusion.analysis.report.still_rising`) finds the curve still rising.", ""]
    for facts, _ in files:
        lines += [f"## {facts} facts", "", "| arm | seed | final recall | best | gap closure | rising | wall s | load |",
                  "|---|---|---|---|---|---|---|---|"]
        for seed in seeds:
            base = runs.get(f"{facts}-smallest_only-s{seed}"), runs.get(f"{facts}-oracle-s{seed}")
            for arm in arms:
                r = runs.get(f"{facts}-{arm}-s{seed}")
                if r is None:
                    continue
                span = base[1]["final"] - base[0]["final"] if base[0] and base[1] else 0.0
                # no gap to close where the oracle does not end above smallest-only
                closure = f"{(r['final'] - base[0]['final']) / span:.2f}" if base[0] and span > 0 else "-"
                r["gap_closure"] = None if closure == "-" else float(closure)
                rising = f"+{r['rising'][1]:.3f} in {r['rising'][0]}" if r["rising"] else "no"
                lines.append(f"| {arm} | {seed} | {r['final']:.3f} | {r['best']:.3f} | {closure} | {rising} | "
                             f"{r['wall_s']:.0f} | {r.get('load', '-')} |")
        lines += ["", "Round-by-round probe accuracy (every 5th round and the last):", ""]
        for r in runs.values():
            if r["facts"] == facts:
                marks = sorted(set(range(0, len(r["curve"]), 5)) | {len(r["curve"]) - 1})
                lines.append(f"- {r['arm']} (seed {r['seed']}): " + ", ".join(f"r{i} {r['curve'][i]:.3f}" for i in marks))
        lines.append("")
    missing = [f"{facts}-{arm}-s{seed}" for facts, _ in files for arm in arms for seed in seeds
               if f"{facts}-{arm}-s{seed}" not in runs]
    if missing:
        lines += [f"Not run or not finished: {', '.join(missing)}.", ""]
    data["missing"] = missing
    (RESULTS / f"{out}.json").write_text(json.dumps(data, indent=1) + "\n")
    (RESULTS / f"{out}.md").write_text("\n".join(lines))


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="+", default=list(FILES), help="FACTS:GENERATOR_SEED per facts file")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="run seeds (the recipe's seed key)")
    parser.add_argument("--rounds", type=int, default=None, help="every arm's rounds (default what the recipe gives each file)")
    parser.add_argument("--grow-round", type=int, default=None, help="grow_* arms' growth round (default rounds // 3)")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "user_facts", help="facts files and run dirs")
    parser.add_argument("--out", default="knowledge_user_facts")
    parser.add_argument("--collect-only", action="store_true")
    return parser


def invocations(out: str, argv: list[str]) -> list[str]:
    """This command, then the earlier ones ``results/<out>.json`` names (their runs are collected too, when they
    share ``--work``); a ``--collect-only`` run starts nothing, so it adds none."""
    path = RESULTS / f"{out}.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    before = [c for c in (old.get("command"), *old.get("earlier_commands", [])) if c]
    if "--collect-only" in argv:
        return before
    this = shlex.join(["python", "benchmarks/knowledge_user_facts.py", *argv])
    return [this, *(c for c in before if c != this)]


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    commands = invocations(args.out, sys.argv[1:] if argv is None else argv)
    files = [(int(f), int(s)) for f, s in (spec.split(":") for spec in args.files)]
    all_seeds = sorted({int(p.name.rsplit("-s", 1)[1]) for p in args.work.glob("*-s*") if finished(p)} | set(args.seeds))
    if not args.collect_only:
        for facts, gen_seed in files:
            write_facts(args.work / f"facts-{facts}", facts, 16, gen_seed)
        for seed in args.seeds:
            for arm in args.arms:
                for facts, _ in files:
                    run = args.work / f"{facts}-{arm}-s{seed}"
                    if finished(run):
                        continue
                    rounds = recipe_rounds(facts) if args.rounds is None else args.rounds
                    grow_round = rounds // 3 if args.grow_round is None else args.grow_round
                    cmd = command(args.work / f"facts-{facts}", facts, arm, seed, rounds, grow_round, run)
                    load = os.getloadavg()[0]
                    print(f"[{time.strftime('%H:%M:%S')}] load {load:.1f}: {' '.join(cmd)}", flush=True)
                    # the CLI of this interpreter's fedfusion (python -m fedfusion), whatever PATH holds
                    subprocess.run([sys.executable, "-m", *cmd], check=True, stdout=subprocess.DEVNULL)
                    (run / "bench.json").write_text(json.dumps({"load": round(load, 2), "grow_round": grow_round
                                                                if arm.startswith("grow") else None}))
                    write_results(args.out, args.work, files, list(ARMS), all_seeds, commands)
    write_results(args.out, args.work, files, list(ARMS), all_seeds, commands)


if __name__ == "__main__":
    main()
