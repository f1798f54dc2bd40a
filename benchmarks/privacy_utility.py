"""Benchmark: what DP-SGD on the devices costs in quality, at each privacy budget, through the real CLI.

For a recipe (default the quickstart), each seed runs without DP and with ``privacy.mode=dp_sgd`` at each
``--epsilons`` budget, the noise calibrated per client to spend it over the rounds the client is expected to train
(``privacy.noise_multiplier=0``); every arm has the recipe's budget (rounds, clients, local steps, optimizer, data).
The table gives the recipe's headline metric (held-out perplexity; on a facts recipe the share of probes the
target answers), the largest epsilon any client spent and the noise multipliers the calibration chose. ``--arm
NAME=key=value,...`` adds a further arm on the recipe's overrides, for instance DP slices beside DP generative
transfer on the knowledge recipe.

    python benchmarks/privacy_utility.py --seeds 0 1 2 --epsilons 8 4 1
    python benchmarks/privacy_utility.py --recipe knowledge --seeds 0 --epsilons 8 \\
        --arm slices=fusion.method=submodel --out privacy_utility_knowledge

``--only ARM ...`` runs those arms alone and tabulates the others' finished runs (a seed's private arms added to a
table whose plain arms ran for fewer seeds: each row says which seeds it holds).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from results_files import run_facts, write_pair
from secure_aggregation import RESULTS, jsonl, run, runs_parser

from fedfusion.config.recipe import load_recipe


def arms(epsilons: list[float], extra: list[str]) -> dict[str, list[str]]:
    """Arm name -> overrides: no DP, DP-SGD at each budget, and each ``--arm`` without and with the tightest-but-one
    budget given (the first of ``epsilons``)."""
    out: dict[str, list[str]] = {"no DP": []}
    for eps in epsilons:
        out[f"dp_sgd eps {eps:g}"] = ["privacy.mode=dp_sgd", f"privacy.epsilon={eps:g}", "privacy.noise_multiplier=0"]
    for spec in extra:
        name, _, overrides = spec.partition("=")
        out[f"{name}, no DP"] = overrides.split(",")
        out[f"{name}, dp_sgd eps {epsilons[0]:g}"] = [*overrides.split(","), *out[f"dp_sgd eps {epsilons[0]:g}"]]
    return out


def summarize(out: Path, facts: bool, wall: float) -> dict:
    """A run's final headline metric, the largest epsilon a client spent, the noise multipliers it trained with and
    how many client rounds failed (a dropout, or a worker the host killed: a run with failures did less work)."""
    rows = [r for r in jsonl(out / "metrics.jsonl") if r.get("eval_loss") is not None]
    final = rows[-1]
    ok = [r for r in jsonl(out / "clients.jsonl") if r["status"] == "ok"]
    sigmas = sorted({r["noise_multiplier"] for r in ok if r.get("noise_multiplier") is not None})
    failed = sum(1 for r in jsonl(out / "clients.jsonl") if r["status"] != "ok")
    return {"metric": float(final["probe_acc"] if facts else final["eval_ppl"]), "failed": failed,
            "epsilon_max": max((r.get("epsilon") or 0.0 for r in ok), default=0.0),
            "sigma": [sigmas[0], sigmas[-1]] if sigmas else None, "clients_trained": len({r["partition"] for r in ok}),
            "wall_s": wall}


def finished(out: Path) -> bool:
    """Whether ``out`` holds a run that ended ok."""
    summary = out / "summary.json"
    return summary.is_file() and json.loads(summary.read_text()).get("status") == "ok"


def build_parser() -> argparse.ArgumentParser:
    parser = runs_parser(__doc__.split("\n\n")[0], "runs/bench-privacy-utility", "privacy_utility")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[8.0, 4.0, 1.0])
    parser.add_argument("--arm", action="append", default=[], help="NAME=key=value,key=value: a further arm")
    parser.add_argument("--only", nargs="+", default=None, metavar="ARM",
                        help="run only these arms (by name, e.g. 'dp_sgd eps 8'); the others' finished runs in --work "
                             "are still tabulated")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    facts_run = run_facts("benchmarks/privacy_utility.py", argv)
    facts = load_recipe(args.recipe, args.overrides).data.source == "facts"
    results: dict[str, dict[int, dict]] = {}
    for seed in args.seeds:
        for name, overrides in arms(args.epsilons, args.arm).items():
            out = Path(args.work) / args.recipe / f"{name.replace(' ', '_').replace(',', '')}-s{seed}"
            if args.only is not None and name not in args.only and not finished(out):
                continue
            wall = run(args.recipe, [f"seed={seed}", *args.overrides, *overrides], out,
                       args.reuse or (args.only is not None and name not in args.only))
            results.setdefault(name, {})[seed] = summarize(out, facts, wall)
    metric = "probe accuracy (higher is better)" if facts else "held-out perplexity (lower is better)"
    lines = []
    for name, by_seed in results.items():
        values = [r["metric"] for r in by_seed.values()]
        spread = f" ± {statistics.stdev(values):.4f}" if len(values) > 1 else ""
        sigmas = [s for r in by_seed.values() if r["sigma"] for s in r["sigma"]]
        sigma = f"{min(sigmas):.3g} to {max(sigmas):.3g}" if sigmas else "-"
        eps = max(r["epsilon_max"] for r in by_seed.values())
        per_seed = ", ".join(f"s{s}={r['metric']:.4f}" for s, r in by_seed.items())
        lines.append(f"| {name} | {statistics.mean(values):.4f}{spread} | {per_seed} | "
                     f"{eps:.3g} | {sigma} | {statistics.mean(r['clients_trained'] for r in by_seed.values()):.1f} | "
                     f"{statistics.mean(r['wall_s'] for r in by_seed.values()):.0f} | "
                     f"{sum(r.get('failed', 0) for r in by_seed.values())} |")
    markdown = "\n".join([
        f"# DP-SGD on the devices: {metric} at each privacy budget ({args.recipe})", "",
        f"Machine: {facts_run['machine']}, torch {facts_run['torch']}, load before {facts_run['load_before']}. "
        f"Recipe {args.recipe}, overrides {args.overrides or 'none'}, seeds {args.seeds}; delta 1e-5, per-example "
        "clipping norm 1, each client's noise calibrated to spend the budget over the rounds it is expected to "
        "train (`privacy.noise_multiplier=0`); every arm has the recipe's budget.", "",
        f"| arm | final {metric} (mean ± sd over seeds) | per seed | largest epsilon spent | noise multipliers | "
        "clients that trained | wall s | client rounds that failed (all seeds) |",
        "|---|---|---|---|---|---|---|---|", *lines, ""])
    data = {**facts_run, "recipe": args.recipe, "overrides": args.overrides, "seeds": args.seeds,
            "epsilons": args.epsilons, "results": {n: {str(s): r for s, r in v.items()} for n, v in results.items()}}
    write_pair(RESULTS, args.out, data, markdown)


if __name__ == "__main__":
    main()
