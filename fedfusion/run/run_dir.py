"""The run directory: resolved recipe, per-round and per-client ledgers, summary and the target model."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from fedfusion.analysis.report import read_jsonl
from fedfusion.config.recipe import Recipe, to_yaml
from fedfusion.run.check import load_checked
from fedfusion.run.trackers import Tracker, open_tracker


def new_run_path(recipe: Recipe, out: str | Path | None) -> Path:
    """``out`` if given, else ``<output.dir>/<name>-<timestamp>`` (never an existing directory)."""
    if out:
        path = Path(out)
    else:
        path = Path(recipe.output.dir) / f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"run directory {path} exists and is not empty; choose another --out")
    return path


def versions() -> dict[str, str]:
    """Versions of the stack that produced a run."""
    import flwr
    import torch
    import transformers

    import fedfusion

    return {
        "fedfusion": fedfusion.__version__, "flwr": flwr.__version__, "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()} {platform.system()}",
    }


class RunDir:
    """Writes one run's outputs as design.md section 4 lays them out."""

    def __init__(self, path: Path, recipe: Recipe, fresh: bool = True) -> None:
        self.path, self.recipe = path, recipe
        self.tracker: Tracker | None = None  # opened with the first row, so a run that fails to start makes none
        if fresh:
            self.path.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path / "recipe.yaml", to_yaml(recipe))
            for name in ("metrics.jsonl", "clients.jsonl", "nodes.jsonl"):
                write_atomic(self.path / name, "")

    @classmethod
    def reopen(cls, path: Path) -> RunDir:
        """An existing run directory, to resume: its own resolved recipe, nothing rewritten."""
        if not (path / "recipe.yaml").is_file():
            raise FileNotFoundError(f"{path}: not a run directory (no recipe.yaml)")
        return cls(path, load_checked(path / "recipe.yaml"), fresh=False)

    def cut_ledgers(self, last_round: int) -> None:
        """Drop ledger rows after ``last_round`` (written after the checkpoint a run resumes from)."""
        for name in ("metrics.jsonl", "clients.jsonl", "nodes.jsonl"):
            if not (self.path / name).is_file():
                continue
            keep = [r for r in read_jsonl(self.path / name) if r["round"] <= last_round]
            write_atomic(self.path / name, "".join(json.dumps(r) + "\n" for r in keep))

    def _append(self, name: str, rows: list[dict[str, Any]]) -> None:
        """Whole lines in one write, so a stop between two writes never leaves half a row."""
        if rows:
            with (self.path / name).open("a") as fh:
                fh.write("".join(json.dumps(row) + "\n" for row in rows))

    def log_round(self, row: dict[str, Any]) -> None:
        """Append one row to metrics.jsonl, and hand it to the recipe's tracker (``output.tracker``)."""
        self._append("metrics.jsonl", [row])
        if self.tracker is None and self.recipe.output.tracker != "none":
            self.tracker = open_tracker(self.recipe.output.tracker, self.path, self.recipe.name)
        if self.tracker is not None:
            self.tracker.log(row)

    def log_clients(self, rows: list[dict[str, Any]]) -> None:
        """Append client rows to clients.jsonl."""
        self._append("clients.jsonl", rows)

    def log_nodes(self, rows: list[dict[str, Any]]) -> None:
        """Append nodes' capability-query answers (tier, partition, measured memory, accelerator, battery)."""
        self._append("nodes.jsonl", rows)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Write summary.json (status ``ok``, ``interrupted``, or ``failed`` with the error), atomically."""
        write_atomic(self.path / "summary.json", json.dumps({**summary, "versions": versions()}, indent=2))
        if self.tracker is not None:
            self.tracker.close(summary.get("status", "failed"))
            self.tracker = None

    def read_summary(self) -> dict[str, Any] | None:
        """summary.json as the last part of the run left it (None: that part was killed before writing one)."""
        path = self.path / "summary.json"
        return json.loads(path.read_text()) if path.is_file() else None

    @property
    def finished(self) -> bool:
        """Whether the run completed (a resume then has nothing to do and must leave it as it is)."""
        return (self.read_summary() or {}).get("status") == "ok"

    @property
    def model_dir(self) -> Path:
        return self.path / "model"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` next to ``path`` and rename it into place: readers see the old file or the new, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
