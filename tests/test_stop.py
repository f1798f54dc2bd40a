"""StopGrid: a stop asked from another thread ends the strategy's wait for replies at the next poll."""

from __future__ import annotations

import threading
import time

import pytest
from flwr.app import MessageType

from fedfusion.strategies.stop import RunInterrupted, StopGrid
from tests.test_quorum import TimedGrid, _messages
from tests.test_strategy import task_identity  # noqa: F401 (autouse fixture)


def test_without_a_stop_it_waits_for_every_reply_like_flowers_grids():
    inner = TimedGrid({1: 1, 2: 3})
    replies = StopGrid(inner, threading.Event(), pull_interval_s=0.0).send_and_receive(_messages([1, 2]), timeout=60)
    assert len(replies) == 2 and inner.pulls == 3


def test_a_stop_ends_a_round_that_is_waiting_for_replies_within_one_poll():
    stop = threading.Event()
    grid = StopGrid(TimedGrid({1: 10**9}), stop, pull_interval_s=0.05)
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    with pytest.raises(RunInterrupted):
        grid.send_and_receive(_messages([1]), timeout=600)
    assert time.monotonic() - started < 1.0


def test_after_a_stop_nothing_more_is_sent():
    stop = threading.Event()
    stop.set()
    inner = TimedGrid({1: 1})
    with pytest.raises(RunInterrupted):
        StopGrid(inner, stop).send_and_receive(_messages([1], MessageType.QUERY), timeout=60)
    assert inner.pushed == {}
