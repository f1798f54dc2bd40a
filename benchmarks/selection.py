"""Benchmark: client selectors side by side on 1,000 virtual devices with diurnal availability.

Every (selector, seed) is one real `fedfusion run RECIPE` (Flower simulation engine) of the quickstart task on
a population of 1,000 Shakespeare speakers (phones, laptops, desktops in the quickstart mix), with the
availability model on. Choices fixed before any comparison:

- **Priced work.** A 0.14M-parameter target keeps 20 runs within the time budget, but its jobs would last
  milliseconds, so no device would ever leave its window mid-job. Work is therefore priced as if the
  target had ``VIRTUAL_PARAMS`` parameters (a TinyLlama-1.1B-class model, same tokens per job): every
  catalog tier's TFLOPS and link rates are divided by ``VIRTUAL_PARAMS / real params`` (a catalog file
  written next to the runs). FLOPs and bytes both scale with parameters, so this is exact pricing of the
  bigger model's jobs (minutes long); ratios between tiers, and so between selectors, are unchanged.
- **Dropouts.** Bonawitz et al. (SysML'19, "Towards federated learning at scale") report 6-10% of
  selected devices dropping out per round; ``interrupt_per_h=1`` makes an average (~5 min) job drop
  about 8% of the time (window ends and unplugged laptops' batteries add a little), longer jobs more.
  A dropped client's planned work is charged as wasted energy.
- **Target.** Fixed from the random selector alone: the eval loss at which random has made
  ``TARGET_SHARE`` of its improvement from round 0 to its plateau (mean of its last 3 rounds, mean over
  seeds). Fewer local steps (3) than ``RECIPE``'s 40 make learning take several rounds.

For each run: rounds, energy and CO2 until the target is first reached, wasted energy, dropouts and
Jain's participation fairness; per-seed ratios to random. Writes ``benchmarks/results/selection.{json,md}``.

    python benchmarks/selection.py [--seeds 0 1 2 3 4] [--rounds 20] [--reuse] [extra key=value overrides]
    python benchmarks/selection.py --no-run   # tables from the seeds already finished in --work
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import yaml

from fedfusion.analysis.report import read_jsonl
from fedfusion.config.recipe import Recipe, load_recipe
from fedfusion.data.text import load_tokenizer
from fedfusion.devices.catalog import load_catalog
from fedfusion.devices.energy import price_work, train_flops
from fedfusion.models.build import build_target
from fedfusion.models.slicing import extract, plan_slice

# results measured on the rolling slices (the quickstart's recipe until it switched to growth); selection runs on it
RECIPE = "rolling"
SELECTORS = ("random", "oort", "energy", "carbon_budget")
RESULTS = Path(__file__).resolve().parent / "results"
BASE = [  # a 0.14M-parameter target keeps 20 runs of 1,000 clients near an hour on 2 cores
    "population.num_clients=1000", "data.min_chars=250", "data.eval_chars=10000", "selection.clients_per_round=10",
    "train.local_steps=3", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=4",
    "model.intermediate_size=256", "model.num_layers=2", "availability.enabled=true", "availability.start_clock_s=7200",
    "availability.model={interrupt_per_h: 1.0}", "output.save_model=false", "output.checkpoint_every=0",
]
VIRTUAL_PARAMS = 1.1e9  # jobs are priced as if the target had this many parameters
TARGET_SHARE = 0.95
BUDGET_SHARE = 0.5  # carbon_budget: every zone may spend half of what k average clients of the mix would
GOAL = {"energy_j": 0.7, "co2_g": 0.7, "rounds": 1.1}  # the goal: energy vs random
READING = "## Reading"  # a section written by hand at the end of selection.md, kept when the tables are rewritten


def target_params(recipe: Recipe) -> int:
    """Parameters of the recipe's (full) target."""
    model = build_target(recipe.model, load_tokenizer(None), 0)
    return sum(t.numel() for t in model.state_dict().values())


def scaled_catalog(recipe: Recipe, scale: float, path: Path) -> Path:
    """Write the recipe's catalog with every tier's TFLOPS and link rates divided by ``scale``."""
    tiers = {}
    for name, device in load_catalog(recipe.population.catalog).items():
        fields = {k: v for k, v in asdict(device).items() if k != "name"}
        fields.update(tflops=device.tflops / scale, up_mbps=device.up_mbps / scale,
                      down_mbps=device.down_mbps / scale,
                      sources=f"{device.sources} Benchmark pricing: tflops and link rates divided by {scale:.1f}.")
        tiers[name] = fields
    text = yaml.safe_dump(tiers, sort_keys=False)
    if not path.is_file() or path.read_text() != text:  # runs in progress may be reading it
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path


