"""Node discovery, written once: the federation's node ids once enough have connected (the simulation engine and a
SuperLink register SuperNodes asynchronously). Each caller decides what too few means."""

from __future__ import annotations

import time

from flwr.serverapp import Grid


def connected_nodes(grid: Grid, want: int, wait_s: float, poll_s: float = 0.5) -> list[int]:
    """The sorted node ids once ``want`` of them are connected, or whatever is connected after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    nodes = sorted(grid.get_node_ids())
    while len(nodes) < want and time.monotonic() < deadline:
        time.sleep(poll_s)
        nodes = sorted(grid.get_node_ids())
    return nodes
