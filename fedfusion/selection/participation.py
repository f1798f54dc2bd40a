"""Who trains each round: availability, then a selector, then dropouts, on a simulated clock.

Every fusion strategy asks the same question each round, so it lives here, without Flower:

1. **Eligible**: the usable clients (answered the capability query, have an assignment), filtered by
   the availability model when the recipe enables it (:mod:`fedfusion.devices.availability`).
2. **Selected**: a :class:`~fedfusion.selection.selectors.Selector` picks up to k of them from their predicted
   duration, energy and carbon (the round's work priced on each client's device profile) and what it
   learned from earlier rounds.
3. **Dropped**: with availability on, a selected client whose job would outlast its window (or whose
   user takes the device back, or whose battery would run low) drops out, as does one whose predicted
   duration exceeds the virtual deadline. A dropped client is not sent any work; its planned work is
   charged as wasted energy (an upper bound: the job's share done before leaving is not modelled).
4. **Clock**: simulated time advances by ``round_interval_s`` per round (a deployed server starts a
   round every few minutes, waiting for reports, stragglers and its own work), or by the slowest
   selected client's virtual seconds when that is longer (clients cut by over-selection's quorum are
   not waited for), so diurnal windows open and close as rounds pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedfusion.devices.availability import AvailabilityModel
from fedfusion.devices.catalog import Device
from fedfusion.devices.energy import WorkCost
from fedfusion.selection.selectors import Candidates, Outcome, Selector, statistical_utility


def draw_size(clients_per_round: int, overselect: float) -> int:
    """Clients a round draws: ``clients_per_round`` and, with over-selection, that fraction more (rounded up)."""
    return clients_per_round + math.ceil(round(clients_per_round * overselect, 9))


@dataclass(frozen=True)
class Draw:
    """One round's participation: clients to train, and clients that dropped out before finishing."""

    train: list[int]
    dropped: list[int]
    clock_s: float  # simulated time at the start of the round


class Participation:
    """Availability -> selector -> dropouts for clients identified by partition id; see the module docstring."""

    def __init__(self, selector: Selector, catalog: dict[str, Device],
                 availability: AvailabilityModel | None = None, start_clock_s: float = 0.0,
                 round_interval_s: float = 600.0, deadline_s: float = 0.0) -> None:
        self.selector, self.catalog = selector, catalog
        self.availability = availability
        self.clock_s, self.round_interval_s = float(start_clock_s), float(round_interval_s)
        self.deadline_s = float(deadline_s)
        self.examples: dict[int, int] = {}  # per client, once it reports it
        self.planned: dict[int, WorkCost] = {}

    def eligible(self, round: int, clients: Iterable[int]) -> int:
        """How many of ``clients`` (partition ids) the availability model lets train in ``round`` (all of them
        without one): what a candidate pool must hold for the draw to find its ``k``."""
        ids = np.asarray(sorted(clients), dtype=np.int64)
        if self.availability is None or not len(ids):
            return len(ids)
        return int(self.availability.state(round, self.clock_s, ids).eligible.sum())

    def draw(self, round: int, clients: dict[int, str], k: int, costs: dict[str, WorkCost]) -> Draw:
        """Pick up to ``k`` of ``clients`` (partition id -> device tier) for ``round``.

        ``costs`` prices this round's work per tier; the availability model, if any, indexes devices by
        partition id.
        """
        ids = np.asarray(sorted(clients), dtype=np.int64)
        battery = plugged = None
        if self.availability is not None and len(ids):
            state = self.availability.state(round, self.clock_s, ids)
            ids, battery, plugged = ids[state.eligible], state.battery[state.eligible], state.plugged[state.eligible]
        tiers = [clients[int(i)] for i in ids]
        examples = np.array([self.examples.get(int(i), 1) for i in ids], dtype=float)
        candidates = Candidates.from_costs(ids, tiers, costs, battery=battery, plugged=plugged,
                                           zone=[self.catalog[t].zone for t in tiers], examples=examples)
        picked = self.selector.select(candidates, k, round)
        self.planned = {i: costs[clients[i]] for i in picked}
        dropped: set[int] = set()
        if self.deadline_s:
            dropped |= {i for i in picked if self.planned[i].virtual_s > self.deadline_s}
        if self.availability is not None and picked:
            done = self.availability.completes(
                round, self.clock_s, picked, [self.planned[i].virtual_s for i in picked],
                energy_j=[self.planned[i].wall_j for i in picked],
                battery_wh=[self.catalog[clients[i]].battery_wh or 0.0 for i in picked])
            dropped |= {i for i, ok in zip(picked, done) if not ok}
        return Draw([i for i in picked if i not in dropped], sorted(dropped), self.clock_s)

    def settle(self, round: int, results: dict[int, tuple[str, int, float | None]]) -> None:
        """Tell the selector how the round went and advance the clock.

        ``results`` maps each client drawn this round to (status, examples, train loss); a client's
        duration, energy and carbon are the planned ones (what the ledger charges it).
        """
        outcomes = []
        for client, (status, examples, loss) in results.items():
            cost = self.planned[client]
            if examples:
                self.examples[client] = examples
            utility = statistical_utility(examples, loss) if status == "ok" and loss is not None else 0.0
            outcomes.append(Outcome(client, status, utility, cost.virtual_s, cost.wall_j, cost.co2_g))
        self.selector.feedback(round, outcomes)
        counted = [c for i, c in self.planned.items() if results.get(i, ("",))[0] != "cut"]  # cut: not waited for
        self.clock_s += max([self.round_interval_s, *(c.virtual_s for c in counted)])

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state for checkpoints (the availability model is a pure function of the seed)."""
        return {"selector": self.selector.state_dict(), "clock_s": self.clock_s,
                "examples": {str(k): v for k, v in self.examples.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.selector.load_state_dict(state["selector"])
        self.clock_s = float(state["clock_s"])
        self.examples = {int(k): int(v) for k, v in state["examples"].items()}


def jain_index(counts: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 when all participate equally, 1/n when one does all."""
    total, squares = sum(counts), sum(c * c for c in counts)
    return total * total / (len(counts) * squares) if squares else 0.0
