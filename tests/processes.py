"""The processes a test started: what was left running is a defect the run-lifecycle tests check for."""

from __future__ import annotations

from pathlib import Path


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
