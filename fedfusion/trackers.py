"""Experiment trackers (``output.tracker``): every metrics.jsonl row also goes to TensorBoard.

A tracker is a listener on the run directory's round ledger (:meth:`fedfusion.run_dir.RunDir.log_round`): it
receives exactly the rows metrics.jsonl gets, and logs each numeric field as a scalar at step ``round``
(booleans as 0/1; ``None``, NaN and text are skipped). TensorBoard is an optional install.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

# name -> the module it needs (checked when the recipe loads, imported when the run logs its first row)
TRACKERS = {"none": None, "tensorboard": "tensorboard"}
INSTALL = {"tensorboard": "pip install 'fedfusion[tracking]' (or: pip install tensorboard)"}


class Tracker(Protocol):
    def log(self, row: dict[str, Any]) -> None: ...


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a metrics row (without ``round``, which is the step)."""
    return {k: float(v) for k, v in row.items()
            if k != "round" and isinstance(v, (int, float)) and not (isinstance(v, float) and v != v)}


class TensorBoardTracker:
    """Event files under ``log_dir`` (``tensorboard --logdir runs`` compares every run below it)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, row: dict[str, Any]) -> None:
        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, global_step=int(row["round"]))
        self.writer.flush()  # a run can be stopped at any round: what was logged is on disk


def open_tracker(name: str, run_path: Path) -> Tracker | None:
    """The recipe's tracker for a run directory (None for ``none``)."""
    if name == "tensorboard":
        return TensorBoardTracker(run_path / "tensorboard")
    return None
