"""Benchmark: every way the finetune recipe's devices can train its pretrained target, at one budget, against the
same smallest-only and oracle arms.

``fedfusion compare finetune`` runs the recipe (windows), smallest-only (every tier at the weakest tier's window) and
the oracle (every client fine-tunes the whole target) into ``--compare`` (default ``runs/compare-finetune``). This
script runs further method arms of the same recipe through the CLI at the same budget (checked: an arm's resolved
recipe differs from the recipe's only in the design sections ``fedfusion.run.arms`` allows) and tabulates each
arm's final probe recall per seed beside the compare's arms, with its gap closure on that seed's smallest-only ->
oracle span and its general-text loss change.

    python benchmarks/finetune_methods.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from results_files import run_facts, write_pair
from secure_aggregation import RESULTS, jsonl, run

from fedfusion.config.recipe import load_recipe
from fedfusion.run.arms import Arm, budget_problems

# arm -> (its overrides of the recipe, what each client trains)
ARMS = {
    "lora": (["fusion.method=lora", "fusion.forward=slice"],
             "LoRA (flexlora) on every linear layer of the float32 base, each tier its rank (finetune.yaml's lora "
             "section)"),
}
COMPARED = {"recipe": "windows (the recipe)", "smallest-only": "smallest-only (the weakest tier's window on every "
            "tier)", "oracle": "oracle (every client fine-tunes the whole target)"}


def finals(out: Path) -> dict[str, float]:
    """A finished run's final probe recall and answer loss, general-text loss at round 0 and at the end, and wall
    seconds."""
    rows = [r for r in jsonl(out / "metrics.jsonl") if r.get("probe_acc") is not None]
    summary = json.loads((out / "summary.json").read_text())
    if summary.get("status") != "ok":
        raise ValueError(f"{out}: the run did not finish (status {summary.get('status')!r})")
    return {"probe_acc": float(rows[-1]["probe_acc"]), "answer_loss": float(rows[-1]["answer_loss"]),
            "general_0": float(rows[0]["general_loss"]),
            "general": float(rows[-1]["general_loss"]), "wall_s": float(summary.get("wall_s") or 0.0)}


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--compare", default="runs/compare-finetune", help="fedfusion compare finetune's --out")
    parser.add_argument("--work", default="runs/bench-finetune-methods", help="where the method arms' runs go")
    parser.add_argument("--out", default="finetune_methods", help="results file stem under benchmarks/results")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    facts = run_facts("benchmarks/finetune_methods.py", argv)
    results: dict[str, dict[int, dict[str, float]]] = {}
    for seed in args.seeds:
        base = load_recipe("finetune", [f"seed={seed}"])
        for name, (overrides, _) in ARMS.items():
            problems = budget_problems(base, load_recipe("finetune", [f"seed={seed}", *overrides]),
                                       Arm(name, tuple(overrides), ""))
            if problems:
                raise SystemExit("; ".join(problems))
            out = Path(args.work) / f"{name}-s{seed}"
            run("finetune", [f"seed={seed}", *overrides], out, reuse=True)
            results.setdefault(name, {})[seed] = finals(out)
        for name in COMPARED:
            results.setdefault(name, {})[seed] = finals(Path(args.compare) / f"{name}-s{seed}")
    lines = []
    for name, by_seed in results.items():
        recall = [by_seed[s]["probe_acc"] for s in args.seeds]
        closure = []
        for s in args.seeds:
            low, high = results["smallest-only"][s]["probe_acc"], results["oracle"][s]["probe_acc"]
            closure.append((by_seed[s]["probe_acc"] - low) / (high - low) if high > low else float("nan"))
        forget = [100 * (by_seed[s]["general"] / by_seed[s]["general_0"] - 1) for s in args.seeds]
        spread = f" ± {statistics.stdev(recall):.4f}" if len(recall) > 1 else ""
        walls = " / ".join(f"{by_seed[s]['wall_s']:.0f}" for s in args.seeds)
        answer = " / ".join(f"{by_seed[s]['answer_loss']:.3f}" for s in args.seeds)
        what = COMPARED.get(name) or ARMS[name][1]
        lines.append(f"| {name} | {what} | {' / '.join(f'{v:.4f}' for v in recall)} | {statistics.mean(recall):.4f}"
                     f"{spread} | {' / '.join(f'{c:.2f}' for c in closure)} | {answer} | "
                     f"{' / '.join(f'{f:+.1f}' for f in forget)} | "
                     f"{walls} |")
    seeds = "/".join(map(str, args.seeds))
    markdown = "\n".join([
        "# Fine-tuning SmolLM2-135M from phones: every method at one budget", "",
        f"Machine: {facts['machine']}, torch {facts['torch']}, load before {facts['load_before']}. The finetune "
        f"recipe's budget for every arm (8 rounds, 4 of 16 clients a round, 8 local AdamW steps at lr 3e-4 with the "
        f"cosine schedule, batch 4 x 32 tokens, the same facts and seeds {args.seeds}); the recipe, smallest-only and "
        f"oracle arms are `fedfusion compare finetune`'s runs in `{args.compare}`, the others this script's in "
        f"`{args.work}`, each checked to differ from the recipe only in its method's design keys.", "",
        f"| arm | every client trains | final probe recall (seeds {seeds}) | mean ± sd | gap closure "
        f"(smallest-only 0, oracle 1; per seed) | answer loss, final (per seed) | general-text loss change, % "
        "(per seed) | wall s (per seed) |",
        "|---|---|---|---|---|---|---|---|", *lines, "",
        "Gap closure per seed: (arm - smallest-only) / (oracle - smallest-only) on that seed's finals. Answer loss: "
        "the target's mean loss on the probes' answer tokens (nats/token; recall's finer-grained companion). "
        "General-text "
        "loss: the target's loss on Shakespeare (which the base models) at the end against round 0. Wall seconds as "
        "the runs recorded them, under whatever else ran on the machine then.", ""])
    data = {**facts, "seeds": args.seeds, "arms": {n: {"overrides": o, "about": a} for n, (o, a) in ARMS.items()},
            "results": {n: {str(s): r for s, r in v.items()} for n, v in results.items()}}
    write_pair(RESULTS, args.out, data, markdown)


if __name__ == "__main__":
    main()
