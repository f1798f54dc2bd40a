"""The quickstart on a phone: the two ExecuTorch training programs ``fedfusion export-device quickstart
fusion.window_outside_core=true --tier TIER`` writes (the small model's slice for the rounds before growth, the
core window on the frozen target after), each timed through the runtime against eager torch on the same batches.

Per program: export seconds, .pte / .ptd sizes, the per-round inputs' bytes (the frozen target, float32), the
process's resident-memory high-water mark above its memory before the runner was built (the program loaded, its
round's weights and inputs held, ``STEPS`` AdamW steps), runtime and torch steps per second, and how far the two
drift apart (per-step loss, relative update error). Torch's side is the client's own model: the small model's
slice (``model_from_state``) and the window on the frozen target (``WindowModel`` from the strategy's payload).
One thread, the recipe's batch, client 0's Shakespeare windows, a seeded target (the window program's round is a
round after growth). Each program in a fresh process (the memory figure is its own). Needs the [device] extra.

    python benchmarks/device_quickstart.py [--tier phone] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from results_files import run_facts, write_pair

from fedfusion.data.population import client_windows, data_spec
from fedfusion.data.text import load_tokenizer
from fedfusion.devices.hardware import status_kb
from fedfusion.fusion.base import Client
from fedfusion.fusion.submodel.build import build as build_method
from fedfusion.models.build import build_target, model_from_state
from fedfusion.models.full_forward import from_payload
from fedfusion.models.slicing import extract, sub_config
from fedfusion.run.check import load_checked
from fedfusion.train.loop import train_steps
from fedfusion.wire.keys import FROZEN
from fedfusion.wire.quantize import decode
from fedfusion.wire.specs import WindowSpec

OVERRIDES = ["fusion.window_outside_core=true"]
SEED, LR = 7, 3e-3



class _Target:
    """What the method's builder reads of the server's target."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.params = model, 0

    def initial(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def one_phase(phase: str, tier: str, steps: int) -> dict:
    """Export and time one program (``small`` or ``window``) in this process."""
    from fedfusion.phone.commands import export_phases
    from fedfusion.phone.runtime import ProgramRunner, train_program
    from fedfusion.phone.window import window_round

    torch.set_num_threads(1)
    recipe = load_checked("quickstart", OVERRIDES)
    grow = recipe.fusion.grow_rounds()
    target = build_target(recipe.model, load_tokenizer(None), recipe.seed)
    windows = client_windows(data_spec(recipe.data_source()), 0, recipe.train.seq_len, "train")
    method = build_method(recipe.fusion, recipe.seed, _Target(target), list(recipe.fusion.widths))
    state = target.state_dict()
    server_round = 1 if phase == "small" else grow + 2
    [payload] = method.payloads(server_round, state, [Client(partition=0, tier=tier, seed=3)])
    programs = dict(zip(("small", "window"), (p for p, _ in export_phases(recipe, tier))))
    program = programs[phase]
    base = status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    runner = ProgramRunner(program)
    if phase == "small":
        plan = payload.context[0]
        weights = extract(state, target.config, plan)
        runner.load(weights)
        held = 0
        model = model_from_state(sub_config(target.config, plan), weights)
    else:
        received = decode(payload.arrays, keep=FROZEN)
        spec = WindowSpec.from_config(payload.spec)
        weights, inputs = window_round(runner.manifest, received, spec, received)
        runner.load(weights)
        runner.hold(inputs)
        held = sum(t.numel() * t.element_size() for t in inputs.values())
    start = time.perf_counter()
    mine = train_program(runner, windows, steps, LR, recipe.train.batch_size, SEED)
    runtime_s = time.perf_counter() - start
    peak_mb = (status_kb("VmHWM") - base) / 1024
    if phase == "window":
        model = from_payload(target.config, decode(payload.arrays, keep=FROZEN), WindowSpec.from_config(payload.spec), 0)
    start = time.perf_counter()
    theirs = train_steps(model, windows, steps, LR, recipe.train.batch_size, SEED)
    torch_s = time.perf_counter() - start
    trained = model.trained() if phase == "window" else {k: v.detach() for k, v in model.named_parameters()}
    moved = torch.cat([(runner.params[k] - weights[k]).flatten() for k in weights])
    expected = torch.cat([(trained[k] - weights[k]).flatten() for k in weights])
    return {"phase": phase, "rounds": f"1..{grow}" if phase == "small" else f"{grow + 1}..{recipe.rounds}",
            "trained_params": sum(v.numel() for v in weights.values()), "export_s": program.manifest["export_s"],
            "pte_bytes": len(program.pte), "ptd_bytes": len(program.ptd), "round_input_bytes": held,
            "peak_mb": peak_mb, "runtime_steps_per_s": steps / runtime_s, "torch_steps_per_s": steps / torch_s,
            "max_loss_diff": max(abs(a - b) for a, b in zip(mine.losses, theirs.losses)),
            "relative_update_error": float((moved - expected).norm() / expected.norm()),
            "first_loss": mine.losses[0], "last_loss": mine.losses[-1]}


def report(data: dict) -> str:
    s = data["settings"]
    lines = [f"# The quickstart's programs on a {s['tier']} (ExecuTorch runtime against torch)", "",
             f"Machine: {data['machine']}, torch {data['torch']}; 1-minute load before: {data['load_before']}. "
             f"Recipe: quickstart with {' '.join(OVERRIDES)}; {s['steps']} AdamW steps (lr {LR}), batch "
             f"{s['batch']} x {s['seq']} characters, client 0's windows, one thread, each program in a fresh process.",
             "", "| program | rounds | trained params | export s | .pte bytes | .ptd bytes | round inputs bytes | "
             "peak MB | runtime steps/s | torch steps/s | max loss diff | rel. update error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['phase']} | {r['rounds']} | {r['trained_params']:,} | {r['export_s']:.1f} | "
                     f"{r['pte_bytes']:,} | {r['ptd_bytes']:,} | {r['round_input_bytes']:,} | {r['peak_mb']:.0f} | "
                     f"{r['runtime_steps_per_s']:.2f} | {r['torch_steps_per_s']:.2f} | {r['max_loss_diff']:.1e} | "
                     f"{r['relative_update_error']:.1e} |")
    lines += ["", "small: the small model's slice the rounds before growth train (found by its shape by the gateway); "
              "window: the core plus a window drawn outside it on the frozen target (float32 program inputs, given "
              "once a round). Peak MB: the resident high-water mark above the process's memory before the runner "
              "was built (program, round weights and inputs, training)."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tier", default="phone")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--one", default=None, help="internal: measure one program (small or window) in this process")
    return parser


def main() -> None:
    a = build_parser().parse_args()
    if a.one is not None:
        print(json.dumps(one_phase(a.one, a.tier, a.steps)))
        return
    facts = run_facts("benchmarks/device_quickstart.py", sys.argv[1:])
    rows = []
    for phase in ("small", "window"):
        done = subprocess.run([sys.executable, __file__, f"--tier={a.tier}", f"--steps={a.steps}", "--one", phase],
                              capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    recipe = load_checked("quickstart", OVERRIDES)
    data = {**facts, "settings": {"tier": a.tier, "steps": a.steps, "batch": recipe.train.batch_size,
                                  "seq": recipe.train.seq_len}, "rows": rows}
    write_pair(a.out_dir, "device_quickstart", data, report(data))


if __name__ == "__main__":
    main()
