"""Benchmark: what a full-forward window step costs on a CPU device against the whole target's step, side by side.

A window step runs the whole target's forward pass and its activation gradients (every layer holds window units)
but only the window's weight gradients and AdamW state, so it should cost clearly less than training the whole
target (the goal: at most 0.8x). Per target, on the same batches, one thread (a simulated client's ``cpus_per_client: 1``):

- ``full``: the whole target trained with AdamW (the oracle's device);
- ``window``: the recipe's window of the weakest tier's width on the frozen target kept as it travelled
  (:mod:`fedfusion.models.frozen`: each int8 matrix made float32 in the forward pass and again in backward);
- ``window-expanded``: the same window where the device's memory holds the frozen target in float32
  (``WindowSpec.expand``, what the plan gives such a tier): each matrix made float32 once, the window written into
  it in place at each pass;
- ``core``, ``core-expanded``: the window plus the smallest width's units (``fusion.window_core``; the quickstart's
  arm), narrow and expanded;
- ``no-window``: the whole target in float32 with every layer's matrix frozen, so no matrix gets a weight gradient,
  and what a window shares trainable (embeddings, norms and head with shared tensors; else only the norms, so the
  backward still reaches every layer, as a window's does). Every window step does at least this work (its forward
  and its activation gradients): the floor of any window, and how far the goal can be reached on a target.

Targets: ``quickstart`` (the recipe's 1.1M-parameter Llama, batch 16 x 64 characters) and ``smollm2`` (a random-weight
Llama of SmolLM2-135M's shape, the finetune recipe's batch 4 x 32 tokens, heads and neurons, no shared tensors).
Arms are interleaved: each repetition times ``--steps`` steps of every arm in turn, so a change of load touches them
alike; a step's time is the median over repetitions, the ratio's spread the range of the per-repetition ratios. The
window arm's torch profiler table (self CPU time per operator) is written beside the numbers.

    python benchmarks/window_step.py [--targets quickstart smollm2] [--steps 4] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from cuda_lora import shape_config
from results_files import run_facts, write_pair
from torch.profiler import profile

from fedfusion.config.recipe import load_recipe
from fedfusion.fusion.base import Client
from fedfusion.fusion.plan import recipe_target
from fedfusion.fusion.submodel.method import SubModelMethod
from fedfusion.models.build import model_from_state
from fedfusion.models.families import family_of
from fedfusion.models.full_forward import from_payload, window_axes
from fedfusion.train.loop import train_steps
from fedfusion.wire.keys import FROZEN
from fedfusion.wire.quantize import decode
from fedfusion.wire.specs import WindowSpec

ARMS = ["full", "window", "window-expanded", "core", "core-expanded", "no-window"]
GOAL = 0.8  # a window step at most this share of the whole target's step


def setting(name: str) -> dict:
    """A target's config, batch and the recipe's window settings (the weakest tier's width)."""
    recipe = load_recipe({"quickstart": "quickstart", "smollm2": "finetune"}[name])
    f = recipe.fusion
    config = shape_config("135m") if name == "smollm2" else recipe_target(recipe.model, recipe.data_source())
    axes = tuple(f.axes) if f.axes else None
    return {"config": config, "batch": recipe.train.batch_size, "seq": recipe.train.seq_len,
            "width": min(f.widths.values()), "axes": axes, "window_axes": window_axes(config, axes),
            "shared": f.window_shared, "frozen": f.frozen_dtype}


def arm_model(arm: str, s: dict, state: dict) -> torch.nn.Module:
    """What a device of ``arm`` trains, built from the strategy's own payload as the client app builds it."""
    if arm in ("full", "no-window"):
        model = model_from_state(s["config"], state)
        for name, p in model.named_parameters():  # no-window: freeze the layers' matrices (and, unshared, all 2-D)
            if arm == "no-window" and p.dim() > 1 and (".layers." in name or not s["shared"]):
                p.requires_grad_(False)
        return model
    method = SubModelMethod(s["config"], {"t": s["width"]}, state, forward="full", frozen=s["frozen"], scale=False,
                            policy="rolling", axes=s["axes"], window_shared=s["shared"],
                            window_core=arm.startswith("core"),
                            expand=frozenset({"t"}) if arm.endswith("-expanded") else frozenset())
    payload = method.payloads(2, state, [Client(partition=0, tier="t", seed=7)])[0]
    return from_payload(s["config"], decode(payload.arrays, keep=FROZEN), WindowSpec.from_config(payload.spec), 7)


def measure(name: str, a: argparse.Namespace) -> dict:
    s = setting(name)
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in family_of(s["config"]).build(s["config"]).state_dict().items()}
    data = torch.randint(0, s["config"].vocab_size, (max(64, 4 * s["batch"]), s["seq"] + 1))
    models = {arm: arm_model(arm, s, state) for arm in a.arms}
    kw = {"lr": 1e-4, "batch_size": s["batch"]}
    for model in models.values():
        train_steps(model, data, steps=1, seed=0, **kw)  # warm-up
    times: dict[str, list[float]] = {arm: [] for arm in models}
    for rep in range(a.reps):
        for arm, model in models.items():
            start = time.perf_counter()
            train_steps(model, data, steps=a.steps, seed=1 + rep, **kw)
            times[arm].append((time.perf_counter() - start) / a.steps)
            print(f"{name} {arm} rep {rep}: {1000 * times[arm][-1]:.1f} ms/step", flush=True)
    with profile() as prof:
        train_steps(models["window"], data, steps=a.steps, seed=99, **kw)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40)
    trainable = {arm: sum(p.numel() for p in m.parameters() if p.requires_grad) for arm, m in models.items()}
    rows = []
    for arm in models:
        ratios = [t / f for t, f in zip(times[arm], times["full"])]
        rows.append({"arm": arm, "trainable": trainable[arm], "step_ms": 1000 * statistics.median(times[arm]),
                     "times_ms": [1000 * t for t in times[arm]], "ratio": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios)})
    return {"target": name, "params": family_of(s["config"]).param_count(s["config"]), "batch": s["batch"], "seq": s["seq"],
            "width": s["width"], "axes": list(s["window_axes"]), "shared": s["shared"], "frozen": s["frozen"],
            "rows": rows, "profile_window": table}


