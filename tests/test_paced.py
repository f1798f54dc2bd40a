"""Pacing a round onto the simulation engine's slots: :class:`PacedGrid` pushes a training batch in the caller's order
so that an engine that queues each push in node order (Flower's sweep) still starts them in that order."""

from __future__ import annotations

import threading
import time
from uuid import uuid4

import pytest
from fedfusion.strategies.paced import PacedGrid, paced
from fedfusion.strategies.quorum import QuorumGrid
from fedfusion.strategies.stop import RunInterrupted, StopGrid
from flwr.app import Message, MessageType, MetricRecord, RecordDict

from fedfusion.run.slots import EngineSlots
from tests.test_quorum import _messages
from tests.test_strategy import task_identity  # noqa: F401 (autouse fixture)


class SlotEngine:
    """Flower's simulation engine in miniature: each push is queued in node order (one sweep), ``slots`` workers
    take the queue's head, and a job of node ``n`` replies ``work[n]`` seconds after it started."""

    def __init__(self, work: dict[int, float], slots: int, refused: frozenset[int] = frozenset()) -> None:
        self.work, self.slots, self.refused = work, slots, refused
        self.queue: list[Message] = []
        self.running: dict[str, float] = {}  # message id -> when it is done
        self.done: dict[str, Message] = {}
        self.by_id: dict[str, Message] = {}
        self.pushes: list[list[int]] = []  # the nodes of each push call, in the order given
        self.started: list[int] = []

    def push_messages(self, messages):
        messages = [m for m in messages if m.metadata.dst_node_id not in self.refused]  # as Flower stores none
        self.pushes.append([m.metadata.dst_node_id for m in messages])
        for m in messages:
            m.metadata.__dict__["_message_id"] = str(uuid4())
            self.by_id[m.metadata.message_id] = m
        self.queue += sorted(messages, key=lambda m: m.metadata.dst_node_id)  # one sweep: node order
        self._start()
        return [m.metadata.message_id for m in messages]

    def _start(self) -> None:
        while self.queue and len(self.running) < self.slots:
            m = self.queue.pop(0)
            self.running[m.metadata.message_id] = time.monotonic() + self.work[m.metadata.dst_node_id]
            self.started.append(m.metadata.dst_node_id)

    def pull_messages(self, message_ids):
        for mid in list(self.running):
            if self.running[mid] <= time.monotonic():
                del self.running[mid]
                self.done[mid] = Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}),
                                         reply_to=self.by_id[mid])
        self._start()
        return [self.done.pop(mid) for mid in list(message_ids) if mid in self.done]

    def send_and_receive(self, messages, timeout=None):
        """Flower's own wait: everything pushed at once, then pulled until answered."""
        ids = set(self.push_messages(messages))
        replies = []
        while ids:
            got = self.pull_messages(ids)
            ids -= {m.metadata.reply_to_message_id for m in got}
            replies += got
        return replies


LONGEST_FIRST = [5, 1, 4, 2, 3, 6]  # node ids, not in node order
# seconds: the two longest outlast the sweep after which the third is pushed (1.5 x paced.ENGINE_SWEEP_S)
WORK = {5: 0.5, 1: 0.4, 4: 0.3, 2: 0.25, 3: 0.2, 6: 0.15}
INSTANT = dict.fromkeys(LONGEST_FIRST, 0.0)  # every client answers at the pull after it started


@pytest.fixture
def long_clients(monkeypatch):
    """WORK's clients count as long (their replies take longer than this after their push): paced to the end."""
    monkeypatch.setattr("fedfusion.strategies.paced.PACED_MIN_S", 0.1)


@pytest.mark.slow  # real seconds: the engine's jobs outlast a sweep
@pytest.mark.usefixtures("long_clients")
def test_a_paced_round_starts_in_the_callers_order_where_one_push_starts_in_node_order():
    engine = SlotEngine(WORK, slots=2)
    replies = PacedGrid(engine, lambda: 2).send_and_receive(_messages(LONGEST_FIRST), timeout=60)
    assert len(replies) == 6
    # the two longest start together (in node order, as one sweep queues them), the rest in the caller's order
    assert set(engine.started[:2]) == {5, 1} and engine.started[2:] == LONGEST_FIRST[2:]
    # the two slots at once, then one more (held in the engine's queue), then one per reply
    assert engine.pushes == [[5, 1], [4], [2], [3], [6]]
    unpaced = SlotEngine(WORK, slots=2)
    PacedGrid(unpaced, lambda: 0).send_and_receive(_messages(LONGEST_FIRST), timeout=60)
    assert unpaced.started == sorted(LONGEST_FIRST) and unpaced.pushes == [LONGEST_FIRST]


