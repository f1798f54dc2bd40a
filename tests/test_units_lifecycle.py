"""The units mode through the one run lifecycle, without Flower's runtime: ``run_federation`` over an in-memory Grid
whose nodes run the real ClientApp handlers (the capability query and ``train.units``). A Ctrl-C stops it with
``status: interrupted`` after the last step recorded, a resume continues from the checkpoint to the uninterrupted
run's curve, a finished run has its report, and a dead client runtime fails the run, as for the federated methods
(tests/test_simulation.py). Its step is train/loop.py's one optimizer step."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
import torch
from fedfusion.clients.units import answer as units_handler
from fedfusion.strategies.stop import StopRequest
from flwr.app import Context, Message, MessageType, RecordDict

from fedfusion.analysis.report import read_jsonl
from fedfusion.client_app import query as query_handler
from fedfusion.run.check import load_checked
from fedfusion.run.federation import run_federation
from fedfusion.run.run_dir import RunDir
from tests.test_units_flower import TINY


@pytest.fixture(autouse=True, scope="module")
def _task_identity() -> None:
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # as tests/test_strategy.py does


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny GEMMs on one thread, restored after

CLIENTS = 4
UNITS = [*TINY, f"population.num_clients={CLIENTS}", "output.checkpoint_every=1", "units.deadline_floor_s=30"]


class NodesGrid:
    """A federation of ``nodes`` SuperNodes in this process: each pushed message is answered at once by the
    ClientApp handler of its type (node ``i`` holds partition ``i``, its state kept between messages)."""

    def __init__(self, nodes: int) -> None:
        self.contexts = {100 + p: Context(run_id=1, node_id=100 + p, state=RecordDict(), run_config={},
                                          node_config={"partition-id": p, "num-partitions": nodes})
                         for p in range(nodes)}
        self.replies: dict[str, Message] = {}

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid4())
            handler = query_handler if msg.metadata.message_type == MessageType.QUERY else units_handler
            self.replies[msg.metadata.message_id] = handler(msg, self.contexts[msg.metadata.dst_node_id])
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self.replies.pop(m) for m in list(message_ids) if m in self.replies]


def units_run(path: Path, overrides: tuple[str, ...] = (), stop: StopRequest | None = None,
              stop_after: int | None = None, resume: bool = False) -> dict[str, Any]:
    """One units run in ``path`` (or the resumed one there); ``stop`` is set once step ``stop_after`` is recorded."""
    run = RunDir.reopen(path) if resume else RunDir(path, load_checked("rolling", [*UNITS, *overrides]))

    def on_round(row: dict[str, Any]) -> None:
        if stop is not None and row["round"] == stop_after:
            stop.set()

    return run_federation(NodesGrid(CLIENTS), run.recipe, run, on_round=on_round, resume=resume, stop=stop)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted units run of three steps."""
    path = tmp_path_factory.mktemp("units") / "whole"
    assert units_run(path)["status"] == "ok"
    return path


def test_an_uninterrupted_units_run_writes_its_summary_and_report(whole):
    summary = json.loads((whole / "summary.json").read_text())
    rows = read_jsonl(whole / "metrics.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2, 3] and summary["mode"] == "units"
    assert summary["train_loss"] == [r["train_loss"] for r in rows[1:]]
    assert summary["final"]["eval_loss"] == rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    assert summary["bytes_down"] == sum(r["bytes_down"] for r in rows) > 0
    assert (whole / "report.md").is_file() and json.loads((whole / "checkpoint" / "state.json").read_text())["round"] == 3


def test_ctrl_c_stops_a_units_run_after_its_step_and_resume_ends_as_the_uninterrupted_run(whole, tmp_path):
    path, stop = tmp_path / "stopped", StopRequest()
    summary = units_run(path, stop=stop, stop_after=1)
    assert summary["status"] == "interrupted" and summary["last_round"] == summary["resume_after"] == 1, summary
    assert summary["rounds"] == 3 and json.loads((path / "summary.json").read_text())["status"] == "interrupted"
    assert [r["round"] for r in read_jsonl(path / "metrics.jsonl")] == [0, 1] and not (path / "report.md").exists()
    resumed = units_run(path, resume=True)
    assert resumed["status"] == "ok" and resumed["wall_s"] >= summary["wall_s"]
    first, again = read_jsonl(whole / "metrics.jsonl"), read_jsonl(path / "metrics.jsonl")
    assert [r["round"] for r in again] == [0, 1, 2, 3]
    for key in ("train_loss", "eval_loss", "eval_ppl", "eval_acc"):  # one process, one micro-batch: to the bit
        assert [r.get(key) for r in again] == [r.get(key) for r in first], key
    assert resumed["final"] == json.loads((whole / "summary.json").read_text())["final"]
    assert (path / "report.md").is_file()


def test_a_units_run_stopped_before_its_first_checkpoint_says_there_is_nothing_to_resume(tmp_path):
    summary = units_run(tmp_path / "early", stop=StopRequest(), stop_after=0)
    assert summary["status"] == "interrupted" and summary["last_round"] == 0 and summary["resume_after"] is None


def test_a_dead_client_runtime_fails_a_units_run_with_its_reason(tmp_path):
    stop = StopRequest()
    stop.fail("the simulation engine died")
    with pytest.raises(RuntimeError, match="engine died"):
        units_run(tmp_path / "dead", stop=stop)
    summary = json.loads((tmp_path / "dead" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == "the simulation engine died"


def test_a_units_step_is_the_one_optimizer_step_and_refuses_a_non_finite_loss(monkeypatch):
    """``run.units.train_step`` updates through ``train.loop``'s one update (where clipping or a schedule would go,
    once) and, like every loop, stops on a non-finite loss before the weights move (``finite_loss``)."""
    from fedfusion.run.units import train_step
    from fedfusion.train import loop
    from tests.test_units_exact import CONFIG, model

    updates: list[torch.optim.Optimizer] = []
    update = loop._update
    monkeypatch.setattr(loop, "_update", lambda opt: (updates.append(opt), update(opt)))
    ids = torch.randint(0, CONFIG["vocab_size"], (4, 13), generator=torch.Generator().manual_seed(1))
    m = model(torch.float32)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    start = {k: v.detach().clone() for k, v in m.named_parameters()}
    assert train_step(m, opt, ids, 2) > 0 and updates == [opt]
    assert any(not torch.equal(p, start[k]) for k, p in m.named_parameters())
    with torch.no_grad():
        m.model.embed_tokens.weight[ids[0, 0]] = float("nan")
    held = {k: v.detach().clone() for k, v in m.named_parameters()}
    with pytest.raises(FloatingPointError, match="units training loss became nan"):
        train_step(m, opt, ids, 2)
    assert updates == [opt] and all(torch.allclose(p, held[k], rtol=0, atol=0, equal_nan=True)
                                    for k, p in m.named_parameters())
