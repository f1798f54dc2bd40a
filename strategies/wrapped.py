"""A Grid that hands every call to another Grid (the base of the wrappers that change one behaviour), and the one
loop that pulls replies (:func:`pull_replies`), which every wait for replies goes through."""

from __future__ import annotations

import math
import time
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


def training(messages: list[Message]) -> bool:
    """A batch of TRAIN messages only (what a round's clients train; nothing else is paced or cut by a quorum)."""
    return bool(messages) and all(m.metadata.message_type == MessageType.TRAIN for m in messages)


def collect(grid: Grid, messages: Iterable[Message], timeout: float | None, pull_interval_s: float,
            enough: Callable[[list[Message]], bool] = lambda replies: False,
            pause: Callable[[float], object] = time.sleep) -> tuple[list[Message], set[str]]:
    """Push ``messages`` through ``grid``, then pull until every reply is in, ``enough(replies)`` holds or the
    deadline passes, pausing ``pull_interval_s`` between pulls (Flower's own grids wait the same way). Returns
    the replies and the ids of the messages still unanswered."""
    ids = grid.push_messages(messages)
    end = time.monotonic() + timeout if timeout is not None else math.inf
    return pull_replies(grid, dict.fromkeys(ids, end), pull_interval_s, enough, pause)


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
