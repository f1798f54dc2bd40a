"""Central methods: the server trains the target one optimizer step at a time and the federation's nodes compute
parts of each step (the units mode: its linear layers' GEMM tiles). No fusion rounds: a step is the run's round.

A method of this kind is a :class:`CentralMethod` (its registry entry's ``central`` hook builds it);
:class:`CentralCourse` drives it through the one run lifecycle (:func:`fedfusion.run.lifecycle.run_course`), which
gives the Ctrl-C, resume, checkpoint, summary and report every method has.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from flwr.app import ArrayRecord
from flwr.serverapp import Grid

from fedfusion.config.methods import hook, method
from fedfusion.config.recipe import Recipe
from fedfusion.run.checkpoint import Checkpoint
from fedfusion.run.lifecycle import Recorder
from fedfusion.run.run_dir import RunDir
from fedfusion.run.targets import Target


class CentralMethod(Protocol):
    """A method whose server steps and whose nodes compute: what :class:`CentralCourse` asks of it."""

    @property
    def steps(self) -> int:
        """The run's optimizer steps."""
        ...

    @property
    def target(self) -> Target:
        """The target the server trains."""
        ...

    def connect(self, grid: Grid, after: int) -> None:
        """Find the federation's nodes on ``grid`` and set them to work (``after``: the step a resumed run continues
        after, 0 for a fresh run)."""
        ...

    def restore(self, ckpt: Checkpoint) -> None:
        """Continue from ``ckpt``: the target and the optimizer's state (:meth:`checkpoint`'s)."""
        ...

    def batches(self) -> Iterator[torch.Tensor]:
        """Every step's batch, in order, the same run after run (a resumed run skips the ones done)."""
        ...

    def first_row(self) -> dict[str, Any]:
        """Round 0's metrics row: the untrained target scored, nothing sent."""
        ...

    def step(self, step: int, batch: torch.Tensor) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """One optimizer step on ``batch``, its parts computed on the nodes: its metrics row (without its host
        seconds) and its clients' ledger rows."""
        ...

    def checkpoint(self, step: int, elapsed_s: float) -> Checkpoint:
        """What a resume after ``step`` needs."""
        ...

    def finish(self) -> None:
        """After the last step: the target back to plain local layers."""
        ...

    def arrays(self) -> ArrayRecord:
        """The trained target's arrays."""
        ...

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The finished run's own summary fields."""
        ...


class CentralCourse:
    """A central method as the lifecycle's :class:`~fedfusion.run.lifecycle.Course`: round 0 scores the untrained
    target, then each step is a round, recorded with its checkpoint when due."""

    def __init__(self, central: CentralMethod) -> None:
        self.central = central

    @property
    def rounds(self) -> int:
        return self.central.steps

    @property
    def target(self) -> Target:
        return self.central.target

    def train(self, grid: Grid, recorder: Recorder, resumed: Checkpoint | None) -> None:
        """Connect, then the steps after ``resumed``'s (its batches drawn all the same, so the steps after it are
        the uninterrupted run's)."""
        done = resumed.round if resumed is not None else 0
        self.central.connect(grid, done)
        if resumed is not None:  # its steps are in the ledger already
            self.central.restore(resumed)
        else:
            row = self.central.first_row()
            recorder.record({**row, "wall_s": recorder.clock()[0]})
        for step, batch in enumerate(self.central.batches(), start=1):
            if step <= done:
                continue
            row, clients = self.central.step(step, batch)
            wall_s, elapsed_s = recorder.clock()
            recorder.record({**row, "wall_s": wall_s, "elapsed_s": elapsed_s}, clients,
                            lambda: self.central.checkpoint(step, elapsed_s))  # noqa: B023 (called at once)
        self.central.finish()

    def arrays(self) -> ArrayRecord:
        return self.central.arrays()

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return self.central.summary(rows)


def central_course(recipe: Recipe, run: RunDir) -> CentralCourse:
    """The course of the recipe's central method, built by its registry entry's ``central`` hook."""
    return CentralCourse(hook(method(recipe.fusion.method).central)(recipe, run))
