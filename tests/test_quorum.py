"""Over-selection: QuorumGrid closes a training round at a quorum of good replies; the strategy samples
the extra clients and records the ones it did not wait for as ``cut``."""

from __future__ import annotations

from dataclasses import replace
from uuid import uuid4

import pytest
from fedfusion.strategies.quorum import QuorumGrid
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict

from fedfusion.config.recipe import load_recipe
from fedfusion.config.sections import RecipeError
from tests.test_strategy import FakeGrid, _reply, make_strategy, task_identity  # noqa: F401 (autouse fixture)


class TimedGrid:
    """A grid whose node ``n`` replies after ``delays[n]`` pulls; nodes in ``errors`` reply with an error."""

    def __init__(self, delays: dict[int, int], errors: frozenset[int] = frozenset()) -> None:
        self.delays, self.errors, self.pulls, self.pushed, self.batches = delays, errors, 0, {}, []

    def push_messages(self, messages):
        ids = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = str(uuid4())  # as Flower's grids do on push
            self.pushed[m.metadata.message_id] = m
            ids.append(m.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        self.pulls += 1
        out = []
        for mid in message_ids:
            m = self.pushed[mid]
            node = m.metadata.dst_node_id
            if self.delays[node] <= self.pulls:
                content = Error(code=1, reason="crash") if node in self.errors else RecordDict(
                    {"metrics": MetricRecord({"num-examples": 1})})
                out.append(Message(content, reply_to=m))
        return out

    def send_and_receive(self, messages, timeout=None):
        self.batches.append([m.metadata.message_type for m in messages])
        return []


def _messages(nodes, kind=MessageType.TRAIN):
    return [Message(RecordDict({"config": ConfigRecord({"n": n})}), dst_node_id=n, message_type=kind) for n in nodes]


def test_a_training_round_returns_at_the_quorum_of_good_replies():
    inner = TimedGrid({1: 1, 2: 2, 3: 3, 4: 50, 5: 50}, errors=frozenset({2}))
    grid = QuorumGrid(inner, quorum=2, pull_interval_s=0.0)
    replies = grid.send_and_receive(_messages([1, 2, 3, 4, 5]), timeout=60)
    # node 2's error reply does not count towards the quorum: the round waits for node 3, not for 4 and 5
    assert inner.pulls == 3 and len(replies) == 3
    assert sum(not r.has_error() for r in replies) == 2


def test_replies_not_waited_for_are_pulled_and_dropped_by_the_next_call():
    inner = TimedGrid({1: 1, 2: 1, 3: 2, 4: 2})
    grid = QuorumGrid(inner, quorum=2, pull_interval_s=0.0)
    assert len(grid.send_and_receive(_messages([1, 2, 3, 4]), timeout=60)) == 2 and len(grid.leftover) == 2
    grid.send_and_receive(_messages([1], MessageType.EVALUATE), timeout=5)  # one pull, no waiting
    assert inner.pulls == 2 and not grid.leftover


def test_the_deadline_still_closes_a_round_short_of_its_quorum():
    inner = TimedGrid({1: 1, 2: 10**9})
    grid = QuorumGrid(inner, quorum=2, pull_interval_s=0.01)
    replies = grid.send_and_receive(_messages([1, 2]), timeout=0.2)
    assert len(replies) == 1 and not replies[0].has_error()


def test_other_messages_wait_for_everyone_through_the_wrapped_grid():
    inner = TimedGrid({1: 1, 2: 1})
    grid = QuorumGrid(inner, quorum=1)
    grid.send_and_receive(_messages([1, 2], MessageType.EVALUATE), timeout=5)
    assert inner.batches == [[MessageType.EVALUATE] * 2] and inner.pulls == 0
    with pytest.raises(ValueError, match="quorum"):
        QuorumGrid(inner, quorum=0)


def test_over_selection_samples_extra_clients_and_records_the_ones_not_waited_for_as_cut():
    strategy, state = make_strategy()
    strategy.settings = replace(strategy.settings, clients_per_round=2, overselect=0.5)  # ceil(2 x 1.5) = 3 sampled
    grid = FakeGrid({11: "phone", 12: "desktop", 13: "phone", 14: "desktop"})
    msgs = list(strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), grid))
    assert len(msgs) == 3
    ok = [_reply(m, m.content["arrays"].to_torch_state_dict()) for m in msgs[:2]]
    strategy.aggregate_train(1, ok)
    statuses = sorted(c.status for c in strategy.run.round.rows.values())
    assert statuses == ["cut", "ok", "ok"]
    cut = next(c for c in strategy.run.round.rows.values() if c.status == "cut")
    assert "closed once 2 updates" in cut.error
    # short of the quorum, a silent client timed out as without over-selection
    msgs = list(strategy.configure_train(2, ArrayRecord(state), ConfigRecord({}), grid))
    strategy.aggregate_train(2, [_reply(msgs[0], msgs[0].content["arrays"].to_torch_state_dict())])
    assert sorted(c.status for c in strategy.run.round.rows.values()) == ["ok", "timeout", "timeout"]


def test_overselect_is_checked():
    assert load_recipe("quickstart", ["selection.overselect=0.5"]).selection.overselect == 0.5
    with pytest.raises(RecipeError, match="selection.overselect"):
        load_recipe("quickstart", ["selection.overselect=-0.1"])
