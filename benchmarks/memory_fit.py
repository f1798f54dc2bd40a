"""Benchmark: can a recipe's widths come out of its devices' memory? The planner's training peak at every width of
the ladder, against training the whole target, and the widths ``fusion.auto_widths`` fits at each
``population.memory_scale`` (the memory a small built-in target's devices would have for the larger target it
stands for).

For each recipe: (1) per width, the peak of the recipe's own way of training that width (a slice in its own forward
pass, or a full-forward window on the frozen target) and the whole target's training peak; (2) the memory scales,
from ``--low`` to 1 on a geometric grid of ``--points``, grouped into the ranges over which the fitted widths stay
the same, and whether the recipe's typed widths are among them. No training runs: the numbers are the planner's
(``fedfusion plan``), whose peaks ``benchmarks/results/cpu_memory.md`` measures.

    python benchmarks/memory_fit.py [--recipes quickstart rolling finetune] [--points 121]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from results_files import run_facts, write_pair

from fedfusion.config.recipe import Recipe
from fedfusion.devices.memory import mb, training_memory_bytes
from fedfusion.fusion.plan import recipe_target
from fedfusion.fusion.submodel.plan import auto_widths, plan_table
from fedfusion.run.check import load_checked

RESULTS = Path(__file__).resolve().parent / "results"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["quickstart", "rolling", "finetune"])
    parser.add_argument("--low", type=float, default=1e-4, help="the smallest memory scale tried")
    parser.add_argument("--points", type=int, default=121, help="memory scales tried, geometric from --low to 1")
    parser.add_argument("--out", default="memory_fit", help="results file stem under benchmarks/results/")
    return parser


def peaks(recipe: Recipe) -> list[dict[str, Any]]:
    """Per ladder width: the planner's peak for the recipe's way of training it (every tier at that width) and the
    whole target's full training peak (AdamW, float32), in MB."""
    f, train, population = recipe.fusion, recipe.train, recipe.population
    target = recipe_target(recipe.model, recipe.data_source())
    whole = mb(training_memory_bytes(target, train.batch_size, train.seq_len))
    tier = next(iter(population.mix))
    rows = []
    for width in sorted(f.width_ladder, reverse=True):
        [row] = plan_table(f, train, population, target, {t: width for t in population.mix}, tiers=[tier])
        rows.append({"width": width, "peak_mb": float(row["peak MB"]), "whole_mb": whole,
                     "share_of_whole": float(row["peak MB"]) / whole})
    return rows


def fits(recipe: Recipe, scales: np.ndarray) -> list[dict[str, Any]]:
    """The ranges of ``scales`` over which ``auto_widths`` fits the same widths (None: the tier fits nothing)."""
    target = recipe_target(recipe.model, recipe.data_source())
    ranges: list[dict[str, Any]] = []
    for scale in scales:
        population = replace(recipe.population, memory_scale=float(scale))
        widths = auto_widths(recipe.fusion, recipe.train, population, target, recipe.fusion.width_ladder)
        if ranges and ranges[-1]["widths"] == widths:
            ranges[-1]["to"] = float(scale)
        else:
            ranges.append({"from": float(scale), "to": float(scale), "widths": widths})
    return ranges


def _w(width: float | None) -> str:
    return "-" if width is None else f"{width:g}"


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    facts = run_facts("benchmarks/memory_fit.py", argv)
    scales = np.geomspace(args.low, 1.0, args.points)
    results: dict[str, Any] = {}
    lines = ["# Can a recipe's widths come out of its devices' memory?", "",
             f"Machine: {facts['machine']} (no training: the planner's numbers). Memory scales: {args.points} "
             f"points from {args.low:g} to 1, geometric. A tier may fill 90% of its (scaled) memory.", ""]
    for name in args.recipes:
        recipe = load_checked(name)  # a pretrained alias resolved to its local files
        typed = {t: recipe.fusion.widths.get(t) for t in recipe.population.mix}
        way = "full-forward window on the frozen target" if recipe.fusion.forward == "full" else "slice, own forward"
        rows, ranges = peaks(recipe), fits(recipe, scales)
        matched = [r for r in ranges if r["widths"] == typed]
        results[name] = {"way": way, "typed": typed, "peaks": rows, "ranges": ranges, "typed_fit": bool(matched)}
        tiers = list(recipe.population.mix)
        lines += [f"## {name}: {way}, batch {recipe.train.batch_size} x {recipe.train.seq_len}", "",
                  "| width | peak MB (the recipe's way) | whole target's training peak MB | share |",
                  "|---|---|---|---|",
                  *(f"| {r['width']:g} | {r['peak_mb']:.1f} | {r['whole_mb']:.1f} | {r['share_of_whole']:.2f} |"
                    for r in rows), "",
                  f"| memory scale | {' | '.join(tiers)} |", f"|---|{'---|' * len(tiers)}",
                  *(f"| {r['from']:.3g} to {r['to']:.3g} | {' | '.join(_w(r['widths'][t]) for t in tiers)} |"
                    for r in ranges), "",
                  f"The recipe's typed widths ({', '.join(f'{t} {_w(w)}' for t, w in typed.items())}) "
                  + (f"come out of the fit at memory scales {matched[0]['from']:.3g} to {matched[0]['to']:.3g}."
                     if matched else "come out of the fit at no memory scale."), ""]
    write_pair(RESULTS, args.out, {**facts, "scales": [float(s) for s in scales], "recipes": results}, "\n".join(lines))


if __name__ == "__main__":
    main()
