"""Flower's simulation engine swept over the nodes that have a message waiting, so a round costs what its messages
cost, not the population times them.

Flower 1.42's engine feeds its actors from one queue, which it fills by sweeping the nodes: every 0.1 s it asks the
LinkState for each node's next message (``add_messages_to_queue`` in flwr/server/superlink/fleet/vce/vce_api.py),
and the in-memory LinkState answers each ask by looking through every stored message, checking each
(``InMemoryLinkState.get_message_ins``: an expired message, or one between nodes no longer in the federation, is
deleted). A sweep therefore costs nodes x pending messages, and no message moves while it runs: 1.44 s at 10,000
nodes with a round's 50 pending, 0.21 s at 100,000 nodes with none (benchmarks/results/scale_100k.md).

:func:`sweep` checks every stored message once (the checks Flower's sweep repeats for each node, so the same
messages are deleted), then asks only the nodes that have an undelivered message, in the engine's node order,
through the LinkState's own ``get_message_ins``: the same asks as Flower's sweep makes of those nodes (the same
messages, marked delivered as there), none of the asks whose answer is empty. One difference of timing: which nodes
wait is read at the start of a sweep, so a message stored during one goes out in the next, 0.1 s later (Flower's
takes it in the same sweep if its node comes later in the order). It reads the in-memory LinkState's message store
under its lock; any other LinkState is swept by Flower's own function. ``fedfusion run`` installs it
(:func:`install`) before it starts the simulation; under ``flwr run`` the ClientApp module installs it when it is
loaded in a process that holds Flower's engine, which Flower does before the engine starts
(``fedfusion.client_app``). ``FEDFUSION_SWEEP=flower`` keeps Flower's sweep (benchmarks/scale.py measures both).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from queue import Queue
from typing import Any

from flwr.app import Message
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.linkstate import LinkState
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

ENGINE_SWEEP_S = 0.1  # the engine's wait after each sweep over the nodes (Flower's, kept)
ENV = "FEDFUSION_SWEEP"  # "flower": Flower's own sweep over every node (what benchmarks/scale.py compares with)
FLOWER_SWEEP: Callable[..., None] = vce_api.add_messages_to_queue


def waiting_nodes(state: InMemoryLinkState, order: Mapping[int, int]) -> list[int]:
    """The nodes of ``order`` (node id -> its place in the engine's sweep) with an undelivered message in
    ``state``, in sweep order, once every stored message is checked (expired and stray ones deleted, as each of
    Flower's asks does)."""
    with state.lock:
        state._check_stored_messages(set(state.message_ins_store))
        waiting = {m.metadata.dst_node_id for m in state.message_ins_store.values() if m.metadata.delivered_at == ""}
    return sorted((n for n in waiting if n in order), key=order.__getitem__)


def sweep(state: LinkState, queue: Queue[Message], nodes_mapping: Mapping[int, int], f_stop: threading.Event) -> None:
    """Flower's ``add_messages_to_queue`` (same arguments, same loop and wait), asking only :func:`waiting_nodes`."""
    if not isinstance(state, InMemoryLinkState):
        FLOWER_SWEEP(state, queue, nodes_mapping, f_stop)
        return
    order = {node: i for i, node in enumerate(nodes_mapping)}  # registered before the engine starts, and fixed
    while not f_stop.is_set():
        for node_id in waiting_nodes(state, order):
            for msg in state.get_message_ins(node_id=node_id, limit=1):
                queue.put(msg)
        f_stop.wait(ENGINE_SWEEP_S)


def install() -> None:
    """Make :func:`sweep` the engine's (unless ``FEDFUSION_SWEEP=flower``): called before ``run_simulation``, whose
    engine thread looks the function up when it starts."""
    chosen: Any = FLOWER_SWEEP if os.environ.get(ENV, "").strip().lower() == "flower" else sweep
    vce_api.add_messages_to_queue = chosen
