"""A Grid that hands every call to another Grid (the base of the wrappers that change one behaviour), and the one
loop that pulls replies (:func:`pull_replies`), which every wait for replies goes through."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping

from flwr.app import Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run


class WrappedGrid(Grid):
    """Delegates every Grid call to ``grid``; subclasses override what they change."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid

    def set_run(self, run: Run) -> None:
        """Delegated."""
        self.grid.set_run(run)

    @property
    def run(self) -> Run:
        """Delegated."""
        return self.grid.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        """Delegated."""
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        """Delegated."""
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Delegated."""
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Delegated."""
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Delegated."""
        return self.grid.send_and_receive(messages, timeout=timeout)


# Flower's simulation engine moves pushed messages into its FIFO work queue in sweeps over the nodes, one sweep every
# 0.1 s (``add_messages_to_queue`` in flwr/server/superlink/fleet/vce/vce_api.py): messages pushed together are
# queued in node order, messages pushed a sweep apart in push order
ENGINE_SWEEP_S = 0.1
PACED_PULL_S = 0.02  # a paced batch's pull interval: a reply's slot is refilled this soon (pulls are in memory)
# a client answering sooner than this (ten engine sweeps) after its push is short: for such clients ordering gains
# less than the sweep each paced message waits for (at 10,000 nodes a sweep takes tenths of a second), so the rest of
# the round is pushed at once
PACED_MIN_S = 10 * ENGINE_SWEEP_S


def training(messages: list[Message]) -> bool:
    """A batch of TRAIN messages only (what a round's clients train; nothing else is paced or cut by a quorum)."""
    return bool(messages) and all(m.metadata.message_type == MessageType.TRAIN for m in messages)


def collect(grid: Grid, messages: Iterable[Message], timeout: float | None, pull_interval_s: float,
            enough: Callable[[list[Message]], bool] = lambda replies: False,
            pause: Callable[[float], object] = time.sleep, slots: int = 0) -> tuple[list[Message], set[str]]:
    """Push ``messages`` through ``grid``, then pull until every reply is in, ``enough(replies)`` holds or the
    deadline passes, pausing ``pull_interval_s`` between pulls (Flower's own grids wait the same way). Returns
    the replies and the ids of the messages still unanswered.

    ``slots``: the clients the simulation engine runs at once, when fewer than the messages. The messages are
    then pushed in their order (the caller's: longest first) ``slots`` at once, one more after an engine sweep and
    then one per reply, so the engine's queue always holds one and takes them in that order rather than node
    order: the clients are list-scheduled on the slots longest first. Once a reply comes back within
    :data:`PACED_MIN_S` of its push, the rest go at once: for clients that short, ordering gains less than the engine
    sweep each paced message waits for. A message not yet pushed when the deadline passes or ``enough`` holds is
    never sent."""
    messages = list(messages)
    end = time.monotonic() + timeout if timeout is not None else math.inf
    if not 0 < slots < len(messages):
        return pull_replies(grid, dict.fromkeys(grid.push_messages(messages), end), pull_interval_s, enough, pause)
    unsent = deque(messages)
    pushed_at: dict[str, float] = {}

    def push(count: int) -> dict[str, float]:
        """The next ``count`` messages pushed (as many as are left); their ids -> the deadline."""
        ids = _push(grid, [unsent.popleft() for _ in range(min(count, len(unsent)))])
        pushed_at.update(dict.fromkeys(ids, time.monotonic()))
        return dict.fromkeys(ids, end)

    first = push(slots)
    queue_after = time.monotonic() + 1.5 * ENGINE_SWEEP_S  # the first batch is in the engine's queue by then
    queued = short = False

    def refill(got: list[Message]) -> dict[str, float]:
        """One more message per reply, the one that waits in the engine's queue once its sweep is past, and every
        message left once a client proved short."""
        nonlocal queued, short
        now = time.monotonic()
        if now >= end:
            return {}
        short = short or any(now - pushed_at[m.metadata.reply_to_message_id] < PACED_MIN_S for m in got)
        more = len(unsent) if short else len(got)
        if not queued and now >= queue_after:
            queued, more = True, more + 1
        return push(more)

    return pull_replies(grid, first, min(pull_interval_s, PACED_PULL_S), enough, pause, refill)


def _push(grid: Grid, messages: list[Message]) -> list[str]:
    """Push ``messages`` (none: no call); their ids."""
    return list(grid.push_messages(messages)) if messages else []


def pull_replies(grid: Grid, due: Mapping[str, float], pull_interval_s: float,
                 enough: Callable[[list[Message]], bool] = lambda replies: False,
                 pause: Callable[[float], object] = time.sleep,
                 refill: Callable[[list[Message]], Mapping[str, float]] | None = None,
                 ) -> tuple[list[Message], set[str]]:
    """The one pull loop: pull the replies to the pushed messages of ``due`` (message id -> the ``time.monotonic()``
    at which its reply is no longer waited for) until every reply is in, ``enough(replies)`` holds or every
    unanswered message is past its time, pausing ``pull_interval_s`` between pulls. ``refill`` (a paced push) is
    given each pull's replies and returns the messages it pushed in turn, waited for as well. Returns the replies
    and the ids of the messages unanswered (a reply that comes later is never pulled here)."""
    due = dict(due)
    waiting, late = set(due), set[str]()
    replies: list[Message] = []
    while waiting:
        got = list(grid.pull_messages(waiting))
        replies.extend(got)
        waiting.difference_update(m.metadata.reply_to_message_id for m in got)
        now = time.monotonic()
        late |= {mid for mid in waiting if due[mid] <= now}
        waiting -= late
        if enough(replies):
            break
        if refill is not None:
            more = refill(got)
            due.update(more)
            waiting.update(more)
        if not waiting:
            break
        pause(pull_interval_s)
    return replies, waiting | late
