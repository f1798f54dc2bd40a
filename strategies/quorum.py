"""Over-selection with a quorum: a Grid that closes a training round once enough clients have answered.

Production federated learning over-selects (Bonawitz et al., MLSys 2019, select about 130% of the
clients a round needs) and closes the round as soon as the target number of updates has arrived, so a
round neither waits for stragglers until its deadline nor loses updates to clients that crash. Flower's
``Strategy.start`` waits in ``grid.send_and_receive`` until every reply is in or the deadline passes;
this wrapper keeps every other Grid call as it is and, for a batch of TRAIN messages only, returns as
soon as ``quorum`` replies without an error have arrived (or every reply, or the deadline). Replies that
come later are not waited for (the strategy records those clients as ``cut``); the next call pulls and
discards whatever of them has arrived by then, so the SuperLink frees them.

Which clients make the quorum depends on who finishes first, so a run with over-selection is not
bit-reproducible across machines; without it (the default) nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterable

from fedfusion.strategies.wrapped import WrappedGrid, collect, training
from flwr.app import Message
from flwr.serverapp import Grid


class QuorumGrid(WrappedGrid):
    """``grid`` with early-closing training rounds: see the module docstring."""

    def __init__(self, grid: Grid, quorum: int, pull_interval_s: float = 0.1) -> None:
        if quorum < 1:
            raise ValueError(f"quorum must be >= 1, got {quorum}")
        super().__init__(grid)
        self.quorum, self.pull_interval_s = quorum, pull_interval_s
        self.leftover: set[str] = set()  # ids of train messages whose replies were not waited for

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Training batches return at ``quorum`` good replies; anything else is the wrapped grid's."""
        if self.leftover:  # late replies of earlier rounds: pulled once, without waiting, and dropped
            late = list(self.grid.pull_messages(self.leftover))
            self.leftover.difference_update(m.metadata.reply_to_message_id for m in late)
        messages = list(messages)
        if not training(messages):
            return self.grid.send_and_receive(messages, timeout=timeout)
        replies, waiting = collect(self.grid, messages, timeout, self.pull_interval_s,
                                   enough=lambda got: sum(not m.has_error() for m in got) >= self.quorum)
        self.leftover |= waiting
        return replies
