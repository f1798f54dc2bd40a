"""Benchmark: distillation fusion of small client families into a larger target, on Shakespeare.

Runs the real CLI (Flower simulation engine) once per (arm, seed), all arms side by side on the ``distill``
recipe, and writes ``benchmarks/results/distillation.{json,md}`` with the machine and settings.

Arms (the metric each reports):
- smallest-only: every tier trains the tiny family, FedAvg only (its family model's score);
- per-family: each tier its own family, FedAvg only, no distillation either way (the best family's score);
- feddf / fedet: the families distilled into the target (FedDF average / Fed-ET consensus), and back;
- transfer-only: ``kd_weight=0``, the target trained on the transfer text alone (a control: no client
  knowledge reaches the target);
- oracle: sub-model fusion with every width 1.0 (every client trains the whole target);
- submodel-rolling: sub-model fusion with the rolling recipe's slices (phones 1/8 .. desktops 1/2).

Scores are on the pooled held-out text in nats per character (target and families alike).

    python benchmarks/distillation.py --seeds 0 1 2 [--reuse] [--finished-only] [extra key=value overrides]
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

RESULTS = Path(__file__).resolve().parent / "results"
RECIPE = "distill"  # every arm overrides it
# Cheaper than the recipe's defaults so the arms fit a 2-core machine shared with other benchmarks; the report
# says so.
SETTINGS = ["rounds=6", "train.local_steps=20", "distill.back_steps=5",
            "data.eval_chars=20000"]
NO_DISTILL = ["distill.back_distill=false", "distill.server_steps=1"]  # the target is not scored in these arms
ARMS = {  # id -> (label, overrides, what is scored: "smallest" | "best_family" | "target")
    "smallest-only": ("smallest-only FedAvg (every tier trains tiny)",
                      ["distill.tier_family={phone: tiny, laptop: tiny, desktop: tiny}", *NO_DISTILL], "smallest"),
    "per-family": ("per-family FedAvg, no distillation (best family)", NO_DISTILL, "best_family"),
    "feddf": ("FedDF (logit average) + back-distillation", ["distill.teacher=feddf"], "target"),
    "fedet": ("Fed-ET (weighted consensus + diversity) + back-distillation", ["distill.teacher=fedet"], "target"),
    "transfer-only": ("transfer-only control (kd_weight=0: LM on the transfer text)", ["distill.kd_weight=0"],
                      "target"),
    "oracle": ("oracle: every client trains the full target",
               ["fusion.method=submodel", "fusion.policy=static",
                "fusion.widths={phone: 1.0, laptop: 1.0, desktop: 1.0}"], "target"),
    "submodel-rolling": ("sub-model rolling (quickstart widths 1/8, 1/4, 1/2)",
                         ["fusion.method=submodel", "fusion.policy=rolling",
                          "fusion.widths={phone: 0.125, laptop: 0.25, desktop: 0.5}"], "target"),
}
SMALLEST = "tiny"


def finished(out: Path) -> bool:
    """Whether ``out`` holds a run that ended well."""
    path = out / "summary.json"
    return path.is_file() and json.loads(path.read_text()).get("status") == "ok"


def run_arm(overrides: list[str], out: Path, reuse: bool) -> dict:
    """One CLI run (or, with ``reuse``, the finished run already in ``out``); returns its summary.json."""
    summary_path = out / "summary.json"
    if not (reuse and finished(out)):
        cmd = [sys.executable, "-m", "fedfusion.cli", "run", RECIPE, *overrides, "--out", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(summary_path.read_text())


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def family_scores(row: dict) -> dict[str, dict[str, float]]:
    """``family_<name>_<metric>`` fields of a metrics row, by family."""
    out: dict[str, dict[str, float]] = {}
    for key, value in row.items():
        if key.startswith("family_"):
            metric = next(m for m in ("token_acc", "loss", "ppl", "acc") if key.endswith(f"_{m}"))  # longest first
            out.setdefault(key[len("family_"):-len(metric) - 1], {})[metric] = value
    return out


def scored(kind: str, final: dict) -> dict:
    """The arm's score from its final metrics row: loss (nats/char), ppl, acc (None where undefined), source."""
    families = family_scores(final)
    if kind == "target":
        return {"loss": final["eval_loss"], "ppl": final["eval_ppl"], "acc": final["eval_acc"], "model": "target"}
    name = SMALLEST if kind == "smallest" else min(families, key=lambda n: families[n]["loss"])
    f = families[name]
    return {"loss": f["loss"], "ppl": f["ppl"], "acc": f.get("acc"), "model": name}


def server_cost(rows: list[dict]) -> dict[str, float]:
    """Mean per round (rounds >= 1) of the server's counted distillation work and its price."""
    rounds = [r for r in rows if r["round"] > 0]
    return {"flops": statistics.mean(r.get("server_flops", 0.0) for r in rounds),
            "aggregate_s": statistics.mean(r["aggregate_s"] for r in rounds),
            "energy_j": statistics.mean(r.get("server_energy_j", 0.0) for r in rounds)}


