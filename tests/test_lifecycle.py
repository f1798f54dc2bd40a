"""The one run lifecycle (fedfusion.run.lifecycle) with a stand-in course: a stop ends the run at the next Grid call
with the last round and the round a resume continues after, the resume cuts the ledgers back to the checkpoint and
ends with the uninterrupted run's rows and totals, a finished run writes its summary and report."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord

from fedfusion.analysis.report import read_jsonl
from fedfusion.config.recipe import load_recipe
from fedfusion.run import lifecycle
from fedfusion.run.checkpoint import Checkpoint
from fedfusion.run.lifecycle import Recorder, run_course
from fedfusion.run.run_dir import RunDir
from fedfusion.run.targets import Target

ROUNDS = 5


class NodesOnly:
    """A Grid as far as the stand-in course uses one: the node ids (a Grid call, where a stop takes effect)."""

    def get_node_ids(self) -> list[int]:
        return [1, 2]


class Counting:
    """A course whose round r moves r bytes down and scores 1 / (r + 1); it asks the Grid for nodes each round."""

    rounds = ROUNDS

    def __init__(self) -> None:
        self.target = Target(model=None, tokenizer=None, initial=dict, load=lambda arrays: None,  # type: ignore[arg-type]
                             evaluate=dict, save=lambda out, arrays: None, sample=lambda: "text", params=7,
                             metric_names={})
        self.trained: list[int] = []

    def train(self, grid: Any, recorder: Recorder, resumed: Checkpoint | None) -> None:
        for r in range(resumed.round + 1 if resumed else 0, ROUNDS + 1):
            grid.get_node_ids()
            wall_s, elapsed_s = recorder.clock()
            row = {"round": r, "eval_loss": 1 / (r + 1), "eval_ppl": 2.0, "eval_acc": 0.5, "bytes_down": r,
                   "wall_s": wall_s, "elapsed_s": elapsed_s}
            recorder.record(row, [{"round": r, "node": 1}],
                            lambda: Checkpoint(round=r, target={"w": torch.full((1,), float(r))}))  # noqa: B023
            self.trained.append(r)

    def arrays(self) -> ArrayRecord:
        return ArrayRecord()

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {"rounds": ROUNDS}


@pytest.fixture(autouse=True)
def reports(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The run directories a report was written for (the stand-in's rows are not a real run's)."""
    written: list[Path] = []
    monkeypatch.setattr(lifecycle, "write_report", written.append)
    return written


def new_run(path: Path) -> RunDir:
    return RunDir(path, load_recipe("quickstart", ["output.checkpoint_every=2", "output.save_model=false"]))


def test_a_stop_ends_the_run_at_the_next_grid_call_and_the_resume_ends_as_the_uninterrupted_run(tmp_path, reports):
    first = new_run(tmp_path / "whole")
    whole = run_course(NodesOnly(), first.recipe, first, Counting, on_round=lambda row: None)  # type: ignore[arg-type]
    assert whole["status"] == "ok" and whole["bytes_down"] == sum(range(ROUNDS + 1)) and whole["target_params"] == 7
    assert whole["initial"]["eval_loss"] == 1.0 and whole["final"]["eval_loss"] == 1 / (ROUNDS + 1)
    assert reports == [tmp_path / "whole"]

    run, stop = new_run(tmp_path / "stopped"), threading.Event()

    def stop_after_3(row: dict[str, Any]) -> None:
        if row["round"] == 3:
            stop.set()

    stopped = run_course(NodesOnly(), run.recipe, run, Counting, on_round=stop_after_3, stop=stop)  # type: ignore[arg-type]
    assert stopped["status"] == "interrupted" and (stopped["last_round"], stopped["resume_after"]) == (3, 2), stopped
    assert [r["round"] for r in read_jsonl(run.path / "metrics.jsonl")] == [0, 1, 2, 3] and len(reports) == 1

    course = Counting()
    resumed = run_course(NodesOnly(), run.recipe, RunDir.reopen(run.path), lambda: course, on_round=lambda row: None,  # type: ignore[arg-type]
                         resume=True)
    assert course.trained == [3, 4, 5]  # round 3 was after the checkpoint: trained again, its first rows cut
    assert [r["round"] for r in read_jsonl(run.path / "metrics.jsonl")] == list(range(ROUNDS + 1))
    assert [r["round"] for r in read_jsonl(run.path / "clients.jsonl")] == list(range(ROUNDS + 1))
    host = ("wall_s", "server_peak_rss_mb")  # the host's clock and this process's memory high-water mark so far
    assert {k: v for k, v in resumed.items() if k not in host} == {k: v for k, v in whole.items() if k not in host}
    assert resumed["server_peak_rss_mb"] >= whole["server_peak_rss_mb"] > 0  # one process: its peak only grows
    assert resumed["wall_s"] >= stopped["wall_s"] and reports[-1] == run.path


def test_an_exception_is_a_failed_summary_and_raises(tmp_path):
    run = new_run(tmp_path / "broken")

    def broken() -> Counting:
        raise ValueError("no target")

    with pytest.raises(ValueError, match="no target"):
        run_course(NodesOnly(), run.recipe, run, broken, on_round=lambda row: None)  # type: ignore[arg-type]
    summary = run.read_summary()
    assert summary is not None and summary["status"] == "failed" and summary["error"] == "ValueError: no target"
