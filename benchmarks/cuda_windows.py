"""Benchmark (needs a CUDA GPU): what a full-forward window really costs a device, measured against the planner.

The knowledge benchmark's memory ratio (a device's peak training memory against the whole target trained with
AdamW) is the planner's estimate (:func:`fedfusion.devices.memory.estimate_memory`). This measures it. Per target
shape and arm: the peak CUDA memory of training (``torch.cuda.max_memory_allocated`` above the allocation before
the model moved to the GPU) next to the planner's estimate, and the time of a step. Arms, all AdamW in float32:

- ``full``: the whole target (the oracle's device);
- ``slice``: a width slice of ``--width`` trained in its own small forward pass (width slicing's device);
- ``window``: a full-forward window of ``--width`` of the units on the frozen target kept as it travelled
  (:mod:`fedfusion.models.frozen`: int8 / int4 matrices, float32 one layer at a time);
- ``window-dense``: the same int8 payload decoded to a float32 target first (what a device held before
  :mod:`fedfusion.models.frozen`);
- ``core``: a window plus the smallest width's units (``fusion.window_core``); ``rank``: rank-r updates of every
  matrix (``fusion.window_rank``);

each without and with activation checkpointing (``train.checkpoint``).

Targets are randomly initialised Llamas of SmolLM2-135M's and -360M's shapes (weights do not change memory or
speed); batches are random token ids. Payloads come from the strategy's own :class:`SubModelMethod` (round 2,
rolling), decoded as the client app decodes them.

    python benchmarks/cuda_windows.py [--shapes 135m 360m] [--width 0.125] [--batch 8] [--seq 256] [--steps 5]
        [--checkpoint off|on|both] [--out-dir benchmarks/results]
    python benchmarks/cuda_windows.py --replan benchmarks/results/cuda_windows.json   # no GPU: today's planner
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from pathlib import Path

import torch
from cuda_lora import SHAPES, shape_config  # SmolLM2's shapes, as the LoRA benchmark uses them
from transformers import LlamaConfig

from fedfusion.devices.memory import estimate_memory
from fedfusion.fusion.base import Client
from fedfusion.fusion.submodel.method import SubModelMethod
from fedfusion.fusion.submodel.plan import frozen_window_memory, rank_dense_bytes
from fedfusion.models.build import config_aliases, model_from_state, wire_state
from fedfusion.models.families import family_of
from fedfusion.models.full_forward import from_payload
from fedfusion.models.low_rank import split
from fedfusion.models.slicing import extract, plan_slice, sub_config
from fedfusion.train.loop import train_steps
from fedfusion.wire.keys import FROZEN
from fedfusion.wire.quantize import decode
from fedfusion.wire.specs import WindowSpec

MB = 2**20


def arm_model(arm: str, cfg: LlamaConfig, state: dict, width: float, rank: int) -> tuple[torch.nn.Module, int]:
    """The model a device of ``arm`` trains (on the CPU) and the planner's peak estimate's arguments' window."""
    if arm == "full":
        return model_from_state(cfg, state), 0
    if arm == "slice":
        plan = plan_slice(cfg, width, "static")
        return model_from_state(sub_config(cfg, plan), extract(state, cfg, plan)), 0
    frozen = {"window": "int8", "window-dense": "int8", "window-int4": "int4", "core": "int8", "rank": "int8",
              "window-expanded": "int8"}[arm]
    method = SubModelMethod(cfg, {"small": width, "t": width}, state, forward="full", frozen=frozen, scale=False,
                            policy="rolling", window_core=arm == "core", window_rank=rank if arm == "rank" else 0,
                            expand=frozenset({"t"}) if arm == "window-expanded" else frozenset())
    payload = method.payloads(2, state, [Client(partition=0, tier="t", seed=7)])[0]
    received = decode(payload.arrays) if arm == "window-dense" else decode(payload.arrays, keep=FROZEN)
    model = from_payload(cfg, received, WindowSpec.from_config(payload.spec), 7)
    model.message = received  # held while the device trains, as the client app holds its message (expanded: a copy)
    return model, sum(p.numel() for p in model.parameters())


def planned(arm: str, cfg: LlamaConfig, trainable: int, width: float, batch: int, seq: int, checkpoint: bool) -> int:
    if arm == "full":
        return estimate_memory(cfg, batch, seq, checkpoint=checkpoint).total
    if arm == "slice":
        return estimate_memory(sub_config(cfg, plan_slice(cfg, width, "static")), batch, seq, checkpoint=checkpoint).total
    dense = 0
    if arm == "rank":  # the arm's rank-r updates cover every matrix (window_shared off: split's factored list)
        with torch.device("meta"):
            state = family_of(cfg).build(cfg).state_dict()
        dense = rank_dense_bytes(cfg, split(cfg, wire_state(state, config_aliases(cfg)), False)[0])
    return frozen_window_memory(cfg, batch, seq, trainable, "int4" if arm == "window-int4" else "int8", checkpoint,
                                expand=arm == "window-expanded", dense=dense)


