"""Benchmark: each way of training a SmolLM2-shaped target on a CPU device, its measured peak resident memory against
the planner's estimate (:func:`fedfusion.devices.memory.estimate_memory`, what ``fedfusion plan`` prices a tier with).

The arms are :mod:`cuda_windows`' (full fine-tuning with AdamW, a width slice, full-forward windows on an int8 or
int4 frozen target, window plus core, rank windows), each without and with activation checkpointing. Each arm runs in
a fresh process: after imports it records its resident memory, builds what the device holds from the strategy's own
payload (the whole target's state is freed and trimmed before training), resets the kernel's peak-RSS counter
(``/proc/self/clear_refs``) and trains; peak = the process's high-water mark minus its memory after imports, so it
counts what the planner counts (weights, gradients, AdamW state, activations, logits) plus the allocator's and
autograd's overheads, which the planner leaves to its ``usable`` margin. Each arm is measured three times, each in a
fresh process: its peak RSS under glibc's default malloc; its peak RSS with glibc's mmap threshold fixed at 64 KiB
(``MALLOC_MMAP_THRESHOLD_``: every large block is mapped on its own and returned when freed, where by default the
threshold rises to the largest block freed, up to 32 MiB, and freed blocks below it stay in the heap); and the peak of
its live tensor bytes (:class:`LiveTensors`: every tensor's storage counted from the op that made it until it is
freed, the tensors held before training included), with the tensors live at that moment grouped by the op that made
them and their shape. Random weights (memory does not depend on them), random token ids, one thread. Writes
``benchmarks/results/cpu_memory.{json,md}``.

    python benchmarks/cpu_memory.py [--shape 135m] [--arms full slice window ...] [--batch 4] [--seq 64] [--steps 2]
        [--note "what else the machine ran"]
    python benchmarks/cpu_memory.py --replan benchmarks/results/cpu_memory.json   # today's planner, nothing measured
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from cuda_lora import SHAPES, shape_config
from cuda_windows import arm_model, planned
from results_files import run_facts, write_pair
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fedfusion.devices.hardware import status_kb
from fedfusion.models.families import family_of
from fedfusion.train.loop import train_steps

MB = 2**20
ARMS = ["full", "slice", "window", "window-expanded", "window-int4", "core", "rank"]
GOAL = 0.15  # the planner's estimate within 15 % of the measured peak
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}  # glibc: map every block of 64 KiB or more, return it when freed
WAYS = {"rss": ("rss", {}), "rss_fixed": ("rss", FIXED_MMAP), "tensors": ("tensors", {})}  # a row's measures: how, env


class LiveTensors(TorchDispatchMode):
    """The peak of live tensor bytes while the block runs: each storage an op returns is counted until it is freed
    (weak references, checked after every op), the tensors alive on entry included; ``at_peak``: what was live then,
    as (op that made it, shape) -> (bytes, count), tensors alive on entry under ``held``."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int, str, tuple[int, ...]]] = {}
        self.bytes = self.peak = 0
        self.peak_op = ""
        self.at_peak: list[tuple[str, tuple[int, ...], int]] = []
        with warnings.catch_warnings():  # gc's objects include deprecated torch.distributed names
            warnings.simplefilter("ignore")
            held = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type == "cpu"]
        for t in held:
            self._count(t, "held")
        self._note("held")

    def _count(self, t: torch.Tensor, op: str) -> None:
        storage = t.untyped_storage()
        ref = StorageWeakRef(storage)
        known = self.live.get(ref.cdata)
        if known is not None and not known[0].expired():
            return  # a view, or an op that wrote in place
        self.live[ref.cdata] = (ref, storage.nbytes(), op, tuple(t.shape))
        self.bytes += storage.nbytes() - (known[1] if known is not None else 0)

    def _note(self, op: str) -> None:
        if self.bytes > self.peak:
            self.peak, self.peak_op = self.bytes, op
            self.at_peak = [(o, shape, n) for _, n, o, shape in self.live.values()]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        op = func.overloadpacket.__name__
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._count(t, op)
        if self.bytes > self.peak:  # freed storages are dropped only here: uncounted, the bytes can only be higher
            for key in [k for k, v in self.live.items() if v[0].expired()]:
                self.bytes -= self.live.pop(key)[1]
            self._note(op)
        return out

    def largest(self, n: int) -> list[dict[str, Any]]:
        """The ``n`` largest groups live at the peak: op, shape, MiB, count (the held tensors as one group)."""
        groups: Counter[tuple[str, tuple[int, ...]]] = Counter()
        counts: Counter[tuple[str, tuple[int, ...]]] = Counter()
        for op, shape, nbytes in self.at_peak:
            key = (op, () if op == "held" else shape)
            groups[key] += nbytes
            counts[key] += 1
        return [{"op": op, "shape": list(shape), "mb": b / MB, "count": counts[(op, shape)]}
                for (op, shape), b in groups.most_common(n)]



