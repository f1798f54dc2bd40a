"""SIGTERM handled as Ctrl-C: what a job scheduler, ``timeout``, ``kill`` or ``docker stop`` sends gets the clean stop a
terminal's Ctrl-C gets (Python's default for SIGTERM ends the process at once, skipping every ``finally``: Ray's
processes and a deployment's SuperLink and SuperNodes would be left running). Light on purpose: the CLI installs it
before anything heavy is imported."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a program stopped by Ctrl-C; a stopped run exits with it


class Terminated(KeyboardInterrupt):
    """The KeyboardInterrupt a SIGTERM raises, so a caller can tell it from a terminal's Ctrl-C (which reaches the
    whole process group, while SIGTERM reaches one process and must be passed on to its children)."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While active, SIGTERM raises :class:`Terminated` in the main thread; the previous handler comes back after.
    Called from another thread (where Python lets no handler be set) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
