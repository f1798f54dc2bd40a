"""Benchmark: each way of training a SmolLM2-shaped target on a CPU device, its measured peak resident memory against
the planner's estimate (:func:`fedfusion.devices.memory.estimate_memory`, what ``fedfusion plan`` prices a tier with).

The arms are :mod:`cuda_windows`' (full fine-tuning with AdamW, a width slice, full-forward windows on an int8 or
int4 frozen target, window plus core, rank windows), each without and with activation checkpointing. Each arm runs in
a fresh process: after imports it records its resident memory, builds what the device holds from the strategy's own
payload (the whole target's state is freed and trimmed before training), resets the kernel's peak-RSS counter
(``/proc/self/clear_refs``) and trains; peak = the process's high-water mark minus its memory after imports, so it
counts what the planner counts (weights, gradients, AdamW state, activations, logits) plus the allocator's and
autograd's overheads, which the planner leaves to its ``usable`` margin. Random weights (memory does not depend on
them), random token ids, one thread. Writes ``benchmarks/results/cpu_memory.{json,md}``.

    python benchmarks/cpu_memory.py [--shape 135m] [--arms full slice window ...] [--batch 4] [--seq 64] [--steps 2]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
from pathlib import Path

import torch
from cuda_lora import SHAPES, shape_config
from cuda_windows import arm_model, planned
from results_files import run_facts, write_pair

from fedfusion.models.families import family_of
from fedfusion.train.loop import train_steps

MB = 2**20
ARMS = ["full", "slice", "window", "window-expanded", "window-int4", "core", "rank"]
GOAL = 0.15  # the planner's estimate within 15 % of the measured peak


def status_kb(field: str) -> int:
    """VmRSS or VmHWM of this process, in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def one_arm(arm: str, shape: str, a: argparse.Namespace, checkpoint: bool) -> dict:
    """Measure one arm in this process (called in a fresh one by :func:`main`)."""
    torch.set_num_threads(1)
    base = status_kb("VmRSS")
    cfg = shape_config(shape)
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in family_of(cfg).build(cfg).state_dict().items()}
    model, trainable = arm_model(arm, cfg, state, a.width, a.rank)
    trainable = trainable or sum(p.numel() for p in model.parameters())
    del state
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    held = status_kb("VmRSS") - base
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from the resident set now
    data = torch.randint(0, cfg.vocab_size, (64, a.seq + 1))
    out = train_steps(model, data, steps=a.steps, lr=1e-4, batch_size=a.batch, seed=0, checkpoint=checkpoint)
    peak = status_kb("VmHWM") - base
    plan = planned(arm, cfg, trainable, a.width, a.batch, a.seq, checkpoint)
    return {"arm": arm, "checkpoint": checkpoint, "trainable": trainable, "held_mb": held / 1024, "peak_mb": peak / 1024,
            "planned_mb": plan / MB, "planned_over_peak": plan / MB / (peak / 1024), "loss": out.loss}


def report(data: dict) -> str:
    s = data["settings"]
    rows = data["rows"]
    within = sum(abs(r["planned_over_peak"] - 1) <= GOAL for r in rows)
    lines = [f"# Training memory on a CPU device: measured peak RSS against the planner ({s['shape']})", "",
             f"Machine: {data['machine']}, torch {data['torch']}. Batch {s['batch']} x {s['seq']} tokens, window width "
             f"{s['width']}, rank {s['rank']}, {s['steps']} AdamW steps on one thread, float32 compute; a random-weight "
             f"Llama of SmolLM2-{s['shape']}'s shape; each arm in a fresh process.", "",
             f"Command: `{data['command']}`", *([f"Command: `{data['rendered_by']}`", "", "The planned column was "
                                                 "recomputed by the second command with the planner of the commit that "
                                                 "wrote this file; the measured columns are the first's."]
                                                if data.get("rendered_by") else []), "",
             "| arm | activation checkpointing | trainable | held MiB | peak MiB | planned MiB | planned / peak |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {'on' if r['checkpoint'] else 'off'} | {r['trainable'] / 1e6:.2f} M | "
                     f"{r['held_mb']:.0f} | {r['peak_mb']:.0f} | {r['planned_mb']:.0f} | {r['planned_over_peak']:.2f} |")
    lines += ["", f"**{within} of {len(rows)} estimates within {GOAL:.0%} of the measured peak.** Held: resident after "
              "the device's model was built and the whole target's state freed; peak: the high-water mark while "
              "training; both above the process's memory after imports. Planned: `fedfusion.devices.memory."
              "estimate_memory` with the arm's arguments (`benchmarks/cuda_windows.py`'s `planned`)."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="135m", choices=list(SHAPES))
    parser.add_argument("--arms", nargs="+", default=ARMS, choices=ARMS)
    parser.add_argument("--width", type=float, default=0.125)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--checkpoint", choices=["off", "on", "both"], default="both")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--replan", type=Path, default=None,
                        help="recompute the planned column of this results JSON with today's planner (measures nothing)")
    parser.add_argument("--one", nargs=2, metavar=("ARM", "CHECKPOINT"), default=None,
                        help="internal: measure one arm (checkpoint 0 or 1) in this process and print its row as JSON")
    return parser


def main() -> None:
    a = build_parser().parse_args()
    if a.replan is not None:
        data = json.loads(a.replan.read_text())
        s = data["settings"]
        for r in data["rows"]:
            r["planned_mb"] = planned(r["arm"], shape_config(s["shape"]), r["trainable"], s["width"], s["batch"], s["seq"],
                                      r["checkpoint"]) / MB
            r["planned_over_peak"] = r["planned_mb"] / r["peak_mb"]
        data["rendered_by"] = f"python benchmarks/cpu_memory.py --replan {a.replan}"
        write_pair(a.out_dir, "cpu_memory", data, report(data))
        return
    if a.one is not None:
        print(json.dumps(one_arm(a.one[0], a.shape, a, a.one[1] == "1")))
        return
    facts = run_facts("benchmarks/cpu_memory.py", sys.argv[1:])
    rows = []
    flags = [f"--shape={a.shape}", f"--width={a.width}", f"--rank={a.rank}", f"--batch={a.batch}", f"--seq={a.seq}",
             f"--steps={a.steps}"]
    for checkpoint in {"off": [False], "on": [True], "both": [False, True]}[a.checkpoint]:
        for arm in a.arms:
            done = subprocess.run([sys.executable, __file__, *flags, "--one", arm, str(int(checkpoint))],
                                  capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    settings = {k: getattr(a, k) for k in ("shape", "width", "rank", "batch", "seq", "steps", "checkpoint")}
    data = {**facts, "settings": settings, "rows": rows}
    write_pair(a.out_dir, "cpu_memory", data, report(data))


if __name__ == "__main__":
    main()
