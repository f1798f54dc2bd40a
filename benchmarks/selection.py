"""Benchmark: client selectors side by side on 1,000 virtual devices with diurnal availability.

Every (selector, seed) is one real `fedfusion run` (Flower simulation engine) of the quickstart task on
a population of 1,000 Shakespeare speakers (phones, laptops, desktops in the quickstart mix), with the
availability model on. The target is fixed from the random selector alone before any comparison: the
loss at which random has made 95% of its improvement from round 0 to its plateau (mean of its last 3
rounds over seeds). For each run: rounds, energy and CO2 until the target is first reached, wasted
energy, dropouts and Jain's participation fairness. Writes ``benchmarks/results/selection.{json,md}``.

    python benchmarks/selection.py --seeds 0 1 2 3 4 [--rounds 25] [--reuse] [extra key=value overrides]
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

from fedfusion.devices import load_catalog
from fedfusion.energy import price_work, train_flops
from fedfusion.models import build_target, load_tokenizer
from fedfusion.recipe import Recipe, load_recipe
from fedfusion.run_dir import read_jsonl
from fedfusion.slicing import extract, plan_slice

SELECTORS = ("random", "oort", "energy", "carbon_budget")
RESULTS = Path(__file__).resolve().parent / "results"
BASE = [  # a 0.1M-parameter target keeps 20 runs of 1,000 clients within an hour on 2 cores
    "population.num_clients=1000", "data.min_chars=250", "data.eval_chars=10000", "selection.clients_per_round=10",
    "train.local_steps=10", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=4",
    "model.intermediate_size=256", "model.num_layers=2", "availability.enabled=true", "availability.start_clock_s=7200",
    "output.save_model=false", "output.checkpoint_every=0",
]
BUDGET_SHARE = 0.5  # carbon_budget: every zone may spend half of what k average clients of the mix would


def mean_job_j(recipe: Recipe) -> float:
    """Predicted wall joules of one client job, averaged over the population mix (priced like the strategy)."""
    catalog, model = load_catalog(recipe.population.catalog), build_target(recipe.model, load_tokenizer(None), 0)
    state, tokens = model.state_dict(), recipe.train.local_steps * recipe.train.batch_size * recipe.train.seq_len
    total = 0.0
    for tier, share in recipe.population.mix.items():
        sub = extract(state, model.config, plan_slice(model.config, recipe.fusion.widths[tier], "static"))
        params, nbytes = sum(t.numel() for t in sub.values()), sum(t.nbytes for t in sub.values())
        total += share * price_work(catalog[tier], train_flops(params, tokens), nbytes, nbytes).wall_j
    return total / sum(recipe.population.mix.values())


def run(overrides: list[str], out: Path, reuse: bool) -> None:
    """One CLI run, unless ``reuse`` and a finished run is already in ``out``."""
    summary = out / "summary.json"
    if reuse and summary.is_file() and json.loads(summary.read_text()).get("status") == "ok":
        return
    cmd = [sys.executable, "-m", "fedfusion.cli", "run", "quickstart", *overrides, "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def to_target(rows: list[dict], target: float) -> dict:
    """Rounds, cumulative energy and CO2 until eval_loss first reaches ``target`` (None if never)."""
    energy = co2 = 0.0
    for row in rows:
        energy, co2 = energy + row["energy_j"], co2 + row["co2_g"]
        if row["round"] > 0 and row["eval_loss"] <= target:
            return {"rounds": row["round"], "energy_j": energy, "co2_g": co2}
    return {"rounds": None, "energy_j": None, "co2_g": None}


def _mean_sd(values: list[float | None], fmt: str = ".3g") -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "never"
    sd = statistics.stdev(got) if len(got) > 1 else 0.0
    missing = f" ({len(values) - len(got)} never)" if len(got) < len(values) else ""
    return f"{statistics.mean(got):{fmt}} ± {sd:{fmt}}{missing}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--work", default="runs/bench-selection")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs found in --work")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    settings = [*BASE, f"rounds={args.rounds}", *args.overrides]
    recipe = load_recipe("quickstart", settings)
    budget = BUDGET_SHARE * recipe.selection.clients_per_round * mean_job_j(recipe)
    options = {"random": [], "oort": [], "energy": [],
               "carbon_budget": [f"selection.options={{default_budget_j: {budget:.4f}}}"]}
    runs: dict[tuple[str, int], Path] = {}
    for seed in args.seeds:
        for sel in SELECTORS:
            out = Path(args.work) / f"{sel}-s{seed}"
            run([*settings, f"seed={seed}", f"selection.method={sel}", *options[sel]], out, args.reuse)
            runs[sel, seed] = out
            print(f"{sel} seed {seed}: done", flush=True)
    metrics = {key: read_jsonl(out / "metrics.jsonl") for key, out in runs.items()}
    random_rows = [metrics["random", s] for s in args.seeds]
    start = statistics.mean(rows[0]["eval_loss"] for rows in random_rows)
    plateau = statistics.mean(statistics.mean(r["eval_loss"] for r in rows[-3:]) for rows in random_rows)
    target = start - 0.95 * (start - plateau)
    table = []
    for (sel, seed), out in runs.items():
        rows, summary = metrics[sel, seed], json.loads((out / "summary.json").read_text())
        table.append({"selector": sel, "seed": seed, **to_target(rows, target),
                      "final_loss": rows[-1]["eval_loss"], "total_energy_j": summary["energy_j"],
                      "total_co2_g": summary["co2_g"], "wasted_j": summary["wasted_j"], "dropouts": summary["dropouts"],
                      "jain": summary["participation_jain"], "clients_ok": summary["clients_ok"], "run_dir": str(out)})
    report = {
        "benchmark": "selection",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {"recipe": "quickstart", "overrides": settings, "seeds": args.seeds,
                     "carbon_budget_j_per_zone_round": budget, "target_loss": target,
                     "target_rule": "95% of random's improvement from round 0 to its plateau (last 3 rounds, mean over seeds)"},
        "runs": table,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "selection.json").write_text(json.dumps(report, indent=2))
    lines = [
        "# Client selection on 1,000 virtual devices with diurnal availability", "",
        f"Machine: {report['machine']['platform']}, {report['machine']['cpus']} CPUs. Recipe: quickstart with "
        f"`{' '.join(settings)}`; seeds {args.seeds}. Energy and CO2 are priced from counted work on the device "
        f"catalog (not host time). Target loss {target:.4f} (95% of random's improvement {start:.3f} -> "
        f"{plateau:.3f}); carbon_budget: {budget:.1f} J per zone per round.", "",
        "| selector | rounds to target | energy to target (J) | CO2 to target (g) | final loss | wasted J | "
        "dropouts | Jain fairness |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for sel in SELECTORS:
        mine = [r for r in table if r["selector"] == sel]
        lines.append(
            f"| {sel} | {_mean_sd([r['rounds'] for r in mine])} | {_mean_sd([r['energy_j'] for r in mine])} | "
            f"{_mean_sd([r['co2_g'] for r in mine])} | {_mean_sd([r['final_loss'] for r in mine], '.4f')} | "
            f"{_mean_sd([r['wasted_j'] for r in mine])} | {_mean_sd([r['dropouts'] for r in mine])} | "
            f"{_mean_sd([r['jain'] for r in mine])} |")
    ratios = []
    for sel in SELECTORS[1:]:
        pairs = [(next(r for r in table if r["selector"] == sel and r["seed"] == s),
                  next(r for r in table if r["selector"] == "random" and r["seed"] == s)) for s in args.seeds]
        both = [(a, b) for a, b in pairs if a["rounds"] is not None and b["rounds"] is not None]
        if both:
            ratios.append(f"| {sel} | " + " | ".join(
                f"{statistics.mean(a[k] / b[k] for a, b in both):.2f}" for k in ("rounds", "energy_j", "co2_g"))
                + f" | {len(both)}/{len(pairs)} |")
    lines += ["", "Per-seed ratios to random (seeds where both reached the target):", "",
              "| selector | rounds | energy | CO2 | seeds |", "|---|---|---|---|---|", *ratios, ""]
    (RESULTS / "selection.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