def family_params(out: Path) -> dict[str, int]:
    """Parameters of each family model, from the client ledger."""
    return {r["assignment"]["family"]: r["params"] for r in read_rows(out / "clients.jsonl")
            if isinstance(r.get("assignment"), dict) and "family" in r["assignment"]}


def _mean_sd(values: list[float], digits: int = 3) -> str:
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--work", default="runs/bench-distill")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs found in --work")
    parser.add_argument("--finished-only", action="store_true",
                        help="report the finished runs found in --work and start none (for a cut-short run)")
    parser.add_argument("overrides", nargs="*")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    settings = [*SETTINGS, *args.overrides]
    runs, params = [], {}
    for seed in args.seeds:  # seed-major: a partial run already holds every arm
        for arm in args.arms:
            label, arm_overrides, kind = ARMS[arm]
            out = Path(args.work) / f"{arm}-s{seed}"
            if args.finished_only and not finished(out):
                continue
            summary = run_arm([*settings, *arm_overrides, f"seed={seed}"], out, args.reuse or args.finished_only)
            rows = read_rows(out / "metrics.jsonl")
            params.setdefault("target", summary["target_params"])
            params.update(family_params(out) if arm in ("per-family", "feddf") else {})
            runs.append({"arm": arm, "seed": seed, **scored(kind, rows[-1]), "target": summary["final"],
                         "families": family_scores(rows[-1]), "server": server_cost(rows),
                         "wall_s": summary["wall_s"], "energy_j": summary["energy_j"], "run_dir": str(out)})
            print(f"{arm} seed {seed}: loss {runs[-1]['loss']:.4f} ppl {runs[-1]['ppl']:.3f} "
                  f"({runs[-1]['model']}, {summary['wall_s']:.0f}s)", flush=True)
    arms = [a for a in ARMS if any(r["arm"] == a for r in runs)]
    loss = {a: statistics.mean(r["loss"] for r in runs if r["arm"] == a) for a in arms}
    closure = {}
    if "smallest-only" in loss and "oracle" in loss:
        span = loss["smallest-only"] - loss["oracle"]
        closure = {a: (loss["smallest-only"] - loss[a]) / span for a in arms} if span else {}
    report = {
        **commands(args),
        "benchmark": "distillation",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {"recipe": RECIPE, "overrides": settings, "seeds": args.seeds,
                     "arms": {a: ARMS[a][1] for a in arms}},
        "params": params,
        "runs": runs,
        "mean_loss": loss,
        "gap_closure": closure,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "distillation.json").write_text(json.dumps(report, indent=2))
    (RESULTS / "distillation.md").write_text(markdown(report, args, settings))
    print((RESULTS / "distillation.md").read_text())


