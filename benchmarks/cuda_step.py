"""Benchmark (needs a CUDA GPU): the units benchmark's "same work on a cloud GPU", measured instead of assumed.

``benchmarks/units.py`` compares the exact (units) mode's step with one step of the same target on a cloud GPU,
priced from FLOPs at an assumed sustained throughput (the catalog's ``tflops``: 300 TFLOP/s for ``cloud-h100``,
the A5000 at 0.6 of its fp32 peak). This times that step on the GPU at hand: the same targets
(``units.TARGETS``), the same batch (``units.BATCH`` x ``units.SEQ`` tokens), one AdamW step (forward, backward,
update) in float32 (TF32 off) and in bfloat16 autocast, and reports the achieved TFLOP/s (the benchmark's own FLOP
count over the measured time) against the catalog's figure for the GPU.

    python benchmarks/cuda_step.py [--steps 20] [--catalog-device cloud-h100] [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from transformers import LlamaForCausalLM
from units import BATCH, SEQ, TARGETS, Target

from fedfusion.devices.catalog import load_catalog


def step_ms(target: Target, dtype: str, steps: int) -> float:
    """Mean wall milliseconds of an AdamW step after 3 warm-up steps."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(target.config()).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, target.vocab, (BATCH, SEQ), device="cuda")
    cast = torch.autocast("cuda", dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()

    def step() -> None:
        with cast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start) / steps


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--catalog-device", default="cloud-h100")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    return parser


def main() -> None:
    parser = build_parser()
    a = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_step.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    assumed = load_catalog()[a.catalog_device].tflops
    rows = []
    for target in TARGETS:
        flops = target.flops(BATCH * SEQ)
        for dtype in ("float32", "bfloat16"):
            ms = step_ms(target, dtype, a.steps)
            rows.append({"target": target.name, "dtype": dtype, "step_ms": ms, "gflop": flops / 1e9,
                         "achieved_tflops": flops / (ms / 1000) / 1e12, "catalog_step_ms": flops / (assumed * 1e12) * 1000})
            print(json.dumps(rows[-1]), flush=True)
    machine = f"{torch.cuda.get_device_name()}, {platform.platform()}, Python {platform.python_version()}, torch {torch.__version__}"
    payload = {"machine": machine, "command": "python benchmarks/cuda_step.py", "catalog_device": a.catalog_device,
               "catalog_tflops": assumed, "batch": BATCH, "seq": SEQ, "steps": a.steps, "rows": rows}
    lines = ["# One training step of the units benchmark's targets on a GPU, measured", "",
             f"Machine: {machine}. Batch {BATCH} x {SEQ} tokens, AdamW, {a.steps} timed steps after 3 warm-up steps; "
             f"float32 with TF32 off, and bfloat16 autocast. FLOPs: `benchmarks/units.py`'s count for the step. "
             f"Catalog: `{a.catalog_device}` at {assumed:g} TFLOP/s sustained.", "",
             f"Command: `{payload['command']}`", "",
             "| target | dtype | GFLOP | step ms | achieved TFLOP/s | catalog's step ms | measured / catalog |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['target']} | {r['dtype']} | {r['gflop']:.1f} | {r['step_ms']:.2f} | {r['achieved_tflops']:.2f} "
                     f"| {r['catalog_step_ms']:.3f} | {r['step_ms'] / r['catalog_step_ms']:.0f}x |")
    a.out_dir.mkdir(parents=True, exist_ok=True)
    (a.out_dir / "cuda_step.json").write_text(json.dumps(payload, indent=1))
    (a.out_dir / "cuda_step.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
