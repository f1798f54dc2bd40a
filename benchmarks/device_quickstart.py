"""The quickstart on a phone: the two ExecuTorch training programs ``fedfusion export-device quickstart --tier
TIER`` writes (the small model's slice for the rounds before growth, the core window on the frozen target after),
each timed through the runtime against eager torch on the same batches, and the window program once more with
``fusion.frozen_dtype=float32`` (a float32 frozen target in the program's data file: what the device held before
window programs took the target as it travelled).

Per program: export seconds, .pte / .ptd sizes, the program's planned memory, the frozen target's bytes as the
device keeps it (as it travelled, its one copy in the program's data file; fetched only when it changed) and the
per-round inputs' bytes (the window's positions, which the runtime copies into its planned memory every step), the
process's resident-memory high-water mark (VmHWM) above its memory before the runner was built (the program loaded,
the device's copy of its round's payload while it writes the frozen target into the data file, ``STEPS`` AdamW
steps), the resident memory above it after the steps, and whole, runtime and torch steps per second, and how far the
two drift apart (per-step loss, relative update error). Torch's side is the client's own model: the small model's slice
(``model_from_state``) and the window on the frozen target (``WindowModel`` from the strategy's payload). One thread,
the recipe's batch, client 0's Shakespeare windows, a seeded target (the window program's round is a round after
growth). The programs are exported first; each is then timed in a fresh process (the memory figures are its own),
with the 1-minute load average before each: timings on a busy machine are disturbed. Needs the [device] extra.

    python benchmarks/device_quickstart.py [--tier phone] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
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

SEED, LR = 7, 3e-3
# each measured program: the recipe's overrides and the phase whose program it is (quickstart as it ships, and its
# window with a float32 frozen target for comparison)
PHASES = {"small": ([], "small"), "window": ([], "window"),
          "window-float32": (["fusion.frozen_dtype=float32"], "window")}



class _Target:
    """What the method's builder reads of the server's target."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.params = model, 0

    def initial(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def export_all(tier: str, out: Path) -> None:
    """Export every :data:`PHASES` program as ``fedfusion export-device quickstart [OVERRIDES] --tier TIER`` does,
    each saved under ``out/<phase>``."""
    from fedfusion.phone.commands import export_phases

    for overrides in {tuple(o) for o, _ in PHASES.values()}:
        phases = export_phases(load_checked("quickstart", list(overrides)), tier)
        programs = dict(zip(("small", "window"), (p for p, _ in phases)))
        for phase, (o, kind) in PHASES.items():
            if tuple(o) == overrides:
                programs[kind].save(out / phase)


def one_phase(phase: str, tier: str, steps: int, programs: Path) -> dict:
    """Time one program (a :data:`PHASES` key, exported under ``programs/<phase>``) in this process."""
    from fedfusion.phone.program import DeviceProgram
    from fedfusion.phone.runtime import ProgramRunner, train_program
    from fedfusion.phone.window import window_frozen, window_round

    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    overrides, kind = PHASES[phase]
    recipe = load_checked("quickstart", overrides)
    grow = recipe.fusion.grow_rounds()
    target = build_target(recipe.model, load_tokenizer(None), recipe.seed)
    windows = client_windows(data_spec(recipe.data_source()), 0, recipe.train.seq_len, "train")
    method = build_method(recipe.fusion, recipe.seed, _Target(target), list(recipe.fusion.widths))
    state = target.state_dict()
    server_round = 1 if kind == "small" else grow + 2
    [payload] = method.payloads(server_round, state, [Client(partition=0, tier=tier, seed=3)])
    program = DeviceProgram.load(programs / phase, next((programs / phase).glob("*.json")).stem)
    base = status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    runner = ProgramRunner(program)
    if kind == "small":
        plan = payload.context[0]
        weights = extract(state, target.config, plan)
        runner.load(weights)
        held = kept = 0
        model = model_from_state(sub_config(target.config, plan), weights)
    else:
        # the device's own copy of the payload, made after the start mark so that the peak counts the target it keeps
        received = {k: v.clone() for k, v in decode(payload.arrays, keep=FROZEN).items()}
        spec = WindowSpec.from_config(payload.spec)
        # written into the program's data file: the device's one copy of it
        runner.set_frozen(window_frozen(runner.manifest, received), "round")
        weights, inputs = window_round(runner.manifest, received, spec)
        del received
        runner.load(weights)
        runner.hold(inputs)
        held = sum(t.numel() * t.element_size() for t in inputs.values())
        kept = runner.manifest["window"]["frozen_bytes"]
    start = time.perf_counter()
    mine = train_program(runner, windows, steps, LR, recipe.train.batch_size, SEED)
    runtime_s = time.perf_counter() - start
    peak_mb, process_mb = (status_kb("VmHWM") - base) / 1024, status_kb("VmHWM") / 1024
    steady_mb = (status_kb("VmRSS") - base) / 1024
    if kind == "window":
        model = from_payload(target.config, decode(payload.arrays, keep=FROZEN), WindowSpec.from_config(payload.spec), 0)
    start = time.perf_counter()
    theirs = train_steps(model, windows, steps, LR, recipe.train.batch_size, SEED)
    torch_s = time.perf_counter() - start
    trained = model.trained() if kind == "window" else {k: v.detach() for k, v in model.named_parameters()}
    moved = torch.cat([(runner.params[k] - weights[k]).flatten() for k in weights])
    expected = torch.cat([(trained[k] - weights[k]).flatten() for k in weights])
    return {"phase": phase, "rounds": f"1..{grow}" if kind == "small" else f"{grow + 1}..{recipe.rounds}",
            "overrides": overrides, "frozen_dtype": recipe.fusion.frozen_dtype if kind == "window" else None,
            "load_before": load,
            "trained_params": sum(v.numel() for v in weights.values()), "export_s": program.manifest["export_s"],
            "pte_bytes": len(program.pte), "ptd_bytes": len(program.ptd), "planned_bytes": program.manifest["planned_bytes"],
            "frozen_kept_bytes": kept, "round_input_bytes": held, "peak_mb": peak_mb, "steady_mb": steady_mb, "process_peak_mb": process_mb,
            "runtime_steps_per_s": steps / runtime_s, "torch_steps_per_s": steps / torch_s,
            "max_loss_diff": max(abs(a - b) for a, b in zip(mine.losses, theirs.losses)),
            "relative_update_error": float((moved - expected).norm() / expected.norm()),
            "first_loss": mine.losses[0], "last_loss": mine.losses[-1]}


def report(data: dict) -> str:
    s = data["settings"]
    lines = [f"# The quickstart's programs on a {s['tier']} (ExecuTorch runtime against torch)", "",
             f"Machine: {data['machine']}, torch {data['torch']}; load average (1, 5, 15 minutes) before: "
             f"{data['load_before']}, after: {data['load_after']}; another benchmark was running on the machine, so "
             f"the timings are disturbed. Recipe: quickstart; {s['steps']} AdamW steps (lr {LR}), batch "
             f"{s['batch']} x {s['seq']} characters, client 0's windows, one thread, each program in a fresh process.",
             "", "| program | rounds | frozen dtype | trained params | export s | .pte bytes | .ptd bytes | planned bytes | "
             "frozen target kept bytes | round inputs bytes | peak MB above start | MB above start after the steps | "
             "process peak MB | runtime steps/s | torch steps/s | max loss diff | rel. update error | 1-min load before |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['phase']} | {r['rounds']} | {r['frozen_dtype'] or '-'} | {r['trained_params']:,} | "
                     f"{r['export_s']:.1f} | {r['pte_bytes']:,} | {r['ptd_bytes']:,} | {r['planned_bytes']:,} | "
                     f"{r['frozen_kept_bytes']:,} | {r['round_input_bytes']:,} | {r['peak_mb']:.1f} | {r['steady_mb']:.1f} | "
                     f"{r['process_peak_mb']:.0f} | {r['runtime_steps_per_s']:.2f} | {r['torch_steps_per_s']:.2f} | "
                     f"{r['max_loss_diff']:.1e} | {r['relative_update_error']:.1e} | {r['load_before']:.2f} |")
    lines += ["", "small: the small model's slice the rounds before growth train (found by its shape by the gateway); "
              "window: the core plus a window drawn outside it on the frozen target, which the device writes as it "
              "travelled (fusion.frozen_dtype) into the program's data file, and the program dequantises; "
              "window-float32: the same with fusion.frozen_dtype=float32. Frozen target kept: what the device holds "
              "between tasks, its one copy, in the program's data file (fetched again only when its hash changes). "
              "Round inputs: the inputs held for the round's steps (the window's positions), which the runtime copies "
              "into the planned memory at every step. Peak MB above start: the resident high-water mark above the "
              "process's memory before the runner was built (the program, the device's copy of the round's "
              "payload while it writes the frozen target into the data file, and training); after the steps: the "
              "resident memory then, the payload's copy dropped; process peak MB: the whole process's (Python, "
              "torch, the server's target that built the payload, the runtime; the programs were exported in another "
              "process)."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tier", default="phone")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--one", default=None, help="internal: measure one program (a PHASES key) in this process")
    parser.add_argument("--programs", type=Path, default=None, help="internal: where --one finds the exported programs")
    return parser


def main() -> None:
    a = build_parser().parse_args()
    if a.one is not None:
        print(json.dumps(one_phase(a.one, a.tier, a.steps, a.programs)))
        return
    facts = run_facts("benchmarks/device_quickstart.py", sys.argv[1:])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        export_all(a.tier, Path(tmp))
        for phase in PHASES:
            done = subprocess.run([sys.executable, __file__, f"--tier={a.tier}", f"--steps={a.steps}", "--one", phase,
                                   "--programs", tmp], capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    recipe = load_checked("quickstart", [])
    load_after = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    settings = {"tier": a.tier, "steps": a.steps, "batch": recipe.train.batch_size, "seq": recipe.train.seq_len}
    data = {**facts, "load_after": load_after, "settings": settings, "rows": rows}
    write_pair(a.out_dir, "device_quickstart", data, report(data))


if __name__ == "__main__":
    main()