def markdown(report: dict, args: argparse.Namespace, settings: list[str]) -> str:
    """The results table, the verdicts and the commands, as markdown."""
    recipe = load_recipe(RECIPE, settings)
    runs, params, closure = report["runs"], report["params"], report["gap_closure"]
    families = ", ".join(f"{n}: {f.model_type} {f.hidden_size}h x {f.num_layers}L, {f.tokenizer} tokenizer, "
                         f"{params.get(n, 0):,} params" for n, f in recipe.distill.families.items())
    biggest = max((params[n] for n in recipe.distill.families if n in params), default=0)
    lines = [
        "# Distillation fusion on Shakespeare", "",
        f"Machine: {report['machine']['platform']}, {report['machine']['cpus']} CPUs (shared with other jobs), "
        "CPU only.", "",
        f"Recipe `distill` with `{' '.join(settings)}`: {recipe.rounds} rounds x {recipe.train.local_steps} local "
        f"steps (batch {recipe.train.batch_size}, seq {recipe.train.seq_len}), {recipe.selection.clients_per_round} "
        f"of {recipe.population.num_clients} clients per round (mix {dict(recipe.population.mix)}); server "
        f"distillation {recipe.distill.server_steps} steps into the target and {recipe.distill.back_steps} back "
        f"into each family per round, on {recipe.distill.transfer.max_chars:,} characters of Shakespeare roles no "
        f"client owns. Reduced from the recipe's 12 rounds x 40 local steps / 10 back steps (and the held-out "
        f"text from 40k to {recipe.data.eval_chars:,} characters) to fit the 2-core machine shared with other "
        f"benchmarks. Seeds run: {sorted({r['seed'] for r in runs})} (the seeds column says how many finished per "
        "arm).", "",
        f"Target: Llama {recipe.model.hidden_size}h x {recipe.model.num_layers}L, character tokenizer, "
        f"{params.get('target', 0):,} params ({params.get('target', 0) / biggest:.1f}x the largest family). "
        f"Families: {families}; tiers {dict(recipe.distill.tier_family)}." if biggest else "", "",
        f"Scores: final round, pooled held-out text of every client ({recipe.data.eval_chars:,} characters), loss in nats per character "
        "(total nats / characters, so the BPE family compares with the character-level models), perplexity = "
        "exp(loss per char); next-character accuracy for character-tokenizer models only. Gap closure = "
        "(loss_smallest_only - loss_arm) / (loss_smallest_only - loss_oracle), on mean losses.", "",
        "| arm | scored model | seeds | loss nats/char | per-char ppl | next-char acc | gap closure | run wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm in report["mean_loss"]:
        mine = [r for r in runs if r["arm"] == arm]
        acc = [r["acc"] for r in mine if r["acc"] is not None]
        models = sorted({r["model"] for r in mine})
        gap = f"{closure[arm]:.2f}" if arm in closure else "n/a"
        lines.append(f"| {ARMS[arm][0]} | {', '.join(models)} | {len(mine)} | {_mean_sd([r['loss'] for r in mine], 4)} | "
                     f"{_mean_sd([r['ppl'] for r in mine])} | {_mean_sd(acc, 4)} | {gap} | "
                     f"{statistics.mean(r['wall_s'] for r in mine):.0f} |")
    lines += ["", "Family models at the final round (after FedAvg and, where on, back-distillation), per-char ppl "
              "mean over seeds:", "", "| arm | " + " | ".join(recipe.distill.families) + " |",
              "|---|" + "---|" * len(recipe.distill.families)]
    for arm in report["mean_loss"]:
        mine = [r for r in runs if r["arm"] == arm and r["families"]]
        if mine:
            cells = [_mean_sd([r["families"][n]["ppl"] for r in mine if n in r["families"]]) for n in
                     recipe.distill.families]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += ["", "Server-side distillation cost per round (mean over rounds and seeds; FLOPs counted: the "
              "target's and families' training 6·N·tokens plus every teacher forward 2·N·tokens; seconds: the "
              "strategy's aggregate time, i.e. FedAvg + distillation wall time on this CPU; J: the FLOPs priced "
              f"on the `{recipe.distill.server_device}` catalog profile):", "",
              "| arm | GFLOP / round | server s / round (this CPU) | priced J / round |", "|---|---|---|---|"]
    for arm in ("feddf", "fedet", "transfer-only"):
        mine = [r["server"] for r in runs if r["arm"] == arm]
        if mine:
            lines.append(f"| {arm} | {statistics.mean(s['flops'] for s in mine) / 1e9:.1f} | "
                         f"{statistics.mean(s['aggregate_s'] for s in mine):.1f} | "
                         f"{statistics.mean(s['energy_j'] for s in mine):.2f} |")
    lines += ["", *verdicts(report), "", "Per-seed loss (nats/char): " + "; ".join(
        f"{arm}: " + ", ".join(f"s{r['seed']}={r['loss']:.4f}" for r in runs if r["arm"] == arm)
        for arm in report["mean_loss"]), "",
        f"Command: `{report['command']}`", ""]
    if report.get("rendered_by"):
        lines += [f"Command: `{report['rendered_by']}` (this report, from the finished runs in `--work`)", ""]
    lines += ["Each run is:", "", "```"]
    lines += [f"fedfusion run distill {' '.join(repr(o) if ' ' in o else o for o in [*settings, *ARMS[a][1]])} "
              f"seed=S --out {args.work}/{a}-sS" for a in report["mean_loss"]]
    lines += ["```", ""]
    return "\n".join(lines)


def commands(args: argparse.Namespace) -> dict[str, str]:
    """``command``: what runs every arm and seed (and reuses the finished ones); with ``--finished-only``,
    ``rendered_by``: the command as given, which reports the finished runs and starts none."""
    arms = ["--arms", *args.arms] if args.arms != list(ARMS) else []
    run = shlex.join(["python", "benchmarks/distillation.py", "--seeds", *map(str, args.seeds), *arms,
                      "--work", str(args.work), "--reuse", *args.overrides])
    given = shlex.join(["python", "benchmarks/distillation.py", *sys.argv[1:]])
    return {"command": run, "rendered_by": given} if args.finished_only else {"command": run}


def verdicts(report: dict) -> list[str]:
    """Whether the distilled targets beat the best small model and smallest-only, on loss and accuracy."""
    runs, loss = report["runs"], report["mean_loss"]
    acc = {a: statistics.mean(r["acc"] for r in runs if r["arm"] == a) for a in loss
           if all(r["acc"] is not None for r in runs if r["arm"] == a)}
    out = []
    if "smallest-only" in loss and "oracle" in loss:
        out.append(f"- Gap-closure span (loss_smallest_only - loss_oracle): "
                   f"{loss['smallest-only'] - loss['oracle']:.4f} nats/char; where it is small against the seed "
                   "spread, the closure ratios are ill-conditioned and the losses themselves are the result.")
    for arm in ("feddf", "fedet", "transfer-only", "oracle", "submodel-rolling"):
        if arm not in loss:
            continue
        for ref in ("per-family", "smallest-only"):
            if ref in loss:
                better = loss[arm] < loss[ref]
                tail = (f"; next-char acc {acc[arm]:.4f} vs {acc[ref]:.4f}" if arm in acc and ref in acc else
                        "; accuracy not comparable (the best family is BPE)")
                out.append(f"- {arm} target {'beats' if better else 'does NOT beat'} {ref}: per-char ppl "
                           f"{math.exp(loss[arm]):.3f} vs {math.exp(loss[ref]):.3f}{tail}.")
    return out


if __name__ == "__main__":
    main()