def measure(arm: str, cfg: LlamaConfig, state: dict, a: argparse.Namespace, checkpoint: bool) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    model, trainable = arm_model(arm, cfg, state, a.width, a.rank)
    trainable = trainable or sum(p.numel() for p in model.parameters())
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = model.to("cuda")
    held = torch.cuda.memory_allocated() - before
    data = torch.randint(0, cfg.vocab_size, (64, a.seq + 1))
    train_steps(model, data, steps=2, lr=1e-4, batch_size=a.batch, seed=0, checkpoint=checkpoint)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = train_steps(model, data, steps=a.steps, lr=1e-4, batch_size=a.batch, seed=1, checkpoint=checkpoint)
    torch.cuda.synchronize()
    step_ms = 1000 * (time.perf_counter() - start) / a.steps
    peak = torch.cuda.max_memory_allocated() - before
    plan = planned(arm, cfg, trainable, a.width, a.batch, a.seq, checkpoint)
    del model
    return {"arm": arm, "checkpoint": checkpoint, "trainable": trainable, "held_mb": held / MB, "peak_mb": peak / MB,
            "planned_mb": plan / MB,
            "peak_over_planned": peak / plan, "step_ms": step_ms, "loss": out.loss}


def report(payload: dict) -> str:
    s = payload["settings"]
    lines = ["# Full-forward windows on CUDA: measured peak memory against the planner", "",
             f"Machine: {payload['machine']}. Batch {s['batch']} x {s['seq']} tokens, window width {s['width']}, "
             f"rank {s['rank']}, {s['steps']} timed AdamW steps after 2 warm-up steps, float32 compute; random-weight "
             "Llamas of SmolLM2's shapes.", "", f"Command: `{payload['command']}`", "",
             "| shape | arm | activation checkpointing | trainable | held MiB | peak MiB | planned MiB | peak / planned | "
             "full's peak / peak | step ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for shape, rows in payload["shapes"].items():
        full = next(r["peak_mb"] for r in rows if r["arm"] == "full" and not r["checkpoint"])
        for r in rows:
            lines.append(f"| {shape} | {r['arm']} | {'on' if r['checkpoint'] else 'off'} | {r['trainable'] / 1e6:.2f} M | "
                         f"{r['held_mb']:.0f} | {r['peak_mb']:.0f} "
                         f"| {r['planned_mb']:.0f} | {r['peak_over_planned']:.2f} | {full / r['peak_mb']:.2f} | "
                         f"{r['step_ms']:.1f} |")
    lines += ["", "Held: allocated after the model moved to the GPU. Peak: the most allocated while training, both "
              "above the allocation before the move. Planned: `fedfusion.devices.memory.estimate_memory` (for windows: "
              "the frozen target at its wire bits, float32 activations). full's peak / peak: the memory ratio against "
              "the whole target trained with AdamW without checkpointing (the oracle's device)."]
    if payload.get("replanned"):
        lines += ["", "The planned column was recomputed after the run with the planner of the commit that wrote this "
                  "file (`python benchmarks/cuda_windows.py --replan benchmarks/results/cuda_windows.json`); the measured "
                  "columns are the run's."]
    return "\n".join(lines) + "\n"


def replan(path: Path, out_dir: Path) -> None:
    """The measured rows of ``path`` with the planner's estimate recomputed (the estimate is a function of the code,
    the measurement is not), written back as JSON and markdown."""
    payload = json.loads(path.read_text())
    s = payload["settings"]
    for shape, rows in payload["shapes"].items():
        cfg = shape_config(shape)
        for r in rows:
            r["planned_mb"] = planned(r["arm"], cfg, r["trainable"], s["width"], s["batch"], s["seq"], r["checkpoint"]) / MB
            r["peak_over_planned"] = r["peak_mb"] / r["planned_mb"]
    payload["replanned"] = True
    (out_dir / "cuda_windows.json").write_text(json.dumps(payload, indent=1))
    (out_dir / "cuda_windows.md").write_text(report(payload))


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["135m", "360m"], choices=list(SHAPES))
    arms = ["full", "slice", "window", "window-dense", "window-expanded", "window-int4", "core", "rank"]  # arm_model's
    parser.add_argument("--arms", nargs="+", default=arms, choices=arms)
    parser.add_argument("--width", type=float, default=0.125)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--checkpoint", choices=["off", "on", "both"], default="both",
                        help="activation checkpointing (train.checkpoint): off, on, or each arm both ways")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--replan", type=Path, default=None,
                        help="no GPU: recompute the planned column of this results JSON with today's planner")
    return parser


def main() -> None:
    parser = build_parser()
    a = parser.parse_args()
    if a.replan is not None:
        replan(a.replan, a.out_dir)
        return
    if not torch.cuda.is_available():
        raise SystemExit("cuda_windows.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 as the planner counts it
    shapes: dict[str, list] = {}
    for shape in a.shapes:
        cfg = shape_config(shape)
        torch.manual_seed(0)
        state = {k: v.clone() for k, v in family_of(cfg).build(cfg).state_dict().items()}
        shapes[shape] = []
        for checkpoint in {"off": [False], "on": [True], "both": [False, True]}[a.checkpoint]:
            for arm in a.arms:
                row = measure(arm, cfg, state, a, checkpoint)
                shapes[shape].append(row)
                print(json.dumps({"shape": shape, **row}), flush=True)
    payload = {"machine": f"{torch.cuda.get_device_name()}, {platform.platform()}, Python {platform.python_version()}, "
                          f"torch {torch.__version__}",
               "command": "python benchmarks/cuda_windows.py", "shapes": shapes,
               "settings": {k: getattr(a, k) for k in ("width", "rank", "batch", "seq", "steps", "checkpoint")}}
    a.out_dir.mkdir(parents=True, exist_ok=True)
    (a.out_dir / "cuda_windows.json").write_text(json.dumps(payload, indent=1))
    (a.out_dir / "cuda_windows.md").write_text(report(payload))


if __name__ == "__main__":
    main()