@pytest.mark.parametrize("slots", [0, 6, 10])
def test_a_batch_the_slots_hold_and_anything_but_training_go_to_the_wrapped_grid_whole(slots):
    engine = SlotEngine(INSTANT, slots=6)
    replies = PacedGrid(engine, lambda: slots).send_and_receive(_messages(LONGEST_FIRST), timeout=60)
    assert engine.pushes == [LONGEST_FIRST] and len(replies) == 6
    queries = SlotEngine(INSTANT, slots=6)
    PacedGrid(queries, lambda: 2).send_and_receive(_messages(LONGEST_FIRST, MessageType.QUERY), timeout=60)
    assert queries.pushes == [LONGEST_FIRST]


def test_once_a_client_answers_within_the_short_bound_the_rest_of_the_round_goes_at_once():
    engine = SlotEngine(INSTANT, slots=2)  # every client answers at the next pull
    replies, unanswered = paced(engine, _messages(LONGEST_FIRST), 60, slots=2)
    assert engine.pushes == [[5, 1], [4, 2, 3, 6]] and len(replies) == 6 and not unanswered


def test_one_message_more_than_the_slots_waits_a_sweep_so_the_longest_are_the_ones_that_start():
    engine = SlotEngine({1: 0.0, 2: 0.3, 3: 0.3}, slots=2)
    replies, _ = paced(engine, _messages([3, 2, 1]), 60, slots=2)
    assert engine.pushes == [[3, 2], [1]] and set(engine.started[:2]) == {2, 3} and len(replies) == 3


def test_a_message_the_grid_refuses_is_replaced_by_the_next():
    engine = SlotEngine(INSTANT, slots=2, refused=frozenset({1}))
    replies, _ = paced(engine, _messages(LONGEST_FIRST), 60, slots=2)
    assert engine.pushes[:2] == [[5], [4]] and len(replies) == 5  # 1 refused: 4 takes its slot at once


def test_at_the_deadline_whatever_is_left_is_pushed_and_counted_unanswered():
    engine = SlotEngine({1: 10**9, 2: 10**9, 3: 10**9, 4: 10**9}, slots=1)
    replies, unanswered = paced(engine, _messages([1, 2, 3, 4]), 0.2, slots=1)
    assert not replies and engine.pushes == [[1], [2], [3, 4]] and len(unanswered) == 4


def test_over_selection_sends_its_whole_batch_at_once_over_a_paced_grid():
    engine = SlotEngine(INSTANT, slots=2)
    grid = QuorumGrid(PacedGrid(engine, lambda: 2), quorum=2, pull_interval_s=0.0)
    replies = grid.send_and_receive(_messages(LONGEST_FIRST), timeout=60)
    assert engine.pushes == [LONGEST_FIRST] and len(replies) == 2  # paced, the shortest would never be sent


def test_a_stop_ends_a_paced_round_within_a_poll():
    stop = threading.Event()
    grid = PacedGrid(StopGrid(SlotEngine(dict.fromkeys(LONGEST_FIRST, 10**9), slots=2), stop), lambda: 2)
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    with pytest.raises(RunInterrupted):
        grid.send_and_receive(_messages(LONGEST_FIRST), timeout=600)
    assert time.monotonic() - started < 1.0


@pytest.mark.slow  # imports Ray (a second)
def test_engine_slots_are_none_without_ray_in_this_process_and_flowers_pool_size_with_it(monkeypatch):
    import sys
    from types import SimpleNamespace

    import flwr.simulation.ray_transport.ray_actor  # noqa: F401 (imported with the real Ray, before it is faked)

    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert EngineSlots(1.0)() == 0
    up = {"initialized": False}
    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(is_initialized=lambda: up["initialized"]))
    assert EngineSlots(1.0)() == 0
    asked = []

    def pool_size(resources):
        asked.append(resources)
        return 3

    monkeypatch.setattr("flwr.simulation.ray_transport.ray_actor.pool_size_from_resources", pool_size)
    up["initialized"] = True
    slots = EngineSlots(2.0)
    assert slots() == 3 and slots() == 3 and asked == [{"num_cpus": 2.0, "num_gpus": 0.0}]  # counted once
    monkeypatch.setenv("FEDFUSION_PACED", "0")
    assert slots() == 0
