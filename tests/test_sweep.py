"""The engine sweep over waiting nodes (strategies/sweep.py) against Flower's own, on Flower's in-memory LinkState:
the same messages leave in the same sweeps and order, expired ones are dropped alike, and only the waiting nodes are
asked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from queue import Queue
from typing import Any

import pytest
from fedfusion.strategies import sweep
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.fleet.vce.vce_api import _register_nodes
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from scale import OneSweep, registered_run  # noqa: E402 (the benchmark's probe sets a run up as these tests do)

RUN_ID = 3


@pytest.fixture(autouse=True)
def task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages take their run and source from Flower's task identity, as in a ServerApp (restored after)."""
    for name, value in (("_run_id", RUN_ID), ("_task_id", RUN_ID), ("_node_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value)


def federation(nodes: int) -> tuple[Any, dict[int, int], Any]:
    """An in-memory LinkState with ``nodes`` SuperNodes registered as ``run_simulation`` registers them, one run."""
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    mapping = _register_nodes(nodes, factory)
    state, grid = registered_run(factory, RUN_ID)
    return state, mapping, grid


def push(grid: Any, to: list[tuple[int, str]], expired: frozenset[str] = frozenset()) -> None:
    """A QUERY to each (node, tag), in that order; those tagged in ``expired`` are made past their TTL."""
    messages = [Message(RecordDict({"config": ConfigRecord({"tag": tag})}), dst_node_id=node,
                        message_type=MessageType.QUERY) for node, tag in to]
    for m in messages:
        m.metadata.__dict__["_src_node_id"] = 1  # the SuperLink's id, as the Grid's own create_message sets it
    assert all(grid.push_messages(messages))
    for m in messages:
        if m.content.config_records["config"]["tag"] in expired:
            m.metadata.created_at -= 2 * m.metadata.ttl


def sweeps(engine: Any, state: Any, mapping: dict[int, int], count: int) -> list[list[tuple[int, str]]]:
    """What ``engine`` (an ``add_messages_to_queue``) queues in each of ``count`` sweeps, in order: (the node's
    place in the engine's node order, the message's tag)."""
    place = {node: i for i, node in enumerate(mapping)}
    out = []
    for _ in range(count):
        queue: Queue[Message] = Queue()
        engine(state, queue, mapping, OneSweep())
        out.append([(place[m.metadata.dst_node_id], str(m.content.config_records["config"]["tag"]))
                    for m in list(queue.queue)])
    return out


def test_the_waiting_nodes_sweep_queues_what_flowers_sweep_queues_sweep_by_sweep() -> None:
    got = {}
    for name, engine in (("flower", sweep.FLOWER_SWEEP), ("ours", sweep.sweep)):
        state, mapping, grid = federation(16)
        nodes = list(mapping)  # messages out of node order, two to node 7, one past its TTL
        push(grid, [(nodes[7], "a1"), (nodes[2], "b1"), (nodes[7], "a2"), (nodes[11], "c1"), (nodes[5], "late")],
             expired=frozenset({"late"}))
        got[name] = (sweeps(engine, state, mapping, 3), len(state.message_ins_store))
    assert got["ours"] == got["flower"]
    assert got["ours"] == ([[(2, "b1"), (7, "a1"), (11, "c1")], [(7, "a2")], []], 4)  # the expired one dropped


def test_a_delivered_message_that_expires_is_dropped_by_the_next_sweep_as_by_flowers() -> None:
    left = {}
    for name, engine in (("flower", sweep.FLOWER_SWEEP), ("ours", sweep.sweep)):
        state, mapping, grid = federation(8)
        nodes = list(mapping)
        push(grid, [(nodes[1], "answered late"), (nodes[4], "waiting")])
        assert [tag for _, tag in sweeps(engine, state, mapping, 1)[0]] == ["answered late", "waiting"]
        for m in state.message_ins_store.values():  # both delivered, no reply yet; then past their TTL
            m.metadata.created_at -= 2 * m.metadata.ttl
        assert sweeps(engine, state, mapping, 1) == [[]]
        left[name] = len(state.message_ins_store)
    assert left == {"flower": 0, "ours": 0}


def test_only_the_nodes_with_a_message_waiting_are_asked() -> None:
    state, mapping, grid = federation(2000)
    asked: list[int] = []
    ask = state.get_message_ins

    def counting(node_id: int, limit: int | None, **kw: Any) -> list[Message]:
        asked.append(node_id)
        return ask(node_id=node_id, limit=limit, **kw)

    setattr(state, "get_message_ins", counting)  # noqa: B010 (an instance attribute over the method)
    nodes = list(mapping)
    push(grid, [(nodes[1500], "x"), (nodes[3], "y")])
    assert sweeps(sweep.sweep, state, mapping, 1) == [[(3, "y"), (1500, "x")]]
    assert asked == [nodes[3], nodes[1500]]
    asked.clear()
    assert sweeps(sweep.FLOWER_SWEEP, state, mapping, 1) == [[]]
    assert len(asked) == 2000  # Flower's asks every node, whose ask reads every stored message


def test_install_makes_it_the_engines_sweep_unless_told_flowers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vce_api, "add_messages_to_queue", sweep.FLOWER_SWEEP)  # restored after the test
    monkeypatch.delenv(sweep.ENV, raising=False)
    sweep.install()
    assert vce_api.add_messages_to_queue is sweep.sweep
    monkeypatch.setenv(sweep.ENV, "flower")
    sweep.install()
    assert vce_api.add_messages_to_queue is sweep.FLOWER_SWEEP


def test_another_link_state_is_swept_by_flowers_function(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(sweep, "FLOWER_SWEEP", lambda *args: calls.append(args))
    other = object()
    sweep.sweep(other, Queue(), {1: 0}, OneSweep())  # type: ignore[arg-type]
    assert len(calls) == 1 and calls[0][0] is other


@pytest.mark.slow
@pytest.mark.parametrize(("first", "engine"), [("flwr.simulation", "fedfusion.strategies.sweep"),
                                               ("flwr.app", "flwr.server.superlink.fleet.vce.vce_api")])
def test_the_client_app_installs_the_sweep_where_flowers_engine_is_loaded(first: str, engine: str) -> None:
    """``flwr run`` loads the ClientApp in the process that then starts the engine (flwr.simulation imported); a
    deployed SuperNode has no engine, and loading the app there leaves Flower's modules alone."""
    code = (f"import {first}, fedfusion.client_app\n"
            "from flwr.server.superlink.fleet.vce import vce_api\n"
            "print(vce_api.add_messages_to_queue.__module__)")
    env = {k: v for k, v in os.environ.items() if k != sweep.ENV}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [engine]
