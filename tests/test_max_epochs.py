"""A cap on a client's passes over its own examples per round (``train.max_epochs``): the steps it allows, the
strategy's messages carrying each capped client its own local steps, and the ledger pricing the steps taken."""

from __future__ import annotations

from dataclasses import replace

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedfusion.devices.catalog import load_catalog
from fedfusion.fusion.rounds import client_steps
from fedfusion.run.check import load_checked
from fedfusion.run.federation import price_client
from fedfusion.wire.specs import Caps
from tests.test_strategy import FakeGrid, make_strategy, task_identity  # noqa: F401 (autouse fixture)

EXAMPLES = {11: 30, 12: 400, 13: 7}  # node -> the training examples its capability reply counts


class SizedGrid(FakeGrid):
    """Nodes that count ``EXAMPLES`` training examples each."""

    def send_and_receive(self, messages, timeout=None):
        return [Message(RecordDict({"caps": ConfigRecord(Caps(self.devices[m.metadata.dst_node_id], m.metadata.dst_node_id,
                                                              EXAMPLES[m.metadata.dst_node_id]).to_config())}), reply_to=m)
                for m in messages]


def capped_strategy(max_epochs: float, local_steps: int = 40):
    strategy, state = make_strategy()
    train_config = {**strategy.settings.train_config, "local-steps": local_steps, "batch-size": 16, "seq-len": 64}
    strategy.settings = replace(strategy.settings, train_config=train_config, max_epochs=max_epochs)
    return strategy, state


def test_a_client_takes_at_most_max_epochs_passes_over_its_examples():
    assert client_steps(40, 16, 0.0, 30) == 40  # off
    assert client_steps(40, 16, 5.0, 30) == 10  # ceil(5 x 30 / 16): 150 windows, not 640
    assert client_steps(40, 16, 5.0, 400) == 40  # 40 steps are 1.6 passes over 400 examples: no cap
    assert client_steps(40, 16, 1.0, 128) == 8
    assert client_steps(40, 16, 0.5, 1) == 1  # at least one step
    with pytest.raises(ValueError, match="max_epochs >= 0 .* got -1"):
        client_steps(40, 16, -1.0, 30)


def test_the_quickstart_caps_local_epochs_and_the_key_is_a_number():
    assert load_checked("quickstart").train.max_epochs == 5
    assert load_checked("quickstart", ["train.max_epochs=0"]).train.max_epochs == 0


def test_each_message_carries_its_clients_capped_steps_and_its_row_prices_them():
    strategy, state = capped_strategy(max_epochs=5.0)
    msgs = {m.metadata.dst_node_id: m for m in
            strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), SizedGrid({11: "phone", 12: "desktop",
                                                                                          13: "phone"}))}
    steps = {n: m.content["config"]["local-steps"] for n, m in msgs.items()}
    assert steps == {11: 10, 12: 40, 13: 3}  # ceil(5 x 30 / 16), uncapped, ceil(5 x 7 / 16)
    assert {n: row.tokens for n, row in strategy.run.round.rows.items()} == {n: s * 16 * 64 for n, s in steps.items()}
    # the reply's own count of what it trained is what the ledger keeps and prices
    replies = [Message(RecordDict({"arrays": m.content["arrays"], "metrics": MetricRecord(
        {"num-examples": EXAMPLES[n], "train_loss": 1.0, "train_s": 0.1, "train_tokens": steps[n] * 16 * 64})}),
        reply_to=m) for n, m in msgs.items()]
    strategy.aggregate_train(1, replies)
    rows = strategy.run.round.rows
    assert {n: (row.status, row.tokens) for n, row in rows.items()} == {n: ("ok", s * 16 * 64) for n, s in steps.items()}
    catalog = load_catalog()
    compute_s = {n: price_client(rows[n], catalog)["compute_s"] for n in (11, 13)}
    assert compute_s[11] == pytest.approx(compute_s[13] * 10 / 3)  # the same slice's work, priced per step taken


def test_a_cap_that_binds_no_client_sends_the_same_messages_as_none():
    def round_one(strategy, state):
        msgs = strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), SizedGrid({11: "phone", 12: "desktop",
                                                                                            13: "phone"}))
        return ([(m.metadata.dst_node_id, dict(m.content["config"]), m.content["arrays"].to_torch_state_dict().keys())
                 for m in msgs], [row.to_dict() for row in strategy.run.round.rows.values()])

    plain, capped = capped_strategy(0.0, local_steps=2), capped_strategy(100.0, local_steps=2)  # no client reaches it
    assert round_one(*plain) == round_one(*capped)