def one_arm(arm: str, shape: str, a: argparse.Namespace, checkpoint: bool, how: str) -> dict:
    """Measure one arm in this process (called in a fresh one by :func:`main`): ``how`` = ``rss`` (held and peak
    resident memory above the process's after imports) or ``tensors`` (held and peak live tensor bytes,
    :class:`LiveTensors`)."""
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
    data = torch.randint(0, cfg.vocab_size, (64, a.seq + 1))
    row = {"arm": arm, "checkpoint": checkpoint, "trainable": trainable}
    if how == "tensors":
        with LiveTensors() as live:
            held = live.bytes
            out = train_steps(model, data, steps=a.steps, lr=1e-4, batch_size=a.batch, seed=0, checkpoint=checkpoint)
        return {**row, "held_mb": held / MB, "peak_mb": live.peak / MB, "peak_op": live.peak_op,
                "at_peak": live.largest(8), "loss": out.loss}
    held = status_kb("VmRSS") - base
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from the resident set now
    out = train_steps(model, data, steps=a.steps, lr=1e-4, batch_size=a.batch, seed=0, checkpoint=checkpoint)
    return {**row, "held_mb": held / 1024, "peak_mb": (status_kb("VmHWM") - base) / 1024, "loss": out.loss}


def replan(row: dict, settings: dict) -> None:
    """Set ``row``'s planned MiB (today's planner) and its ratio to each measured peak."""
    s = settings
    row["planned_mb"] = planned(row["arm"], shape_config(s["shape"]), row["trainable"], s["width"], s["batch"],
                                s["seq"], row["checkpoint"]) / MB
    for way in WAYS:
        row[f"planned_over_{way}"] = row["planned_mb"] / row[way]["peak_mb"]


def report(data: dict) -> str:
    s = data["settings"]
    rows = data["rows"]
    within = {way: sum(abs(r[f"planned_over_{way}"] - 1) <= GOAL for r in rows) for way in WAYS}
    lines = [f"# Training memory on a CPU device: measured peaks against the planner ({s['shape']})", "",
             f"Machine: {data['machine']}, torch {data['torch']}, load average before the run {data['load_before']}"
             + (f"; {data['note']}" if data.get("note") else "") + f". Batch {s['batch']} x {s['seq']} tokens, window width "
             f"{s['width']}, rank {s['rank']}, {s['steps']} AdamW steps on one thread, float32 compute; a random-weight "
             f"Llama of SmolLM2-{s['shape']}'s shape; each arm in a fresh process for each measure.", "",
             f"Command: `{data['command']}`", *([f"Command: `{data['rendered_by']}`", "", "The planned column was "
                                                 "recomputed by the second command with the planner of the commit that "
                                                 "wrote this file; the measured columns are the first's."]
                                                if data.get("rendered_by") else []), "",
             "| arm | activation checkpointing | trainable | held MiB (tensors) | peak MiB: RSS | RSS, mmap 64 KiB | "
             "live tensors | planned MiB | planned / RSS | planned / RSS, mmap 64 KiB | planned / live tensors | "
             "live tensors' peak at |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {'on' if r['checkpoint'] else 'off'} | {r['trainable'] / 1e6:.2f} M | "
                     f"{r['rss']['held_mb']:.0f} ({r['tensors']['held_mb']:.0f}) | "
                     + " | ".join(f"{r[way]['peak_mb']:.0f}" for way in WAYS) + f" | {r['planned_mb']:.0f} | "
                     + " | ".join(f"{r[f'planned_over_{way}']:.2f}" for way in WAYS) + f" | `{r['tensors']['peak_op']}` |")
    lines += ["", f"**Within {GOAL:.0%} of the live tensors' peak: {within['tensors']} of {len(rows)} estimates; of the peak "
              f"RSS with glibc's mmap threshold fixed: {within['rss_fixed']} of {len(rows)}; of the peak RSS under "
              f"glibc's default malloc: {within['rss']} of {len(rows)}.** Held: resident (live tensor bytes) after the "
              "device's model was built and the whole target's state freed; RSS peaks: the high-water mark while "
              "training, above the process's memory after imports, under glibc's default malloc and with "
              "`MALLOC_MMAP_THRESHOLD_=65536` (every block of 64 KiB or more mapped on its own and returned when freed; by "
              "default the threshold rises to the largest block freed, up to 32 MiB, and freed blocks below it stay in "
              "the process's heap); live tensors: the most bytes of tensor storage alive at once, the tensors held "
              "before training included (`LiveTensors`). Planned: `fedfusion.devices.memory.estimate_memory` with the "
              "arm's arguments (`benchmarks/cuda_windows.py`'s `planned`).", "",
              *misses(rows), "",
              "The largest groups of tensors live at the live tensors' peak (MiB, count; by the op that made them and "
              "their shape; `held`: alive before training):", ""]
    for r in rows:
        groups = ", ".join(" ".join([g["op"], *([str(tuple(g["shape"]))] if g["shape"] else []), f"{g['mb']:.0f}",
                                     f"x{g['count']}"]) for g in r["tensors"]["at_peak"][:6])
        lines.append(f"- {r['arm']}, checkpointing {'on' if r['checkpoint'] else 'off'}: {groups}")
    return "\n".join(lines) + "\n"


