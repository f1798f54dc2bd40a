"""Node discovery, written once: the federation's node ids once enough have connected (the simulation engine and a
SuperLink register SuperNodes asynchronously; each caller decides what too few means), and the QUERY messages
that ask them for their capabilities (each caller decides what an unanswered one means)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid


def connected_nodes(grid: Grid, want: int, wait_s: float, poll_s: float = 0.5) -> list[int]:
    """The sorted node ids once ``want`` of them are connected, or whatever is connected after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    nodes = sorted(grid.get_node_ids())
    while len(nodes) < want and time.monotonic() < deadline:
        time.sleep(poll_s)
        nodes = sorted(grid.get_node_ids())
    return nodes


def query_messages(nodes: list[int], config: Mapping[str, Any]) -> list[Message]:
    """One QUERY message per node of ``nodes`` carrying ``config`` (the specs the ClientApp's ``@app.query`` reads:
    its role, data and population), which each node answers with its capabilities (``caps``)."""
    return [Message(RecordDict({"config": ConfigRecord(dict(config))}), dst_node_id=n, message_type=MessageType.QUERY)
            for n in nodes]
