"""Benchmark (needs a CUDA GPU): LoRA on a frozen 32-, 16-, 8- and 4-bit base, measured against the planner.

What a CPU run cannot check: that a base quantised on the CPU (:func:`fedfusion.models.pretrained.quantized_copy`)
loads and trains on CUDA through bitsandbytes, and whether the memory model that sizes every tier's LoRA rank
and base precision (:func:`fedfusion.devices.memory.estimate_memory`) holds on a real accelerator. Per base shape and
precision it records the measured weight memory and peak training memory (``torch.cuda.max_memory_allocated``
above what was allocated before the base loaded) next to the planner's estimate, the time of a training step
(the project's :func:`fedfusion.train.loop.train_steps` with the response-only loss on
:func:`fedfusion.models.adapters.attach_adapter`'s peft adapter) and the first loss against the float32 base's.

Bases are randomly initialised Llamas of SmolLM2-135M's, -360M's and -1.7B's shapes (no hub access is needed:
weights do not change memory or speed, and every precision starts from the same random weights); the batch is
random token ids, every token a response token. 16-bit is a bfloat16 base; 8- and 4-bit compute in bfloat16.

    python benchmarks/cuda_lora.py [--shapes 135m 360m 1.7b] [--bits 32 16 8 4] [--rank 16] [--batch 8] [--seq 256]
        [--steps 10] [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shlex
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fedfusion.devices.memory import LORA_MODULES, estimate_memory
from fedfusion.models.adapters import adapter_factors, attach_adapter
from fedfusion.models.pretrained import load_base
from fedfusion.train.instruct import RESPONSE, InstructData, response_loss
from fedfusion.train.loop import train_steps

SHAPES = {  # SmolLM2's published configs (hidden, intermediate, layers, heads, kv heads, vocab)
    "135m": (576, 1536, 30, 9, 3, 49152),
    "360m": (960, 2560, 32, 15, 5, 49152),
    "1.7b": (2048, 8192, 24, 32, 32, 49152),
}
PRECISION = {32: (0, "float32"), 16: (0, "bfloat16"), 8: (8, "bfloat16"), 4: (4, "bfloat16")}  # bits -> (quantize, dtype)
MB = 2**20


def shape_config(name: str) -> LlamaConfig:
    h, inter, layers, heads, kv, vocab = SHAPES[name]
    return LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, head_dim=h // heads,
                       max_position_embeddings=2048, tie_word_embeddings=True)


def measure(base_dir: Path, cache: Path, cfg: LlamaConfig, bits: int, a: argparse.Namespace,
            data: InstructData) -> dict:
    """One precision: load, adapt, train; memory in MiB above the allocation before loading."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    quantize, dtype = PRECISION[bits]
    base = load_base(str(base_dir), quantize=quantize, dtype=dtype, cache=cache, device="cuda")
    layer = type(base.model.layers[0].self_attn.q_proj).__name__
    model = attach_adapter(base, a.rank, 2.0 * a.rank, list(LORA_MODULES), 0.0, seed=0)
    loaded = torch.cuda.memory_allocated() - before
    ids, labels, mask = data.rows(torch.arange(a.batch))
    with torch.no_grad():
        first = float(response_loss(model, ids, labels, mask)[0])
    train_steps(model, data, steps=2, lr=1e-4, batch_size=a.batch, seed=0, loss=RESPONSE)  # warm-up: kernels, allocator
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = train_steps(model, data, steps=a.steps, lr=1e-4, batch_size=a.batch, seed=1, loss=RESPONSE)
    torch.cuda.synchronize()
    step_ms = 1000 * (time.perf_counter() - start) / a.steps
    peak = torch.cuda.max_memory_allocated() - before
    factors = adapter_factors(model)
    est = estimate_memory(cfg, a.batch, a.seq, lora_rank=a.rank, base_bits=bits)
    row = {"bits": bits, "dtype": dtype, "layer": layer, "params": est.params - est.trainable,
           "trainable": sum(t.numel() for t in factors.values()), "trainable_planned": est.trainable,
           "weights_mb": loaded / MB, "weights_est_mb": est.weights / MB, "peak_mb": peak / MB,
           "peak_est_mb": est.total / MB, "step_ms": step_ms, "first_loss": first, "train_loss": out.loss,
           "finite": all(bool(torch.isfinite(t).all()) for t in factors.values())}
    del model, base
    return row