def misses(rows: list[dict]) -> list[str]:
    """Why the estimate and each measure differ, with the run's ranges."""
    def span(values: list[float], fmt: str) -> str:
        return f"{format(min(values), fmt)}-{format(max(values), fmt)}"

    heap = [r["rss"]["peak_mb"] - r["rss_fixed"]["peak_mb"] for r in rows]
    extra = [r["rss_fixed"]["peak_mb"] - r["tensors"]["peak_mb"] for r in rows]
    over = [r["planned_over_tensors"] for r in rows]
    missed = [f"{r['arm']} ({'on' if r['checkpoint'] else 'off'}, {r['planned_over_rss']:.3f})" for r in rows
              if abs(r["planned_over_rss"] - 1) > GOAL]
    return ["Where the estimate and the measures differ:", "",
            f"- Against the live tensors the estimate is {span(over, '.2f')} of the peak: the planner counts tensors, "
            "and where it is above, it counts more than the CPU kernels keep. The step term is one "
            "trainable-sized temporary (`sqrt(v)` of torch's multi-tensor AdamW, its default on CUDA); on CPU torch "
            "defaults to the single-tensor AdamW, whose temporaries are two of the largest tensor's size at a time, so "
            "where the step is the estimate's peak (the whole target) the measured peak is another moment: the loss's "
            "forward, or with checkpointing the tied embedding's unsummed gradients (`add`). The activation term (calibrated on CUDA, "
            "`cuda_lora.md`) counts the attention probabilities, which torch's SDPA kernel for CPU (flash attention) "
            "does not keep, and 12 bytes per logit, where the loss's forward (`nll_loss_forward`, where most ways "
            "peak) holds 8: the logits and their log-softmax, no gradient yet.",
            f"- RSS with the mmap threshold fixed is {span(extra, '.0f')} MiB above the live tensors: the interpreter's "
            "and autograd's objects and the kernels' scratch, none of them tensors.",
            f"- RSS under glibc's default malloc is {span(heap, '.0f')} MiB above RSS with the threshold fixed: once a "
            "freed block has raised the threshold, activation-sized blocks come from the heap, and freed ones stay "
            "there (fragmented, not given back) while later ones are placed beside them. That is the allocator's, not "
            "the tensors'; it is where the estimate misses by more than the goal"
            + (f" ({', '.join(missed)}: planned / RSS)" if missed else "") + ", and more than the planner's `usable` "
            "margin (10 % of a device's memory) covers."]


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
    parser.add_argument("--note", default="", help="what else the machine ran meanwhile, written beside its name")
    parser.add_argument("--replan", type=Path, default=None,
                        help="recompute the planned column of this results JSON with today's planner (measures nothing)")
    parser.add_argument("--how", choices=["rss", "tensors"], default="rss",
                        help="internal, with --one: measure peak RSS or peak live tensor bytes")
    parser.add_argument("--one", nargs=2, metavar=("ARM", "CHECKPOINT"), default=None,
                        help="internal: measure one arm (checkpoint 0 or 1) in this process and print its row as JSON")
    return parser


def main() -> None:
    a = build_parser().parse_args()
    if a.replan is not None:
        data = json.loads(a.replan.read_text())
        for r in data["rows"]:
            replan(r, data["settings"])
        data["rendered_by"] = f"python benchmarks/cpu_memory.py --replan {a.replan}"
        write_pair(a.out_dir, "cpu_memory", data, report(data))
        return
    if a.one is not None:
        print(json.dumps(one_arm(a.one[0], a.shape, a, a.one[1] == "1", a.how)))
        return
    facts = run_facts("benchmarks/cpu_memory.py", sys.argv[1:])
    rows = []
    flags = [f"--shape={a.shape}", f"--width={a.width}", f"--rank={a.rank}", f"--batch={a.batch}", f"--seq={a.seq}",
             f"--steps={a.steps}"]
    settings = {k: getattr(a, k) for k in ("shape", "width", "rank", "batch", "seq", "steps", "checkpoint")}
    for checkpoint in {"off": [False], "on": [True], "both": [False, True]}[a.checkpoint]:
        for arm in a.arms:
            row: dict[str, Any] = {}
            for way, (how, env) in WAYS.items():
                done = subprocess.run([sys.executable, __file__, *flags, "--how", how, "--one", arm, str(int(checkpoint))],
                                      capture_output=True, text=True, check=True, env={**os.environ, **env})
                measured = json.loads(done.stdout.strip().splitlines()[-1])
                row = {**{k: measured.pop(k) for k in ("arm", "checkpoint", "trainable")}, **row, way: measured}
            replan(row, settings)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in WAYS}), flush=True)
    data = {**facts, "settings": settings, "rows": rows, **({"note": a.note} if a.note else {})}
    write_pair(a.out_dir, "cpu_memory", data, report(data))


if __name__ == "__main__":
    main()
