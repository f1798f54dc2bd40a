"""Stopping a run between safe points: a Grid that raises :class:`RunInterrupted` once a stop is asked.

Flower's ``Strategy.start`` spends a round waiting in ``grid.send_and_receive`` for replies, up to the
round deadline, and offers no way to stop. This wrapper polls for replies itself and checks a
``threading.Event`` before every Grid call and between polls, so a stop asked from another thread (the
CLI's Ctrl-C handler) ends the strategy's loop within one poll. It raises only at Grid calls, never while
the server folds a round or writes its ledgers and checkpoint, so what a run has saved stays whole; a
round whose replies were still coming in is dropped (the run resumes from its last checkpoint).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from fedfusion.strategies.wrapped import WrappedGrid, collect
from flwr.app import Message
from flwr.serverapp import Grid


class RunInterrupted(Exception):
    """A stop was asked while the strategy was talking to the nodes; ``failure`` says why when it was not a user's
    stop but a failure of what runs the clients (see :class:`StopRequest`)."""

    def __init__(self, message: str, failure: str | None = None) -> None:
        super().__init__(message)
        self.failure = failure


class StopRequest(threading.Event):
    """The event a :class:`StopGrid` polls: ``set()`` is a user's stop (Ctrl-C), ``fail(reason)`` a stop because
    the clients' runtime died (the run is then recorded as failed, with the reason)."""

    failure: str | None = None

    def fail(self, reason: str) -> None:
        """Stop the run as failed, keeping the first reason given."""
        if self.failure is None:
            self.failure = reason
        self.set()


class StopGrid(WrappedGrid):
    """``grid`` whose calls raise :class:`RunInterrupted` once ``stop`` is set."""

    def __init__(self, grid: Grid, stop: threading.Event, pull_interval_s: float = 0.1) -> None:
        super().__init__(grid)
        self.stop, self.pull_interval_s = stop, pull_interval_s

    def _check(self) -> None:
        if self.stop.is_set():
            failure = getattr(self.stop, "failure", None)
            raise RunInterrupted(failure or "stop asked", failure)

    def get_node_ids(self) -> Iterable[int]:
        """Delegated, unless stopped."""
        self._check()
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Delegated, unless stopped."""
        self._check()
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Delegated, unless stopped (also after the pull: replies that came in after a stop are not used)."""
        self._check()
        replies = self.grid.pull_messages(message_ids)
        self._check()
        return replies

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push, then pull until every reply is in or the deadline passes, as Flower's grids do, but stoppable."""
        replies, _ = collect(self, messages, timeout, self.pull_interval_s, pause=self.stop.wait)
        self._check()
        return replies
