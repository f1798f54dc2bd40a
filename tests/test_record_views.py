"""record_tensors (fedfusion.strategies.records): a Flower record's tensors read over its own bytes (no copy), and a
server that only reads them: a round built from the round's record and folded from replies leaves its bytes as they
were."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from fedfusion.strategies.records import array_tensor, record_tensors
from flwr.app import Array, ArrayRecord, ConfigRecord
from transformers import LlamaForCausalLM

from fedfusion.fusion.outer import OuterConfig
from fedfusion.fusion.submodel.method import SubModelMethod
from fedfusion.wire.keys import FROZEN
from tests.conftest import tiny_config
from tests.test_eval_every import EchoGrid
from tests.test_strategy import make_strategy, new_strategy


@pytest.fixture(autouse=True)
def task_identity():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


def buffer_address(data: bytes) -> int:
    return np.frombuffer(data, dtype=np.uint8).ctypes.data


@pytest.mark.parametrize("value", [
    torch.randn(7, 5), torch.randn(3, 4, 2).to(torch.float16), torch.arange(-6, 6, dtype=torch.int8).reshape(3, 4),
    torch.tensor(2.5, dtype=torch.float64), torch.zeros(0, 3), torch.tensor([True, False])])
def test_a_tensor_is_read_over_the_records_bytes_equal_to_flowers_copy(value):
    record = ArrayRecord({"w": value})
    view = record_tensors(record)["w"]
    copy = record.to_torch_state_dict()["w"]
    assert view.dtype == copy.dtype and view.shape == copy.shape and torch.equal(view, copy)
    data = record["w"].data
    if value.numel():  # no copy: the tensor's first value is the first byte after the .npy header
        assert view.data_ptr() == buffer_address(data) + len(data) - value.numel() * value.element_size()


def test_bytes_that_cannot_be_read_in_place_are_copied():
    fortran = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    array = Array(fortran)
    out = array_tensor(array)
    assert torch.equal(out, torch.from_numpy(np.ascontiguousarray(fortran)))
    lo, hi = buffer_address(array.data), buffer_address(array.data) + len(array.data)
    assert not lo <= out.data_ptr() < hi


class PerturbGrid(EchoGrid):
    """Nodes whose training replies carry every trained float32 array they were sent, moved by +0.25: replies the
    fold must turn into a new target."""

    def send_and_receive(self, messages, timeout=None):
        replies = super().send_and_receive(messages, timeout)
        for reply in replies:
            if "arrays" in reply.content:
                sent = reply.content["arrays"].to_torch_state_dict()
                reply.content["arrays"] = ArrayRecord({k: v + 0.25 if v.dtype == torch.float32 else v
                                                       for k, v in sent.items() if not k.startswith(FROZEN)})
        return replies  # a window's frozen target is read, not trained: not sent back


def window_strategy(outer: OuterConfig | None = None):
    """Full-forward windows with the core on an int8 frozen target (the quickstart's kind), or rolling slices
    stepped by a server optimizer."""
    cfg = tiny_config(heads=4, kv_heads=4, hidden=32, inter=48)
    torch.manual_seed(0)
    state = LlamaForCausalLM(cfg).state_dict()
    if outer is not None:
        method = SubModelMethod(cfg, {"phone": 0.25, "desktop": 0.5}, state, outer=outer)
    else:
        method = SubModelMethod(cfg, {"phone": 0.25, "desktop": 0.5}, state, forward="full", window_core=True,
                                outside_core=True, window_shared=True, window_widths={"phone": 0.25, "desktop": 0.25})
    strategy = new_strategy({"phone": method, "desktop": method}, clients_per_round=3,
                            query_config={"population": "{}"}, participation=make_strategy()[0].run.participation,
                            train_config={"local-steps": 1, "lr": 0.1, "seed": 0}, wait_nodes_s=1.0)
    return strategy, state


@pytest.mark.parametrize("kind", ["rolling slices", "windows with the core", "slices stepped by avgm"])
def test_a_round_reads_the_global_record_and_never_writes_into_it(kind):
    if kind == "rolling slices":
        strategy, state = make_strategy()
    else:
        strategy, state = window_strategy(OuterConfig(method="avgm", lr=1.0, momentum=0.9) if "avgm" in kind else None)
    record = ArrayRecord(state)
    before = {k: hashlib.sha256(a.data).hexdigest() for k, a in record.items()}
    grid = PerturbGrid()
    messages = list(strategy.configure_train(1, record, ConfigRecord({}), grid))
    new, _ = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert new is not None and any(not torch.equal(v, state[k]) for k, v in new.to_torch_state_dict().items())
    list(strategy.configure_evaluate(1, record, ConfigRecord({}), grid))
    assert {k: hashlib.sha256(a.data).hexdigest() for k, a in record.items()} == before