def report(payload: dict) -> str:
    a = payload["args"]
    lines = ["# LoRA on a quantised base, on CUDA: measured memory and speed against the planner", "",
             f"Machine: {payload['machine']}. Rank {a['rank']} on {', '.join(LORA_MODULES)}, batch {a['batch']} x "
             f"{a['seq']} tokens, {a['steps']} timed AdamW steps after 2 warm-up steps; random-weight Llamas of "
             "SmolLM2's shapes.", "",
             f"Command: `{payload['command']}`", "",
             "| shape | base | linear layer | weights MiB (planned) | peak MiB (planned) | peak / planned | "
             "step ms | first loss (vs fp32) | adapter finite |", "|---|---|---|---|---|---|---|---|---|"]
    for shape, rows in payload["results"].items():
        ref = next((r["first_loss"] for r in rows if r["bits"] == 32), None)
        for r in rows:
            delta = f" ({r['first_loss'] - ref:+.4f})" if ref is not None else ""
            lines.append(f"| {shape} | {r['bits']}-bit {r['dtype']} | {r['layer']} | {r['weights_mb']:.0f} "
                         f"({r['weights_est_mb']:.0f}) | {r['peak_mb']:.0f} ({r['peak_est_mb']:.0f}) | "
                         f"{r['peak_mb'] / r['peak_est_mb']:.2f} | {r['step_ms']:.1f} | {r['first_loss']:.4f}{delta} | "
                         f"{r['finite']} |")
    lines += ["", "Weights: allocated after loading the base and attaching the adapter. Peak: the most allocated "
              "during training, both above the allocation before loading. Planned: `fedfusion.devices.memory.estimate_memory` "
              "(which assumes no fused attention: PyTorch's SDPA keeps no seq x seq probabilities, so the planner "
              "over-counts activations there).", ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--bits", type=int, nargs="+", default=[32, 16, 8, 4], choices=list(PRECISION))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    return parser


def main() -> None:
    import sys

    parser = build_parser()
    a = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/cuda_lora.py needs a CUDA GPU (torch sees none)")
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in a.shapes:
            cfg = shape_config(shape)
            torch.manual_seed(0)
            base_dir = Path(tmp) / shape
            LlamaForCausalLM(cfg).save_pretrained(base_dir)
            gen = torch.Generator().manual_seed(0)
            ids = torch.randint(cfg.vocab_size, (4 * a.batch, a.seq), generator=gen)
            data = InstructData(ids, ids.clone(), torch.ones_like(ids))
            for bits in a.bits:
                row = measure(base_dir, Path(tmp) / "cache", cfg, bits, a, data)
                results.setdefault(shape, []).append(row)
                print(json.dumps({"shape": shape, **row}), flush=True)
    argv = sys.argv[1:]  # without --out-dir: where a run writes is not what it measures (nor a path for the results)
    argv = [x for i, x in enumerate(argv) if x != "--out-dir" and (i == 0 or argv[i - 1] != "--out-dir")
            and not x.startswith("--out-dir=")]
    payload = {"command": shlex.join(["python", "benchmarks/cuda_lora.py", *argv]),
               "args": {k: v for k, v in vars(a).items() if k != "out_dir"}, "argv": argv, "results": results,
               "machine": f"{torch.cuda.get_device_name()}, {platform.platform()}, Python {platform.python_version()}, "
                          f"torch {torch.__version__}"}
    a.out_dir.mkdir(parents=True, exist_ok=True)
    (a.out_dir / "cuda_lora.json").write_text(json.dumps(payload, indent=1))
    (a.out_dir / "cuda_lora.md").write_text(report(payload))
    print(report(payload))


if __name__ == "__main__":
    main()
