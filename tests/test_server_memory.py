"""The server's memory in a round. Its messages serialise each shared tensor once
(fedfusion.strategies.records) and every client still receives, bit for bit, what converting its own payload apart
gave it: the frozen int8 target, quantised once a round, is one bytes object in every full-forward client's record;
clients of one window plan share its arrays. A reply's bytes are let go as its arrays become tensors."""

from __future__ import annotations

import weakref

import pytest
import torch
from fedfusion.strategies.fusion import FusionStrategy, RunState, StrategySettings
from fedfusion.strategies.records import RoundRecords
from flwr.app import Array, ArrayRecord, ConfigRecord
from transformers import LlamaForCausalLM

from fedfusion.devices.catalog import load_catalog
from fedfusion.fusion.submodel.method import SubModelMethod
from fedfusion.models.slicing import extract
from fedfusion.selection.participation import Participation
from fedfusion.selection.selectors import make_selector
from fedfusion.wire.keys import FROZEN
from fedfusion.wire.quantize import BLOCK, QMAX, encode, quantize
from tests.conftest import tiny_config
from tests.test_strategy import FakeGrid, _reply, task_identity  # noqa: F401 - the fixture runs here too

NODES = {11: "phone", 12: "phone", 13: "desktop", 14: "desktop", 15: "laptop"}


def full_forward_strategy(policy: str = "rolling") -> tuple[FusionStrategy, SubModelMethod, dict[str, torch.Tensor]]:
    """The finetune recipe's method on a tiny Llama: windows of heads and neurons on an int8 frozen target."""
    cfg = tiny_config(heads=4, kv_heads=2, hidden=32, inter=48)
    torch.manual_seed(0)
    state = LlamaForCausalLM(cfg).state_dict()
    method = SubModelMethod(cfg, {"phone": 0.25, "desktop": 0.5, "laptop": 1.0}, state, policy=policy,
                            axes=("heads", "neurons"), forward="full", frozen="int8", scale=False)
    settings = StrategySettings(clients_per_round=len(NODES), query_config={"population": "{}"},
                                train_config={"local-steps": 1, "lr": 0.1, "seed": 0}, wait_nodes_s=1.0)
    participation = Participation(make_selector("random", seed=0), load_catalog())
    return FusionStrategy(settings, RunState.begin(dict.fromkeys(NODES.values(), method), participation, settings)), \
        method, state


def own_payload(method: SubModelMethod, target: dict[str, torch.Tensor], plan) -> ArrayRecord:
    """A client's record made from its own payload alone, as the server made it before: its window extracted and
    encoded, the frozen target quantised, the whole converted by Flower."""
    window = method.wire.formats.send(method.wire.exact(extract(target, method.config, plan)))
    frozen = {FROZEN + k: v for k, v in encode(method.wire.exact(target), "int8").items()}
    return ArrayRecord({**window, **frozen})


@pytest.mark.parametrize("policy", ["rolling", "static"])
def test_every_client_receives_bit_for_bit_what_its_own_payload_gave_it(policy):
    strategy, method, state = full_forward_strategy(policy)
    grid = FakeGrid(NODES)
    target = dict(state)
    for rnd in (1, 2, 3):
        messages = list(strategy.configure_train(rnd, ArrayRecord(target), ConfigRecord({}), grid))
        assert len(messages) == len(NODES)
        sent = strategy.run.round.target
        for m in messages:
            payload = strategy.run.round.payloads[m.metadata.dst_node_id]
            got, want = m.content["arrays"], own_payload(method, sent, payload.context[0])
            assert list(got) == list(want)
            for key in want:
                assert (got[key].dtype, got[key].shape, got[key].data) == (want[key].dtype, want[key].shape,
                                                                           want[key].data), key
            assert strategy.run.round.rows[m.metadata.dst_node_id].bytes_down == want.count_bytes()
        # the target moves between rounds, as a fold moves it
        target = {k: v + 0.01 * rnd if v.is_floating_point() else v for k, v in target.items()}


def test_the_frozen_target_is_one_bytes_object_and_a_shared_window_one_too():
    strategy, _, state = full_forward_strategy("static")
    messages = list(strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), FakeGrid(NODES)))
    records = {m.metadata.dst_node_id: m.content["arrays"] for m in messages}
    for key in [k for k in records[11] if k.startswith(FROZEN)]:
        assert len({id(r[key].data) for r in records.values()}) == 1, key  # once for all five clients
    window = [k for k in records[11] if not k.startswith(FROZEN)]
    assert window and all(records[11][k].data is records[12][k].data for k in window)  # two phones, one static plan
    assert all(records[11][k].data is not records[13][k].data for k in window if k in records[13])
    assert all(not p.arrays for p in strategy.run.round.payloads.values())  # released once their records were built