def report(data: dict) -> str:
    st = data["settings"]
    lines = ["# A full-forward window step against the whole target's step on a CPU device", "",
             f"Machine: {data['machine']}, torch {data['torch']}; 1-minute load before: {data['load_before']}. One "
             f"thread; {st['steps']} AdamW steps per arm per repetition, {st['reps']} repetitions, arms interleaved; "
             "random weights, random token ids.", "",
             "| target | params | batch | window | arm | trainable | ms / step (median) | / full (median, range) |",
             "|---|---|---|---|---|---|---|---|"]
    for t in data["targets"]:
        window = f"{t['width']:g} of {'+'.join(t['axes'])}, {t['frozen']}" + (
            ", shared tensors" if t["shared"] else "")
        for r in t["rows"]:
            lines.append(f"| {t['target']} | {t['params'] / 1e6:.2f} M | {t['batch']} x {t['seq']} | {window} | "
                         f"{r['arm']} | {r['trainable'] / 1e6:.3f} M | {r['step_ms']:.1f} | "
                         f"{r['ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) |")
    lines += ["", f"Goal: a window step <= {GOAL}x the whole target's step. full: the whole target with AdamW; window: "
              "the weakest tier's window on the int8 frozen target (each matrix made float32 per layer, forward and "
              "backward); window-expanded: the same window on the target made float32 once (`WindowSpec.expand`, "
              "where the tier's memory holds it); core, core-expanded: the window plus the smallest width's units "
              "(the quickstart's `fusion.window_core`); no-window: the whole target with no matrix of its layers "
              "trained (what a window shares still trained): the work every window step does at least, its forward and "
              "its activation gradients, so the floor of any window's ratio on that target."]
    for t in data["targets"]:
        lines += ["", f"Profile of the window arm on {t['target']} (torch profiler, {st['steps']} steps, self CPU time):",
                  "", "```", t["profile_window"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="+", default=["quickstart", "smollm2"], choices=["quickstart", "smollm2"])
    parser.add_argument("--arms", nargs="+", default=ARMS, choices=ARMS)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    return parser


def main() -> None:
    a = build_parser().parse_args()
    if "full" not in a.arms or "window" not in a.arms:
        raise SystemExit("--arms: full and window are needed (the ratio and the profile)")
    torch.set_num_threads(1)
    facts = run_facts("benchmarks/window_step.py", sys.argv[1:])
    targets = [measure(name, a) for name in a.targets]
    data = {**facts, "settings": {"steps": a.steps, "reps": a.reps, "arms": a.arms}, "targets": targets}
    write_pair(a.out_dir, "window_step", data, report(data))


if __name__ == "__main__":
    main()
