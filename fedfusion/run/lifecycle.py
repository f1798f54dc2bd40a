"""One run's lifecycle, whatever trains it: resume from the checkpoint, record each round (ledgers, progress,
checkpoint), stop at a Ctrl-C, then the model, the summary and the report.

What trains is a :class:`Course`: the fusion strategy's rounds (:class:`fedfusion.run.federation.Federation`) or a
central method's optimizer steps (:class:`fedfusion.run.central.CentralCourse`; a units run's step is its round).
:func:`run_course` gives it the Grid (stoppable: :class:`~fedfusion.strategies.stop.StopGrid`; paced onto a
simulation's slots: :class:`~fedfusion.strategies.paced.PacedGrid`), the checkpoint a
resume continues after and the :class:`Recorder` every round goes through, and writes what every run writes; a
course builds its own target and rows and adds its own summary fields.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from logging import INFO
from typing import Any, Protocol

from flwr.app import ArrayRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from transformers.utils import logging as hf_logging

from fedfusion.analysis.report import read_jsonl, write_report
from fedfusion.config.recipe import Recipe
from fedfusion.devices.hardware import peak_rss_mb
from fedfusion.run.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from fedfusion.run.run_dir import RunDir
from fedfusion.run.slots import EngineSlots
from fedfusion.run.targets import Target
from fedfusion.strategies.paced import PacedGrid
from fedfusion.strategies.stop import RunInterrupted, StopGrid

RoundCallback = Callable[[dict[str, Any]], None]
METRICS = ("eval_loss", "eval_ppl", "eval_acc")  # a scored row's central evaluation, the summary's initial and final
TOTALS = ("bytes_down", "bytes_up", "energy_j", "co2_g", "virtual_s")  # summed over every row into the summary


class Recorder:
    """Every round of a run goes through here: its metrics row, its clients' ledger rows, the progress callback and,
    every ``checkpoint_every`` rounds, the checkpoint. Holds the rows (a resumed run's start with the ledger's, cut
    back to the checkpoint) and the round a resume continues after."""

    def __init__(self, run: RunDir, on_round: RoundCallback, checkpoint_every: int = 0,
                 resumed: Checkpoint | None = None) -> None:
        self.run, self.on_round, self.checkpoint_every = run, on_round, checkpoint_every
        self.start = self.last = time.perf_counter()
        self.rows: list[dict[str, Any]] = []
        self.saved_round: int | None = None  # the round of the last checkpoint, the one a resume continues after
        if resumed is not None:  # rounds up to the checkpoint are already in the ledger
            self.saved_round = resumed.round
            self.start -= resumed.elapsed_s
            self.rows = read_jsonl(run.path / "metrics.jsonl")

    def clock(self) -> tuple[float, float]:
        """The row being recorded's ``(wall_s, elapsed_s)``: seconds since the last row, and since the run began
        (its earlier parts included)."""
        now = time.perf_counter()
        wall_s, self.last = now - self.last, now
        return wall_s, now - self.start

    def record(self, row: dict[str, Any], clients: Iterable[dict[str, Any]] = (),
               checkpoint: Callable[[], Checkpoint] | None = None) -> None:
        """Write round ``row["round"]``'s row and its clients' rows, save ``checkpoint()`` when the round is due
        one, then hand the row to the progress callback."""
        self.rows.append(row)
        self.run.log_round(row)
        self.run.log_clients(list(clients))
        server_round = row["round"]
        if checkpoint is not None and self.checkpoint_every and server_round and server_round % self.checkpoint_every == 0:
            save_checkpoint(self.run.path, checkpoint())
            self.saved_round = server_round
        self.on_round(row)

    @property
    def last_round(self) -> int | None:
        """The last round recorded (None before round 0's row)."""
        return self.rows[-1]["round"] if self.rows else None


class Course(Protocol):
    """What trains the target in a run's lifecycle."""

    @property
    def rounds(self) -> int:
        """The run's rounds (a central method's optimizer steps), resumed ones included."""
        ...

    @property
    def target(self) -> Target:
        """The target being trained (saved, sampled and described by the summary)."""
        ...

    def train(self, grid: Grid, recorder: Recorder, resumed: Checkpoint | None) -> None:
        """Train the rounds after ``resumed``'s (all of them without), each recorded through ``recorder``."""
        ...

    def arrays(self) -> ArrayRecord:
        """The trained target's arrays (the run's ``model/``)."""
        ...

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The finished run's own summary fields, from its metrics rows."""
        ...


def scored_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The metrics rows central evaluation scored (``train.eval_every``: round 0, the last round, every n-th)."""
    return [r for r in rows if r.get("eval_loss") is not None]


def earlier_wall_s(run: RunDir, ckpt: Checkpoint) -> float:
    """Host seconds the run's earlier parts took: what their last summary says or, for a part killed before it
    could write one, the time up to its last checkpoint (whichever is more; both count every earlier part)."""
    summary = run.read_summary() or {}
    return max(float(summary.get("wall_s", 0.0)), ckpt.elapsed_s)


def run_course(grid: Grid, recipe: Recipe, run: RunDir, build: Callable[[], Course], on_round: RoundCallback,
               resume: bool = False, stop: threading.Event | None = None) -> dict[str, Any]:
    """Run the course ``build`` makes over ``grid``, writing every output into ``run``; returns the summary.

    With ``resume`` it continues from the checkpoint in ``run`` (:mod:`fedfusion.run.checkpoint`), the ledgers cut
    back to it, and its ``wall_s`` adds up every part. Setting ``stop`` ends the run at the next Grid call with
    ``status: interrupted``, the last completed round and the round a resume continues after; a stop that is a
    failure of what runs the clients (:class:`~fedfusion.strategies.stop.StopRequest`) and any exception are
    ``status: failed`` with the error, and raise.
    """
    started, earlier_s, rounds = time.perf_counter(), 0.0, 0
    recorder: Recorder | None = None
    try:
        ckpt = load_checkpoint(run.path) if resume else None
        course = build()
        rounds = course.rounds
        if ckpt is not None:
            earlier_s = earlier_wall_s(run, ckpt)
            run.cut_ledgers(ckpt.round)
            log(INFO, "fedfusion: resuming %s after round %d of %d", run.path, ckpt.round, rounds)
        recorder = Recorder(run, on_round, recipe.output.checkpoint_every, ckpt)
        stoppable = grid if stop is None else StopGrid(grid, stop)
        # in a simulation, a round's clients start longest first on the engine's slots
        course.train(PacedGrid(stoppable, EngineSlots(recipe.engine.cpus_per_client)), recorder, ckpt)
        if recipe.output.save_model:
            hf_logging.disable_progress_bar()  # the run's own progress is the one to show
            course.target.save(run.model_dir, course.arrays())
        rows = recorder.rows
        summary = {
            "status": "ok", "name": recipe.name, **course.summary(rows),
            "target_params": course.target.params, "metric_names": course.target.metric_names,
            "initial": {k: rows[0][k] for k in METRICS},
            "final": {k: scored_rows(rows)[-1][k] for k in METRICS},  # the last round's
            **{k: sum(r.get(k, 0) for r in rows) for k in TOTALS},
            "wall_s": earlier_s + time.perf_counter() - started,
            # this process's peak (the ServerApp; in simulation also the engine's driver, the clients run elsewhere);
            # a resumed run's is the resumed part's
            "server_peak_rss_mb": peak_rss_mb(),
            "sample": course.target.sample(),
        }
        run.write_summary(summary)
        write_report(run.path)
        return summary
    except RunInterrupted as exc:  # raised only by the Grid, which the course gets with the recorder
        if exc.failure is not None:  # not a user's stop: what runs the clients died
            run.write_summary({"status": "failed", "error": exc.failure,
                               "wall_s": earlier_s + time.perf_counter() - started})
            raise RuntimeError(exc.failure) from exc
        summary = {"status": "interrupted", "name": recipe.name, "rounds": rounds,
                   "last_round": recorder.last_round if recorder is not None else None,
                   "resume_after": recorder.saved_round if recorder is not None else None,
                   "wall_s": earlier_s + time.perf_counter() - started}
        run.write_summary(summary)
        return summary
    except BaseException as exc:
        run.write_summary({"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                           "wall_s": earlier_s + time.perf_counter() - started})
        raise
