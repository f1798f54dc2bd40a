"""Checkpoints of a run in progress: the target after round r plus the strategy's state, saved atomically.

Layout inside the run directory::

    checkpoint/target.safetensors   the target's state after round ``round``
    checkpoint/state.json           {"round", "elapsed_s", "strategy": {...}}
    checkpoint/tensors.safetensors  other state held as tensors (a units run's optimizer moments), if any

Everything else a resumed run needs is either in the run directory already (``recipe.yaml``, the
``metrics.jsonl`` / ``clients.jsonl`` ledgers, cut back to ``round`` on resume) or derived from the
recipe's seed and the round number (slices, client seeds, batches, faults), so a resumed run ends with
the same metrics as an uninterrupted one. Node capabilities are not saved: node ids change when the
federation restarts, so the strategy queries the nodes again.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

DIR = "checkpoint"


@dataclass
class Checkpoint:
    """What a run needs to continue after ``round``."""

    round: int
    target: dict[str, torch.Tensor]
    elapsed_s: float = 0.0
    strategy: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def save_checkpoint(run_path: Path, ckpt: Checkpoint) -> None:
    """Write the checkpoint next to the old one, then swap it in, so a kill never leaves half of one."""
    final, tmp = run_path / DIR, run_path / f"{DIR}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous() for k, v in ckpt.target.items()}, str(tmp / "target.safetensors"))
    if ckpt.tensors:
        save_file({k: v.detach().contiguous() for k, v in ckpt.tensors.items()}, str(tmp / "tensors.safetensors"))
    (tmp / "state.json").write_text(json.dumps(
        {"round": ckpt.round, "elapsed_s": ckpt.elapsed_s, "strategy": ckpt.strategy}))
    old = run_path / f"{DIR}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(run_path: Path) -> Checkpoint:
    """The run's last checkpoint; a clear error when there is none."""
    ckpt_dir = run_path / DIR
    if not (ckpt_dir / "state.json").is_file() and (run_path / f"{DIR}.old" / "state.json").is_file():
        ckpt_dir = run_path / f"{DIR}.old"  # killed between the two renames of save_checkpoint
    if not (ckpt_dir / "state.json").is_file():
        raise FileNotFoundError(f"{run_path}: no checkpoint to resume from (output.checkpoint_every=0, "
                                "or the run stopped before its first checkpoint)")
    state = json.loads((ckpt_dir / "state.json").read_text())
    tensors = ckpt_dir / "tensors.safetensors"
    return Checkpoint(round=int(state["round"]), target=load_file(str(ckpt_dir / "target.safetensors")),
                      elapsed_s=float(state["elapsed_s"]), strategy=state["strategy"],
                      tensors=load_file(str(tensors)) if tensors.is_file() else {})
