"""train.eval_every: central evaluation scores round 0, the last round and every n-th round between; the rounds
between still train and report, their metrics rows have no scores, and best/final read over the scored rounds."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from fedfusion.strategies.fusion import scored_round
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from fedfusion.analysis import report
from fedfusion.analysis.report import compare_runs, plot_curves, write_report
from fedfusion.run.federation import facts_summary, log_round
from fedfusion.run.lifecycle import scored_rows
from fedfusion.wire.specs import Caps
from tests.test_report import fake_run
from tests.test_strategy import make_strategy


@pytest.fixture(autouse=True)
def task_identity():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


class EchoGrid:
    """Nodes that answer the capability query and reply to training with the weights they were sent."""

    devices = {11: "phone", 12: "desktop", 13: "phone"}

    def get_node_ids(self) -> list[int]:
        return list(self.devices)

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for m in messages:
            node = m.metadata.dst_node_id
            if m.metadata.message_type == MessageType.QUERY:
                content = RecordDict({"caps": ConfigRecord(Caps(self.devices[node], node - 11, 1).to_config())})
            else:
                content = RecordDict({"arrays": m.content["arrays"], "metrics": MetricRecord(
                    {"num-examples": 1, "train_loss": 1.0, "train_s": 0.1})})
            replies.append(Message(content, reply_to=m))
        return replies


class NoWeightsGrid(EchoGrid):
    """Nodes whose training replies carry no weights: every update is rejected, every round void."""

    def send_and_receive(self, messages, timeout=None):
        replies = super().send_and_receive(messages, timeout)
        for reply in replies:
            if "arrays" in reply.content:
                del reply.content["arrays"]
        return replies


def test_scored_rounds_are_round_0_the_last_and_every_nth():
    assert [r for r in range(13) if scored_round(r, 12, 1)] == list(range(13))
    assert [r for r in range(13) if scored_round(r, 12, 4)] == [0, 4, 8, 12]
    assert [r for r in range(11) if scored_round(r, 10, 4)] == [0, 4, 8, 10]  # the last even where 4 does not divide it
    assert [r for r in range(11) if scored_round(r, 10, 0)] == [0, 10]  # units.eval_every's 0: first and last only


@pytest.mark.parametrize("offset,expected", [(0, [0, 3, 6, 7]), (2, [1, 4, 5])])
def test_the_strategy_evaluates_only_the_scored_rounds_and_reports_every_round(offset, expected):
    """Run of 7 rounds with eval_every=3: evaluate_fn sees rounds 0, 3, 6 and 7; every round still goes to the
    listeners, an unscored one with no metrics. Resumed after round 2 (Flower counts from 1 again), the same
    absolute rounds 3, 6, 7 are scored, which Flower calls 1, 4, 5."""
    strategy, state = make_strategy()
    strategy.settings = replace(strategy.settings, eval_every=3)
    if offset:
        strategy.run.rounds_done = offset
    called, reports = [], []
    strategy.listeners.append(reports.append)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        called.append(server_round)
        return MetricRecord({"eval_loss": 1.0})

    strategy.start(grid=EchoGrid(), initial_arrays=ArrayRecord(state), num_rounds=7 - offset, evaluate_fn=evaluate)
    assert called == expected
    absolute = [r + offset for r in expected if r or not offset]
    assert [r.round for r in reports] == list(range(offset + 1 if offset else 0, 8))
    assert [r.round for r in reports if r.metrics] == absolute
    assert all(r.clients for r in reports if r.round)  # unscored rounds trained all the same


@pytest.mark.parametrize("void", [False, True])
def test_flowers_initial_record_is_let_go_once_a_round_has_replaced_it(void):
    """Flower's loop keeps ``initial_arrays`` referenced for the whole run: once a round's target has replaced it
    (and every listener has seen that round) the strategy empties it; while every round is void the target is still
    that record, and it is kept."""
    strategy, state = make_strategy()
    initial = ArrayRecord(state)
    seen = []
    strategy.listeners.append(lambda r: seen.append((r.round, len(initial), r.arrays is initial)))
    strategy.start(grid=NoWeightsGrid() if void else EchoGrid(), initial_arrays=initial, num_rounds=2)
    assert seen[:2] == [(0, len(state), True), (1, len(state), void)]  # every listener saw it whole
    assert len(initial) == (len(state) if void else 0) and len(state) > 0


def unscored_run(path, facts: bool = False):
    """A fake run of 4 rounds scored at 0, 2 and 4 (eval_every=2) whose best loss would have been round 3's."""
    run = fake_run(path, [4.0, 3.0, 2.5, 1.0, 2.8], [0.1, 0.2, 0.3, 0.9, 0.25], facts=facts)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        if row["round"] in (1, 3):
            for key in ("eval_loss", "eval_ppl", "eval_acc", "probe_acc"):
                row.pop(key, None)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run, rows


def test_the_report_reads_best_and_final_over_the_scored_rounds(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "plot_curves", lambda runs, out_dir: [])
    run, rows = unscored_run(tmp_path / "run")
    text = write_report(run).read_text()
    assert f"final **{math.exp(2.8):.2f}** (round 4), best **{math.exp(2.5):.2f}** (round 2)" in text
    assert "Central evaluation scored rounds 0, 2, 4 of 4 (`train.eval_every`)" in text
    assert "| 3 |  |  |  |" in text  # the unscored round's row: no scores
    table = compare_runs([run], tmp_path / "cmp").read_text()
    assert "| 2.8000 | " in table and f"| 2.5000 (2) | {math.exp(2.5):.3f} (2) | 0.3000 (2) |" in table
    assert [r["round"] for r in scored_rows(rows)] == [0, 2, 4]
    ledger = {"clients_ok": 6, "clients_failed": 0, "wall_s": 1.0}
    log_round({**rows[3], **ledger})  # the progress line of an unscored round
    log_round({**rows[4], **ledger})


def test_plots_draw_only_the_scored_rounds(tmp_path):
    run, _ = unscored_run(tmp_path / "run")
    paths = plot_curves([run], tmp_path / "plots")
    assert {p.name for p in paths} >= {"eval_loss.png", "loss_vs_cost.png"}


def test_the_facts_summary_reads_the_scored_rounds(monkeypatch):
    from types import SimpleNamespace

    from fedfusion.run import federation

    probes = [SimpleNamespace(client="a"), SimpleNamespace(client="b")]
    monkeypatch.setattr(federation, "facts_by_tier",
                        lambda *a: (SimpleNamespace(probes=probes), {"phone": [0], "laptop": [1]}))
    recipe = SimpleNamespace(data=None, population=SimpleNamespace(num_clients=2), seed=0)
    rows = [{"round": 0, "probe_acc": 0.1}, {"round": 1}, {"round": 2, "probe_acc": 0.4}, {"round": 3},
            {"round": 4, "probe_acc": 0.3}]
    summary = facts_summary(recipe, rows)
    assert summary["probe_acc"] == 0.3 and summary["best_probe_acc"] == 0.4
    assert summary["probes_by_tier"] == {"phone": 1, "laptop": 1}
