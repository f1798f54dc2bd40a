"""On-device training programs for the rolling recipe's tiers: export time, program and weight-file sizes, steps per
second through the ExecuTorch runtime (client-code AdamW) against eager torch on the same slice and batches, and
how far the two drift apart.

For each tier: the tier's slice of a seeded ``RECIPE`` target (rolling plan, round 3), the recipe's batch
(16 x 64 tokens), ``STEPS`` AdamW steps each way from the same weights on client 0's Shakespeare windows, both on
one CPU thread. Writes benchmarks/results/device_runtime.{json,md}. Needs the [device] extra.

    python benchmarks/device_runtime.py [TIER ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from pathlib import Path

import torch

from fedfusion.config.recipe import load_recipe
from fedfusion.data.population import client_windows, data_spec
from fedfusion.data.text import load_tokenizer
from fedfusion.models.build import build_target, model_from_state
from fedfusion.models.slicing import extract, plan_slice, sub_config
from fedfusion.phone.commands import export_tier
from fedfusion.phone.runtime import ProgramRunner, train_program
from fedfusion.train.loop import train_steps

# results measured on the rolling slices (the quickstart's recipe until it switched to growth); phones' programs run it
RECIPE = "rolling"
STEPS, SEED, LR = 20, 7, 3e-3
OUT = Path(__file__).parent / "results"


def machine() -> str:
    """CPU model, core count, load average (other work on the machine slows the timings), versions."""
    model = platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    from executorch.version import __version__ as et

    return (f"{model}, {os.cpu_count()} logical CPUs, load average {os.getloadavg()[0]:.1f}, "
            f"torch {torch.__version__}, executorch {et}, Python {platform.python_version()}")


def tier_row(recipe, tier: str, target, windows: torch.Tensor) -> dict:
    program = export_tier(recipe, tier)
    plan = plan_slice(target.config, recipe.fusion.widths[tier], "rolling", 3, recipe.fusion.stride)
    state, config = extract(target.state_dict(), target.config, plan), sub_config(target.config, plan)
    runner = ProgramRunner(program)
    runner.load(state)
    mine = train_program(runner, windows, STEPS, LR, recipe.train.batch_size, SEED)
    model = model_from_state(config, state)
    theirs = train_steps(model, windows, STEPS, LR, recipe.train.batch_size, SEED)
    trained = dict(model.named_parameters())
    moved = torch.cat([(runner.params[k] - state[k]).flatten() for k in state])
    expected = torch.cat([(trained[k].detach() - state[k]).flatten() for k in state])
    return {
        "tier": tier, "width": recipe.fusion.widths[tier], "params": sum(v.numel() for v in state.values()),
        "export_s": program.manifest["export_s"], "pte_bytes": len(program.pte), "ptd_bytes": len(program.ptd),
        "runtime_steps_per_s": STEPS / mine.seconds, "torch_steps_per_s": STEPS / theirs.seconds,
        "mean_loss_runtime": mine.loss, "mean_loss_torch": theirs.loss,
        "first_loss": mine.losses[0], "last_loss": mine.losses[-1],
        "relative_update_error": float((moved - expected).norm() / expected.norm()),
        "max_abs_weight_diff": float((moved - expected).abs().max()),
    }


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tiers", nargs="*", help="tiers to export and time (default: every tier of the recipe)")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    torch.set_num_threads(1)
    recipe = load_recipe(RECIPE)
    target = build_target(recipe.model, load_tokenizer(None), recipe.seed)
    windows = client_windows(data_spec(recipe.data_source()), 0, recipe.train.seq_len, "train")
    tiers = args.tiers or list(recipe.fusion.widths)
    rows = [tier_row(recipe, tier, target, windows) for tier in tiers]
    result = {"command": shlex.join(["python", "benchmarks/device_runtime.py", *sys.argv[1:]]), "machine": machine(),
              "recipe": RECIPE, "steps": STEPS, "lr": LR, "batch": recipe.train.batch_size,
              "seq_len": recipe.train.seq_len, "threads": 1, "rows": rows}
    OUT.mkdir(exist_ok=True)
    (OUT / "device_runtime.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# On-device training programs ({RECIPE} tiers)\n\n{result['machine']}; {STEPS} AdamW steps, batch "
             f"{result['batch']} x {result['seq_len']} tokens, 1 thread.\n", f"Command: `{result['command']}`\n",
             "| tier | width | params | export s | .pte bytes | .ptd bytes | runtime steps/s | torch steps/s | "
             "loss first -> last | mean loss runtime / torch | rel. update error | max abs weight diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tier']} | {r['width']} | {r['params']:,} | {r['export_s']:.1f} | {r['pte_bytes']:,} | "
                     f"{r['ptd_bytes']:,} | {r['runtime_steps_per_s']:.2f} | {r['torch_steps_per_s']:.2f} | "
                     f"{r['first_loss']:.4f} -> {r['last_loss']:.4f} | {r['mean_loss_runtime']:.6f} / "
                     f"{r['mean_loss_torch']:.6f} | {r['relative_update_error']:.2e} | {r['max_abs_weight_diff']:.2e} |")
    (OUT / "device_runtime.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
