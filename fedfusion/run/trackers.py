"""Experiment trackers (``output.tracker``): every metrics.jsonl row also goes to TensorBoard or MLflow.

A tracker is a listener on the run directory's round ledger (:meth:`fedfusion.run.run_dir.RunDir.log_round`): it
receives exactly the rows metrics.jsonl gets, and logs each numeric field as a scalar at step ``round``
(booleans as 0/1; ``None``, NaN and text are skipped). When the run writes its summary the tracker is closed
with the run's status. Both trackers are optional installs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

# name -> the module it needs (checked when the recipe loads, imported when the run logs its first row)
TRACKERS = {"none": None, "tensorboard": "tensorboard", "mlflow": "mlflow"}
INSTALL = {"tensorboard": "pip install 'fedfusion[tracking]' (or: pip install tensorboard)",
           "mlflow": "pip install 'fedfusion[mlflow]' (or: pip install mlflow)"}


class Tracker(Protocol):
    def log(self, row: dict[str, Any]) -> None: ...

    def close(self, status: str) -> None: ...


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

    def close(self, status: str) -> None:
        self.writer.close()


class MLflowTracker:
    """One MLflow run per fedfusion run, in the experiment named after the recipe, on the tracking server that
    ``MLFLOW_TRACKING_URI`` names (MLflow's own default otherwise); tagged with the run directory."""

    STATUS = {"ok": "FINISHED", "interrupted": "KILLED"}  # anything else (failed) is FAILED

    def __init__(self, experiment: str, run_path: Path) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_path.name,
                                             tags={"fedfusion.run.run_dir": str(run_path.resolve())}).info.run_id

    def log(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, int(row["round"])) for k, v in scalars(row).items()])

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, self.STATUS.get(status, "FAILED"))


def open_tracker(name: str, run_path: Path, experiment: str) -> Tracker | None:
    """The recipe's tracker for a run directory (None for ``none``); ``experiment`` is the recipe's name."""
    if name == "tensorboard":
        return TensorBoardTracker(run_path / "tensorboard")
    if name == "mlflow":
        return MLflowTracker(experiment, run_path)
    return None