def test_round_records_serialise_a_shared_tensor_once_and_let_it_go():
    shared, own = torch.arange(6.0).view(2, 3), torch.ones(4, dtype=torch.int8)
    states = {1: {"a": shared, "b": own}, 2: {"a": shared}, 3: {"c": torch.zeros(2)}}
    records = RoundRecords(states)
    first = records.record(1, extra={"x": torch.tensor([7])})
    assert isinstance(records.states[2]["a"], Array)  # the state still waiting holds the bytes, not the tensor
    second = records.record(2)
    assert first["a"].data is second["a"].data and first["a"] is not second["a"]  # one Array object per record
    plain = ArrayRecord({**states[1], "x": torch.tensor([7])})
    assert list(first) == list(plain) and all(first[k].data == plain[k].data for k in plain)
    assert records.record(3)["c"].data == ArrayRecord(states[3])["c"].data
    assert not records.states and not records.holders and states[2]["a"] is shared  # the caller's dicts unchanged


def test_a_shared_tensor_is_freed_once_serialised_not_at_its_last_record():
    frozen = torch.randn(64)
    gone = weakref.ref(frozen)
    records = RoundRecords({1: {"f": frozen}, 2: {"f": frozen}, 3: {"f": frozen}})
    del frozen
    records.record(1)
    assert gone() is None  # clients 2 and 3 wait for their records holding its bytes only
    assert records.record(3)["f"].data is records.record(2)["f"].data


def test_a_records_tensors_are_freed_one_by_one_as_its_bytes_are_made():
    seen: list[list[bool]] = []

    class Watching(RoundRecords):
        def _serialise(self, tensor: torch.Tensor) -> Array:
            seen.append([ref() is not None for ref in refs])
            return super()._serialise(tensor)

    first, second = torch.randn(64), torch.randn(64)
    refs = [weakref.ref(first), weakref.ref(second)]
    records = Watching({1: {"a": first, "b": second}})
    del first, second
    records.record(1)
    assert seen == [[True, True], [False, True]]  # the first tensor was gone before the second was serialised


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("size", [BLOCK * 5, BLOCK * 5 + 17])
def test_quantize_is_the_plain_formula_bit_for_bit(bits, size):
    """The in-place temporaries give the codes and scales of the plain formula (padded copy, fresh tensors)."""
    torch.manual_seed(size + bits)
    t = torch.randn(size) * 3
    t[:BLOCK] = 0.0  # an all-zero block: its scale is 0 and its codes 0
    before = t.clone()
    flat = t.flatten()
    blocks = torch.cat([flat, flat.new_zeros(-flat.numel() % BLOCK)]).view(-1, BLOCK)
    scale = (blocks.abs().amax(1) / QMAX[bits]).to(torch.float16)
    step = scale.float().clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)
    codes = torch.round(blocks / step).clamp(-QMAX[bits], QMAX[bits]).to(torch.int8).flatten()
    if bits == 4:
        nibbles = (codes + 8).to(torch.uint8).view(-1, 2)
        codes = nibbles[:, 0] | (nibbles[:, 1] << 4)
    got_codes, got_scale = quantize(t, bits)
    assert torch.equal(got_codes, codes) and torch.equal(got_scale.view(torch.int16), scale.view(torch.int16))
    assert torch.equal(t, before)  # the input is untouched (its blocks are a view of it where no padding is needed)


def test_a_reply_is_let_go_as_it_becomes_tensors_and_folds_as_before():
    strategy, _, state = full_forward_strategy()
    messages = list(strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), FakeGrid(NODES)))
    trained = {m.metadata.dst_node_id: {k: v + 1e-3 for k, v in m.content["arrays"].to_torch_state_dict().items()
                                        if not k.startswith(FROZEN)} for m in messages}
    replies = [_reply(m, trained[m.metadata.dst_node_id]) for m in messages]
    sizes = [r.content["arrays"].count_bytes() for r in replies]
    folded, metrics = strategy.aggregate_train(1, replies)
    assert folded is not None and metrics is not None and metrics["clients_ok"] == len(NODES)
    assert all(len(r.content["arrays"]) == 0 for r in replies)  # no reply's bytes held beside its tensors
    assert [strategy.run.round.rows[m.metadata.dst_node_id].bytes_up for m in messages] == sizes
    # every coordinate a window trained moved by the 1e-3 every client added (their average)
    moved = {k: folded[k].numpy() - v.numpy() for k, v in strategy.run.round.target.items()}
    assert all(abs(d).max() <= 1.001e-3 for d in moved.values()) and any(abs(d).max() > 0.999e-3 for d in moved.values())