def tier_costs(recipe: Recipe) -> dict[str, dict[str, float]]:
    """One client job per tier priced like the strategy does (its static sub-model, down and up)."""
    catalog, model = load_catalog(recipe.population.catalog), build_target(recipe.model, load_tokenizer(None), 0)
    state, tokens = model.state_dict(), recipe.train.local_steps * recipe.train.batch_size * recipe.train.seq_len
    costs = {}
    for tier in recipe.population.mix:
        sub = extract(state, model.config, plan_slice(model.config, recipe.fusion.widths[tier], "static"))
        params, nbytes = sum(t.numel() for t in sub.values()), sum(t.nbytes for t in sub.values())
        cost = price_work(catalog[tier], train_flops(params, tokens), nbytes, nbytes)
        costs[tier] = {"virtual_s": cost.virtual_s, "energy_j": cost.wall_j, "co2_g": cost.co2_g}
    return costs


def run(overrides: list[str], out: Path, reuse: bool) -> None:
    """One CLI run, unless ``reuse`` and a finished run of the same recipe is already in ``out``."""
    if reuse and _finished(out):
        if load_recipe(out / "recipe.yaml") != load_recipe(RECIPE, overrides):
            raise SystemExit(f"{out} holds a run of another recipe; choose another --work")
        return
    if out.exists():  # an unfinished (or, without --reuse, an earlier) run
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "fedfusion.cli", "run", RECIPE, *overrides, "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def _finished(out: Path) -> bool:
    summary = out / "summary.json"
    return summary.is_file() and json.loads(summary.read_text()).get("status") == "ok"


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


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or base is None else value / base


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--work", default="runs/bench-selection-v2")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs found in --work")
    parser.add_argument("--selectors", nargs="+", default=list(SELECTORS), choices=SELECTORS)
    parser.add_argument("--no-run", action="store_true",
                        help="start no run: report the seeds whose runs of every selector are finished in --work")
    parser.add_argument("overrides", nargs="*")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    settings = [*BASE, f"rounds={args.rounds}", *args.overrides]
    recipe = load_recipe(RECIPE, settings)
    params = target_params(recipe)
    scale = VIRTUAL_PARAMS / params
    catalog = scaled_catalog(recipe, scale, Path(args.work).resolve() / f"catalog-x{scale:.0f}.yaml")
    settings.append(f"population.catalog={catalog}")  # absolute: the runs' Ray actors need not share this cwd
    shown = [*settings[:-1], f"population.catalog={os.path.relpath(catalog)}"]  # what the results say: no machine path
    recipe = replace(recipe, population=replace(recipe.population, catalog=str(catalog)))
    costs = tier_costs(recipe)
    mix = recipe.population.mix
    mean_job_j = sum(mix[t] * costs[t]["energy_j"] for t in mix) / sum(mix.values())
    budget = BUDGET_SHARE * recipe.selection.clients_per_round * mean_job_j
    options = {"random": [], "oort": [], "energy": [],
               "carbon_budget": [f"selection.options={{default_budget_j: {budget:.4f}}}"]}
    runs: dict[tuple[str, int], Path] = {}
    for seed in args.seeds:
        for sel in args.selectors:
            out = Path(args.work) / f"{sel}-s{seed}"
            if not args.no_run:
                run([*settings, f"seed={seed}", f"selection.method={sel}", *options[sel]], out, args.reuse)
                print(f"{sel} seed {seed}: done", flush=True)
            runs[sel, seed] = out
    if args.no_run:
        done = [s for s in args.seeds if all(_finished(runs[sel, s]) for sel in args.selectors)]
        if not done:
            raise SystemExit(f"no seed has finished runs of every selector in {args.work}")
        args.seeds, runs = done, {(sel, s): out for (sel, s), out in runs.items() if s in done}
    if "random" not in args.selectors:
        return
    metrics = {key: read_jsonl(out / "metrics.jsonl") for key, out in runs.items()}
    random_rows = [metrics["random", s] for s in args.seeds]
    start = statistics.mean(rows[0]["eval_loss"] for rows in random_rows)
    plateau = statistics.mean(statistics.mean(r["eval_loss"] for r in rows[-3:]) for rows in random_rows)
    target = start - TARGET_SHARE * (start - plateau)
    table = []
    for (sel, seed), out in runs.items():
        rows, summary = metrics[sel, seed], json.loads((out / "summary.json").read_text())
        clients = read_jsonl(out / "clients.jsonl")
        table.append({
            "selector": sel, "seed": seed, **to_target(rows, target), "final_loss": rows[-1]["eval_loss"],
            "rounds_run": rows[-1]["round"], "total_energy_j": summary["energy_j"], "total_co2_g": summary["co2_g"],
            "wasted_j": summary["wasted_j"], "dropouts": summary["dropouts"], "picked": len(clients),
            "picked_by_tier": {t: sum(c["device"] == t for c in clients) for t in mix},
            "jain": summary["participation_jain"], "clients_ok": summary["clients_ok"], "wall_s": summary["wall_s"],
            "run_dir": str(out)})
    by = {(r["selector"], r["seed"]): r for r in table}
    ratios = {}
    for sel in args.selectors:
        if sel == "random":
            continue
        ratios[sel] = {seed: {k: _ratio(by[sel, seed][k], by["random", seed][k]) for k in GOAL}
                       for seed in args.seeds}
    report = {
        "command": shlex.join(["python", "benchmarks/selection.py", *sys.argv[1:]]),
        "benchmark": "selection",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {"recipe": RECIPE, "overrides": shown, "seeds": args.seeds, "target_params": params,
                     "virtual_params": VIRTUAL_PARAMS, "price_scale": scale, "tier_costs": costs,
                     "carbon_budget_j_per_zone_round": budget, "target_loss": target,
                     "target_rule": f"{TARGET_SHARE:.0%} of random's improvement from round 0 to its plateau "
                                    "(last 3 rounds, mean over seeds)", "goal_vs_random": GOAL},
        "runs": table,
        "ratios_to_random": ratios,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "selection.json").write_text(json.dumps(report, indent=2))
    job = ", ".join(f"{t} {c['virtual_s'] / 60:.1f} min / {c['energy_j']:.0f} J / {c['co2_g']:.3g} g"
                    for t, c in costs.items())
    lines = [
        "# Client selection on 1,000 virtual devices with diurnal availability", "",
        f"Machine: {report['machine']['platform']}, {report['machine']['cpus']} CPUs. Recipe: {RECIPE} with "
        f"`{' '.join(shown)}`; seeds {args.seeds}. The target has {params:,} parameters; jobs are priced "
        f"from counted work as if it had {VIRTUAL_PARAMS:.3g} (catalog rates / {scale:.0f}); one job: {job}. "
        f"Target loss {target:.4f} ({TARGET_SHARE:.0%} of random's improvement {start:.3f} -> {plateau:.3f}); "
        f"carbon_budget: {budget:.0f} J per zone per round.", "", f"Command: `{report['command']}`", "",
        "| selector | rounds to target | energy to target (J) | CO2 to target (g) | final loss | wasted J | "
        "dropouts (of picks) | Jain fairness | picks phone/laptop/desktop | J per round | g per round |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for sel in args.selectors:
        mine = [r for r in table if r["selector"] == sel]
        tiers = "/".join(f"{statistics.mean(r['picked_by_tier'][t] for r in mine):.0f}" for t in mix)
        lines.append(
            f"| {sel} | {_mean_sd([r['rounds'] for r in mine])} | {_mean_sd([r['energy_j'] for r in mine])} | "
            f"{_mean_sd([r['co2_g'] for r in mine])} | {_mean_sd([r['final_loss'] for r in mine], '.4f')} | "
            f"{_mean_sd([r['wasted_j'] for r in mine])} | {_mean_sd([r['dropouts'] for r in mine])} "
            f"({sum(r['dropouts'] for r in mine) / max(1, sum(r['picked'] for r in mine)):.1%}) | "
            f"{_mean_sd([r['jain'] for r in mine])} | {tiers} | "
            f"{_mean_sd([r['total_energy_j'] / r['rounds_run'] for r in mine])} | "
            f"{_mean_sd([r['total_co2_g'] / r['rounds_run'] for r in mine])} |")
    fmt = lambda v: "never" if v is None else f"{v:.2f}"  # noqa: E731
    lines += ["", "Per-seed ratios to random (rounds / energy / CO2 to target; never: one of the two did not "
              "reach it):", "", "| selector | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean | goal met |",
              "|---|" + "---|" * (len(args.seeds) + 2)]
    for sel, per_seed in ratios.items():
        cells = [" / ".join(fmt(per_seed[s][k]) for k in ("rounds", "energy_j", "co2_g")) for s in args.seeds]
        both = [v for v in per_seed.values() if v["rounds"] is not None]
        mean = {k: statistics.mean(v[k] for v in both) for k in GOAL} if both else None
        met = (f"{sum(all(v[k] <= GOAL[k] for k in GOAL) for v in both)}/{len(args.seeds)} seeds; "
               f"mean {'yes' if mean and all(mean[k] <= GOAL[k] for k in GOAL) else 'no'}")
        mean_cell = " / ".join(fmt(mean[k]) for k in ("rounds", "energy_j", "co2_g")) if mean else "never"
        lines.append(f"| {sel} | " + " | ".join(cells) + f" | {mean_cell} | {met} |")
    lines += ["", f"Goal: `energy` at most {GOAL['energy_j']}x the energy and {GOAL['co2_g']}x the CO2 "
              f"of `random`, in at most {GOAL['rounds']}x the rounds.", ""]
    md = RESULTS / "selection.md"
    kept = md.read_text().split(READING, 1)[1] if md.is_file() and READING in md.read_text() else ""
    md.write_text("\n".join(lines) + (f"\n{READING}{kept}" if kept else ""))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
