"""Pacing a simulated round onto the engine's slots: a Grid that sends a round's clients longest first.

Flower's simulation engine runs a fixed number of clients at once (its Ray actors) and feeds them from one FIFO
queue, which it fills by sweeping the nodes: after each sweep it waits 0.1 s, and a sweep takes at most one message
per node (``add_messages_to_queue`` in flwr/server/superlink/fleet/vce/vce_api.py). Messages pushed together are
therefore queued in node order, whatever order the strategy made them in, and a round of unequal clients packs
onto the slots by chance. :class:`PacedGrid` pushes a training batch in the strategy's order (longest first:
``FusionStrategy.predicted_s``) so that the engine starts them in that order: the slots' worth at once, one more
once the engine has swept them in, then one per reply, so its queue always holds one message and no slot waits.
That is list scheduling longest first, within 4/3 of the best packing. It changes which client trains when, never
what any client trains or how the round is folded (the strategy folds in sample order).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable

from fedfusion.strategies.sweep import ENGINE_SWEEP_S
from fedfusion.strategies.wrapped import WrappedGrid, pull_replies, training
from flwr.app import Message
from flwr.serverapp import Grid

PACED_PULL_S = 0.02  # a paced batch's pull interval: a freed slot's next message is pushed this soon
# a client answering sooner than this (ten engine sweeps) after its push is short: ordering such clients gains less
# than the sweep each paced message waits for (with Flower's own sweep, tenths of a second at 10,000 nodes), so the
# rest of the round is pushed at once
PACED_MIN_S = 10 * ENGINE_SWEEP_S


class PacedGrid(WrappedGrid):
    """``grid`` whose training batches go out paced (:func:`paced`) when the simulation engine runs fewer clients
    at once than the batch holds (``slots()``; 0 in a deployment, where every node is its own machine). Every
    other call, and every batch it does not pace, is the wrapped grid's own, unchanged."""

    def __init__(self, grid: Grid, slots: Callable[[], int]) -> None:
        super().__init__(grid)
        self.slots = slots

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """A training batch larger than the engine's slots paced, in the order given; anything else delegated."""
        messages = list(messages)
        slots = self.slots() if training(messages) else 0
        if not 0 < slots < len(messages):
            return self.grid.send_and_receive(messages, timeout=timeout)
        replies, _ = paced(self.grid, messages, timeout, slots)
        return replies


def paced(grid: Grid, messages: list[Message], timeout: float | None, slots: int,
          pause: Callable[[float], object] = time.sleep) -> tuple[list[Message], set[str]]:
    """Push ``messages`` in their order: ``slots`` at once, one more after 1.5 engine sweeps (the first ones are
    in the engine's queue by then at a small population), then one per reply; pull every :data:`PACED_PULL_S`
    until every reply is in or the deadline passes. Once a good reply comes back within :data:`PACED_MIN_S` of its
    push, the rest go at once; at the deadline, whatever is left is pushed too (unanswered, as an unpaced round's
    queued messages would be). A message the grid refuses to store is replaced by the next. Returns the replies and
    the ids of the messages unanswered."""
    end = time.monotonic() + timeout if timeout is not None else math.inf
    unsent = deque(messages)
    pushed_at: dict[str, float] = {}

    def push(count: int) -> dict[str, float]:
        """Up to ``count`` more messages stored by the grid (fewer only when none are left); their ids -> the
        deadline."""
        ids: list[str] = []
        while len(ids) < count and unsent:
            batch = [unsent.popleft() for _ in range(min(count - len(ids), len(unsent)))]
            ids += list(grid.push_messages(batch))
        pushed_at.update(dict.fromkeys(ids, time.monotonic()))
        return dict.fromkeys(ids, end)

    first = push(slots)
    queue_after = time.monotonic() + 1.5 * ENGINE_SWEEP_S
    queued = short = False

    def refill(got: list[Message]) -> dict[str, float]:
        """One more message per reply, the one that waits in the engine's queue once its sweep is past, and every
        message left once a client proved short or the deadline passed."""
        nonlocal queued, short
        now = time.monotonic()
        short = short or any(not m.has_error() and now - pushed_at.get(m.metadata.reply_to_message_id, -math.inf)
                             < PACED_MIN_S for m in got)
        more = len(unsent) if short or now >= end else len(got)
        if not queued and now >= queue_after:
            queued, more = True, more + 1
        return push(more)

    return pull_replies(grid, first, PACED_PULL_S, pause=pause, refill=refill)
