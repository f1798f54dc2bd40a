"""Ctrl-C: the handler asks for a stop; StopGrid ends the strategy's wait for replies at the next poll."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from fedfusion.strategies.stop import RunInterrupted, StopGrid
from flwr.app import MessageType

from fedfusion.cli import main
from fedfusion.run.interrupt import CtrlC
from fedfusion.run.signals import Terminated, sigterm_as_interrupt
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


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM])
def test_the_first_ctrl_c_or_sigterm_asks_for_a_stop_a_second_ctrl_c_raises_and_the_old_handlers_come_back(first):
    calls = []
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with CtrlC(calls.append) as ctrl_c:
        os.kill(os.getpid(), first)
        assert ctrl_c.stop.wait(5) and calls == [first]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler runs (and raises) at the next bytecode, long before this ends
    assert calls == [first] and {s: signal.getsignal(s) for s in before} == before


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM])
def test_a_sigterm_after_the_stop_does_not_force_it(first):
    """`timeout`, Slurm and systemd send SIGTERM to the process and then its group, and compare passes one on: the
    second must not turn the clean stop into a forced one."""
    calls = []
    with CtrlC(calls.append) as ctrl_c:
        os.kill(os.getpid(), first)
        assert ctrl_c.stop.wait(5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # a raising handler would have raised by now
    assert calls == [first]


def test_sigterm_outside_a_run_raises_terminated_and_the_old_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated), sigterm_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigterm_unwinds_a_command_without_its_own_stop_so_its_cleanup_runs(monkeypatch, capsys):
    """`fedfusion deploy` (like every command but `run`) has no stop of its own: a SIGTERM must unwind it like Ctrl-C,
    so its ``finally`` stops the SuperLink and SuperNodes it started (Python's default for SIGTERM skips it)."""
    import fedfusion.deploy

    cleaned = []

    def deploy_local(*args: object, **kwargs: object) -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            cleaned.append("stopped")

    monkeypatch.setattr(fedfusion.deploy, "deploy_local", deploy_local)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["deploy", "quickstart", "rounds=1"]) == 130
    assert cleaned == ["stopped"] and "terminated (SIGTERM)" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is before
