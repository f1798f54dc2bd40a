"""The processes a test started: what was left running is a defect the run-lifecycle tests check for."""

from __future__ import annotations

import time
from pathlib import Path

import psutil


def session_members(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a subprocess started with ``start_new_session`` and all it spawned)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields after "(comm)": state, ppid, pgrp, session
            members.append(int(stat.parent.name))
    return members


def running(proc: psutil.Process) -> bool:
    """Whether ``proc`` still runs: neither gone nor a zombie (exited, its parent yet to reap it)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def still_running(procs: list[psutil.Process], timeout_s: float, poll_s: float = 0.2) -> list[psutil.Process]:
    """Those of ``procs`` still :func:`running` once none is, or after ``timeout_s``. Polled rather than
    psutil.wait_procs, which waits for a zombie as for a live process: a stopped run's processes that their parent
    has not reaped yet would hold the caller for the whole timeout."""
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in procs if running(p)]) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return alive
