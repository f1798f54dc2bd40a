"""FusionStrategy driving width slicing (SubModelMethod) on hand-built Flower Messages: per-node messages, specs,
and rejection of bad replies."""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest
import torch
from fedfusion.strategies.fusion import FusionStrategy, RunState, StrategySettings
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from fp_bounds import assert_within, gamma
from transformers import LlamaForCausalLM

from fedfusion.devices.catalog import load_catalog
from fedfusion.fusion.submodel.method import SubModelMethod
from fedfusion.models.slicing import extract
from fedfusion.selection.participation import Participation
from fedfusion.selection.selectors import make_selector
from fedfusion.train.loop import TrainResult
from fedfusion.wire.quantize import Wire
from fedfusion.wire.specs import Caps
from tests.conftest import tiny_config


@pytest.fixture(autouse=True)
def task_identity():
    """Messages built outside a Flower runtime need a run/task identity (Flower sets it in a real run)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


class FakeGrid:
    """Three nodes that answer the capability query with the given devices."""

    def __init__(self, devices: dict[int, str]) -> None:
        self.devices = devices

    def get_node_ids(self) -> list[int]:
        return list(self.devices)

    def send_and_receive(self, messages, timeout=None):
        return [Message(RecordDict({"caps": ConfigRecord(Caps(self.devices[m.metadata.dst_node_id],
                                                              m.metadata.dst_node_id, 1).to_config())}), reply_to=m)
                for m in messages]

NO_TRAINING = partial(TrainResult, losses=(0.0,), tokens=0.0, seconds=0.0)  # a reply of untouched weights


def test_a_capability_reply_missing_a_key_is_refused_naming_it(caplog):
    class Partial(FakeGrid):  # node 12 leaves out its example count
        def send_and_receive(self, messages, timeout=None):
            replies = super().send_and_receive(messages, timeout)
            for reply in replies:
                if reply.metadata.src_node_id == 12:
                    del reply.content["caps"]["examples"]
            return replies

    strategy, state = make_strategy()
    grid = Partial({11: "phone", 12: "desktop", 13: "phone"})
    msgs = list(strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), grid))
    assert sorted(m.metadata.dst_node_id for m in msgs) == [11, 13] and 12 not in strategy.run.caps
    assert "node 12: capability reply refused: message spec lacks 'examples'" in caplog.text


def new_strategy(methods: dict, participation: Participation, listeners=(), secure=None, **settings) -> FusionStrategy:
    """A FusionStrategy with these settings (:class:`StrategySettings`) over ``methods``, on a new run's state."""
    given = StrategySettings(**settings)
    return FusionStrategy(given, RunState.begin(methods, participation, given), listeners, secure)


def make_strategy(min_clients: int = 1, aggregate: str = "mean", wire_dtype: str = "float32") -> tuple[FusionStrategy, dict]:
    cfg = tiny_config(heads=4, kv_heads=4, hidden=32, inter=48)
    torch.manual_seed(0)
    state = LlamaForCausalLM(cfg).state_dict()
    method = SubModelMethod(cfg, {"phone": 0.25, "desktop": 0.5}, state, policy="rolling", stride=0.25, stagger=True,
                            aggregate=aggregate, wire=Wire(wire_dtype))
    strategy = new_strategy(
        {"phone": method, "desktop": method}, clients_per_round=3, min_clients=min_clients,
        query_config={"population": "{}"}, participation=Participation(make_selector("random", seed=0), load_catalog()),
        train_config={"local-steps": 1, "lr": 0.1, "seed": 0}, wait_nodes_s=1.0,
    )
    return strategy, state


def plans(strategy: FusionStrategy) -> dict:
    """Each sampled node's slice plan this round."""
    return {node: payload.context[0] for node, payload in strategy.run.round.payloads.items()}


def test_each_node_gets_its_own_message_with_its_slice_and_spec():
    strategy, state = make_strategy()
    grid = FakeGrid({11: "phone", 12: "desktop", 13: "phone"})
    msgs = list(strategy.configure_train(2, ArrayRecord(state), ConfigRecord({}), grid))
    assert sorted(m.metadata.dst_node_id for m in msgs) == [11, 12, 13]
    assert len({id(m.content) for m in msgs}) == 3  # a fresh RecordDict per node
    for m in msgs:
        spec = m.content["config"]
        cfg = json.loads(spec["model-config"])
        width = {"phone": 0.25, "desktop": 0.5}[grid.devices[m.metadata.dst_node_id]]
        assert spec["width"] == width and spec["server-round"] == 2 and spec["role"] == "submodel"
        sub = m.content["arrays"].to_torch_state_dict()
        assert sub["model.layers.0.mlp.up_proj.weight"].shape[0] == cfg["intermediate_size"] == 48 * width
        assert sub["model.layers.0.self_attn.q_proj.weight"].shape[0] == cfg["num_attention_heads"] * 8
    # staggered: the three windows of this round do not overlap
    units = [u for p in plans(strategy).values() for u in p.neurons]
    assert len(units) == len(set(units))


def _reply(msg: Message, arrays: dict | None, error: str | None = None) -> Message:
    if error:
        return Message(Error(code=1, reason=error), reply_to=msg)
    metrics = MetricRecord({"num-examples": 10, "train_loss": 1.0, "train_s": 0.1})
    return Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics}), reply_to=msg)


def test_bad_replies_are_rejected_and_logged_and_good_ones_fold_in():
    strategy, state = make_strategy()
    grid = FakeGrid({11: "phone", 12: "desktop", 13: "phone"})
    msgs = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), grid)}
    good = {k: v + 1.0 for k, v in msgs[11].content["arrays"].to_torch_state_dict().items()}
    nan = msgs[12].content["arrays"].to_torch_state_dict()
    nan["model.norm.weight"][0] = float("nan")
    arrays, metrics = strategy.aggregate_train(1, [_reply(msgs[11], good), _reply(msgs[12], nan),
                                                   _reply(msgs[13], None, error="device crashed")])
    status = {n: c.status for n, c in strategy.run.round.rows.items()}
    assert status == {11: "ok", 12: "rejected", 13: "failed"}
    assert {r.method for r in strategy.run.round.rows.values()} == {"submodel"}  # clients.jsonl's method field
    assert "NaN" in strategy.run.round.rows[12].error and "crashed" in strategy.run.round.rows[13].error
    assert metrics["clients_ok"] == 1
    new = arrays.to_torch_state_dict()
    plan = plans(strategy)[11]
    plan_config = strategy.run.methods["phone"].config
    expected = extract(state, plan_config, plan)
    # node 11's slice moved by exactly its update (scaler undone); everything else unchanged
    got = extract(new, plan_config, plan)
    # (x s + 1) / s, then * s again: a few float32 roundings (the +1, the scaler's division and product, the mean's)
    norm = expected["model.norm.weight"].double()
    assert_within(got["model.norm.weight"], norm + 1.0, gamma(5, torch.float32) * (norm.abs() + 1.0))
    outside = sorted(set(range(48)) - set(plan.neurons))
    assert torch.equal(new["model.layers.0.mlp.up_proj.weight"][outside], state["model.layers.0.mlp.up_proj.weight"][outside])


def test_too_few_good_replies_leave_the_target_unchanged():
    strategy, state = make_strategy(min_clients=2)
    grid = FakeGrid({11: "phone", 12: "desktop", 13: "phone"})
    msgs = list(strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), grid))
    replies = [_reply(msgs[0], msgs[0].content["arrays"].to_torch_state_dict())]  # two nodes never answer
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is None and metrics["clients_ok"] == 1 and strategy.run.round.void
    assert sorted(c.status for c in strategy.run.round.rows.values()) == ["ok", "timeout", "timeout"]


def test_unknown_device_is_not_sampled():
    strategy, state = make_strategy()
    grid = FakeGrid({11: "phone", 12: "toaster", 13: "phone"})
    msgs = list(strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), grid))
    assert sorted(m.metadata.dst_node_id for m in msgs) == [11, 13]


def test_injected_faults_are_seeded_and_follow_the_recipe():
    from fedfusion.clients.submodel import inject_faults

    from fedfusion.wire.specs import FaultSpec, RoundSpec

    def spec(seed: int, faults: FaultSpec | None = None) -> ConfigRecord:
        return ConfigRecord({**RoundSpec(1, seed).to_config(), **(faults.to_config() if faults else {})})

    assert inject_faults(spec(5, FaultSpec(corrupt_prob=1.0, straggler_prob=1.0, straggler_delay_s=2.5)), 3) == (True, 2.5)
    with pytest.raises(RuntimeError, match="injected crash"):
        inject_faults(spec(5, FaultSpec(crash_prob=1.0)), 3)
    assert inject_faults(spec(5), 3) == (False, 0.0)
    mixed = spec(9, FaultSpec(corrupt_prob=0.5))
    draws = [inject_faults(mixed, p)[0] for p in range(40)]
    assert draws == [inject_faults(mixed, p)[0] for p in range(40)] and 5 < sum(draws) < 35


def test_median_aggregation_shrugs_off_one_wild_client():
    strategy, state = make_strategy(aggregate="median")
    grid = FakeGrid({11: "phone", 12: "desktop", 13: "phone"})
    msgs = list(strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), grid))
    shifts = {11: 1.0, 12: 1.0, 13: 1000.0}
    replies = [_reply(m, {k: v + shifts[m.metadata.dst_node_id]
                          for k, v in m.content["arrays"].to_torch_state_dict().items()}) for m in msgs]
    arrays, _ = strategy.aggregate_train(1, replies)
    new = arrays.to_torch_state_dict()["model.norm.weight"]  # held by all three clients
    # exact: the median of three values is one of them, the middle client's b + 1.0 (the norm's scaler is 1)
    assert torch.equal(new, state["model.norm.weight"] + 1.0)


def malformed(state: dict[str, torch.Tensor], kind: int, rng: np.random.Generator) -> RecordDict:
    """One of many kinds of broken reply content built from the sub-model ``state`` that was sent."""
    s = {k: v.clone() for k, v in state.items()}
    key = list(s)[int(rng.integers(len(s)))]
    metrics = MetricRecord({"num-examples": 10, "train_loss": 1.0, "train_s": 0.1})
    if kind == 0:
        s[key].view(-1)[int(rng.integers(s[key].numel()))] = float("nan")
    elif kind == 1:
        s[key].view(-1)[int(rng.integers(s[key].numel()))] = float("inf") * (1 if rng.random() < 0.5 else -1)
    elif kind == 2:
        del s[key]
    elif kind == 3:
        s["model.extra.weight"] = torch.zeros(3)
    elif kind == 4:
        s[key] = torch.zeros(*[d + int(rng.integers(1, 3)) for d in s[key].shape])
    elif kind == 5:
        s = {k: v * float(rng.uniform(1e3, 1e6)) for k, v in s.items()}  # absurd norm
    elif kind == 6:
        metrics = MetricRecord({"train_loss": 1.0, "train_s": 0.1})  # no num-examples
    elif kind == 7:
        metrics = MetricRecord({"num-examples": -int(rng.integers(0, 5)), "train_loss": 1.0, "train_s": 0.1})
    elif kind == 8:
        return RecordDict({"metrics": metrics})  # no arrays at all
    elif kind == 9:
        return RecordDict({"arrays": ConfigRecord({"x": 1}), "metrics": metrics})  # wrong record type
    else:
        matrix = next(k for k in s if s[k].dim() == 2)
        s[matrix] = s[matrix].reshape(-1)  # right size, wrong shape
    return RecordDict({"arrays": ArrayRecord(s), "metrics": metrics})


def test_fuzzed_malformed_replies_are_all_rejected_logged_and_leave_the_target_unchanged():
    strategy, state = make_strategy()
    grid = FakeGrid({11: "phone", 12: "desktop", 13: "phone"})
    rng = np.random.default_rng(0)
    for rnd in range(1, 23):  # 66 broken replies covering every kind several times
        msgs = list(strategy.configure_train(rnd, ArrayRecord(state), ConfigRecord({}), grid))
        replies = [Message(malformed(m.content["arrays"].to_torch_state_dict(), (rnd * 3 + i) % 11, rng), reply_to=m)
                   for i, m in enumerate(msgs)]
        arrays, metrics = strategy.aggregate_train(rnd, replies)
        assert arrays is None and metrics["clients_ok"] == 0
        rows = strategy.run.round.rows.values()
        assert all(r.status == "rejected" and r.error for r in rows), [(r.status, r.error) for r in rows]


def test_a_good_update_with_broken_train_metrics_is_rejected_whole():
    strategy, state = make_strategy()
    grid = FakeGrid({11: "phone", 12: "desktop", 13: "phone"})
    msgs = list(strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), grid))
    bad = [MetricRecord({"num-examples": 10, "train_s": 0.1}), MetricRecord({"num-examples": 10, "train_loss": 1.0}),
           MetricRecord({"num-examples": 10, "train_loss": float("nan"), "train_s": 0.1})]
    replies = [Message(RecordDict({"arrays": m.content["arrays"], "metrics": metrics}), reply_to=m)
               for m, metrics in zip(msgs, bad)]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is None and metrics["clients_ok"] == 0
    assert {r.status for r in strategy.run.round.rows.values()} == {"rejected"}


def test_a_measured_host_energy_reading_is_kept_and_labelled():
    strategy, state = make_strategy()
    grid = FakeGrid({11: "phone", 12: "desktop", 13: "phone"})
    msgs = list(strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), grid))
    metrics = MetricRecord({"num-examples": 10, "train_loss": 1.0, "train_s": 0.1, "measured-j-rapl": 40.0,
                            "measured-j-nvml": 2.5})
    replies = [Message(RecordDict({"arrays": m.content["arrays"], "metrics": metrics}), reply_to=m) for m in msgs]
    strategy.aggregate_train(1, replies)
    rows = strategy.run.round.rows.values()
    assert all(r.status == "ok" and r.measured_j == 42.5 and r.measured_source == "nvml+rapl" for r in rows)


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_tied_embeddings_travel_once_and_stay_tied(family):
    """GPT-2 and OPT tie lm_head to the token embedding: a message carries that tensor once, bytes and priced
    parameters count it once, and the folded target keeps lm_head equal to the embedding."""
    from fedfusion.clients.submodel import trained_reply

    from fedfusion.models.build import config_aliases, model_from_state
    from fedfusion.models.families import family_of
    from tests.test_slice_families import CONFIGS

    cfg = CONFIGS[family]()
    alias, source = next(iter(config_aliases(cfg).items()))
    assert alias == "lm_head.weight"
    torch.manual_seed(0)
    state = family_of(cfg).build(cfg).state_dict()
    method = SubModelMethod(cfg, {"phone": 0.5, "desktop": 1.0}, state, policy="rolling", stride=0.25)
    strategy = new_strategy(
        {"phone": method, "desktop": method}, clients_per_round=2, min_clients=1, query_config={"population": "{}"},
        participation=Participation(make_selector("random", seed=0), load_catalog()),
        train_config={"local-steps": 1, "lr": 0.1, "seed": 0}, wait_nodes_s=1.0,
    )
    msgs = list(strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), FakeGrid({11: "phone", 12: "desktop"})))
    replies = []
    for m in msgs:
        sent = m.content["arrays"].to_torch_state_dict()
        row = strategy.run.round.rows[m.metadata.dst_node_id]
        sub = model_from_state(cfg.__class__.from_dict(json.loads(m.content["config"]["model-config"])), sent)
        assert alias not in sent and source in sent
        assert row.params == sum(p.numel() for p in sub.parameters()) == sum(t.numel() for t in sent.values())
        assert row.bytes_down == m.content["arrays"].count_bytes() < 4 * row.params + 200 * len(sent)  # + key/shape headers
        with torch.no_grad():
            sub.get_input_embeddings().weight.add_(1.0)  # "training" moves the tied tensor once
        reply, _ = trained_reply(sub, torch.zeros(3, 2), (False, 0.0), NO_TRAINING)
        assert list(reply) == list(sent)  # the reply leaves the alias out too, in the order received
        replies.append(_reply(m, {**reply, alias: torch.full_like(reply[source], 99.0)}))  # a stray alias is ignored
    arrays, _ = strategy.aggregate_train(1, replies)
    new = arrays.to_torch_state_dict()
    assert torch.equal(new[alias], new[source])  # exact: the alias is rebuilt from its source
    # the desktop held every row at width 1.0, the phone some: each coordinate is (sum of weight x value) / (sum of
    # weights) over one or two equal values, value = state + 1 as the client rounded it: a rounding for each product,
    # the sum, the weights' sum and the quotient, gamma_4 of the value
    want = state[source] + 1.0
    assert_within(new[source], want, gamma(4, torch.float32) * want.abs())


def test_an_fp16_downlink_halves_the_bytes_sent_and_loses_no_part_of_an_update():
    from fedfusion.clients.submodel import trained_reply

    from fedfusion.models.build import model_from_state
    from fedfusion.models.slicing import sub_config

    grid = FakeGrid({11: "phone", 12: "desktop", 13: "phone"})
    sizes = {}
    stepped = {}
    for dtype, step in (("float32", 0.0), ("float16", 0.0), ("float32", 2e-4), ("float16", 2e-4)):
        strategy, state = make_strategy(wire_dtype=dtype)
        wire_dtype = {"float32": torch.float32, "float16": torch.float16}[dtype]
        msgs = list(strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), grid))
        sent = [m.content["arrays"].to_torch_state_dict() for m in msgs]
        assert {t.dtype for s in sent for t in s.values()} == {wire_dtype}
        sizes[dtype] = sum(sum(t.nbytes for t in s.values()) for s in sent)
        replies = []
        for m, s in zip(msgs, sent):  # every client moves every weight it holds by ``step`` (after the scaler)
            plan = plans(strategy)[m.metadata.dst_node_id]
            model = model_from_state(sub_config(strategy.run.methods["phone"].config, plan), s)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(step)
            reply, _ = trained_reply(model, torch.zeros(2, 2), (False, 0.0), NO_TRAINING)
            assert {v.dtype for v in reply.values()} == {torch.float32}  # replies stay float32
            replies.append(_reply(m, reply))
        new = strategy.aggregate_train(1, replies)[0].to_torch_state_dict()
        norm = "model.norm.weight"  # weights near 1: an fp16 ulp is ~1e-3, far above the step
        if step == 0:  # a client that trains nothing leaves the float32 target exactly as it was: a zero change,
            tied = {"model.embed_tokens.weight", "lm_head.weight"}  # but the tied embedding, whose two aliases'
            assert all(torch.equal(new[k], v) for k, v in state.items() if k not in tied)  # round trips through
            for k in tied:  # the scaler (gamma_3 |x| each, tests/test_slicing.py) are averaged: within gamma_4 |x|
                assert_within(new[k], state[k], gamma(4, torch.float32) * state[k].double().abs())
        else:
            stepped[dtype] = new
    moved = stepped["float16"][norm] - state[norm]  # an fp16 round trip of the weights would have moved it by 0
    assert (moved > 1e-5).any()
    # the fp16 downlink folds the same update as the float32 one: each fold within a few float32 roundings of
    # x + 2e-4 (the client's sum and change, the scaler's, the mean's, the fold's addition), |x'| <= 2 |x| received
    for k, v in stepped["float32"].items():
        assert_within(stepped["float16"][k], v, 2 * gamma(6, torch.float32) * (2 * state[k].double().abs() + 2e-4))
    assert sizes["float16"] * 2 == sizes["float32"]


class CountingGrid(FakeGrid):
    """A FakeGrid that records every QUERY batch it is sent (the node ids of each)."""

    def __init__(self, devices: dict[int, str]) -> None:
        super().__init__(devices)
        self.queries: list[list[int]] = []

    def send_and_receive(self, messages, timeout=None):
        self.queries.append([m.metadata.dst_node_id for m in messages])
        return super().send_and_receive(messages, timeout)


def pooled_strategy(pool: int, clients_per_round: int = 3) -> FusionStrategy:
    cfg = tiny_config(heads=4, kv_heads=4, hidden=32, inter=48)
    method = SubModelMethod(cfg, {"phone": 0.25, "desktop": 0.5}, LlamaForCausalLM(cfg).state_dict(),
                            policy="rolling", stride=0.25)
    return new_strategy(
        {"phone": method, "desktop": method}, clients_per_round=clients_per_round, pool=pool,
        query_config={"population": "{}"}, participation=Participation(make_selector("random", seed=0), load_catalog()),
        train_config={"seed": 0}, wait_nodes_s=1.0,
    )


def test_a_population_within_the_pool_is_queried_whole_once_and_drawn_from_whole():
    grid = CountingGrid({n: ("phone", "desktop")[n % 2] for n in range(1, 41)})
    strategy = pooled_strategy(pool=40)
    drawn = [strategy.sample(grid, r) for r in (1, 2, 3)]
    assert grid.queries == [list(range(1, 41))]  # round 1 asks everyone, later rounds no one
    assert all(len(d) == 3 for d in drawn) and len(strategy.run.caps) == 40


def test_a_larger_population_is_queried_lazily_in_pools_never_twice_and_drawn_over_all_of_it():
    nodes = range(1000, 6000)
    grid = CountingGrid({n: ("phone", "desktop")[n % 2] for n in nodes})
    strategy = pooled_strategy(pool=20)
    drawn = [n for r in range(1, 31) for n in strategy.sample(grid, r)]
    asked = [n for batch in grid.queries for n in batch]
    assert all(len(batch) <= 20 for batch in grid.queries) and len(asked) == len(set(asked))
    assert len(strategy.run.caps) == len(asked) <= 30 * 20  # the server holds only the nodes its pools held
    assert len(drawn) == 90 and set(drawn) <= set(strategy.run.caps)
    # each round's pool is drawn over every node, not over those known already: later rounds train new nodes
    assert len(set(drawn)) > 80


def test_a_pool_short_of_usable_nodes_takes_another_batch_and_a_useless_node_is_never_asked_again():
    devices = {n: "toaster" for n in range(1, 101)} | {n: "phone" for n in range(101, 111)}
    grid = CountingGrid(devices)
    strategy = pooled_strategy(pool=10)
    for r in (1, 2, 3):
        assert len(strategy.sample(grid, r)) == 3
    asked = [n for batch in grid.queries for n in batch]
    assert len(grid.queries) > 3 and len(asked) == len(set(asked))  # more than one batch a round, none repeated
    assert strategy.run.unusable == {n for n in asked if devices[n] == "toaster"}


def test_a_pool_smaller_than_the_draw_is_refused():
    with pytest.raises(ValueError, match="pool must hold at least the 6 clients"):
        pooled_strategy(pool=5, clients_per_round=6)
    from fedfusion.config.sections import RecipeError
    from fedfusion.run.check import load_checked

    with pytest.raises(RecipeError, match="selection.pool: must be at least the 9 clients"):
        load_checked("quickstart", ["selection.pool=8", "selection.overselect=0.5"])


def test_a_real_devices_own_training_time_is_priced_as_measured():
    """A reply carrying ``device_step_s`` came from a real device (a phone behind a gateway): the ledger prices its
    compute at the device's own ``train_s`` instead of its FLOPs at the catalog's speed; a simulated client's
    ``train_s`` (the host's time) is not priced; a broken step time rejects the reply."""
    from fedfusion.devices.catalog import load_catalog
    from fedfusion.devices.energy import price_work, train_flops
    from fedfusion.run.federation import price_client
    from fedfusion.wire.keys import DEVICE_STEP_S

    strategy, state = make_strategy()
    msgs = {m.metadata.dst_node_id: m for m in strategy.configure_train(
        1, ArrayRecord(state), ConfigRecord({}), FakeGrid({11: "phone", 12: "phone", 13: "phone"}))}
    base = {"num-examples": 10, "train_loss": 1.0, "train_s": 7.5}
    extra = {11: {DEVICE_STEP_S: 0.25}, 12: {}, 13: {DEVICE_STEP_S: float("nan")}}
    replies = [Message(RecordDict({"arrays": ArrayRecord(msgs[n].content["arrays"].to_torch_state_dict()),
                                   "metrics": MetricRecord({**base, **extra[n]})}), reply_to=msgs[n]) for n in msgs]
    strategy.aggregate_train(1, replies)
    device, simulated, broken = (strategy.run.round.rows[n] for n in (11, 12, 13))
    assert (device.status, device.device_s, simulated.status, simulated.device_s) == ("ok", 7.5, "ok", None)
    assert broken.status == "rejected" and DEVICE_STEP_S in (broken.error or "")
    phone = load_catalog()["phone"]
    measured, catalog_speed = price_client(device, load_catalog()), price_client(simulated, load_catalog())
    assert measured["compute_s"] == 7.5 != catalog_speed["compute_s"]
    assert measured["energy_j"] == pytest.approx(price_work(phone, 0.0, device.bytes_down, device.bytes_up,
                                                            compute_s=7.5).wall_j)
    assert catalog_speed["compute_s"] == pytest.approx(price_work(phone, train_flops(simulated.params, simulated.tokens),
                                                                  0, 0).compute_s)
    with pytest.raises(ValueError, match="compute_s must be a number >= 0"):
        price_work(phone, 1.0, 0, 0, compute_s=-1.0)


def test_a_round_is_sent_longest_first_at_each_tiers_last_measured_rate():
    strategy, state = make_strategy()
    strategy.settings.train_config.update({"batch-size": 2, "seq-len": 4})
    grid = FakeGrid({11: "phone", 12: "desktop", 13: "phone"})
    first = list(strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), grid))
    # nothing measured yet and every client plans the same tokens: the sample order, kept by a stable sort
    assert [m.metadata.dst_node_id for m in first] == list(strategy.run.round.rows)
    tokens = {11: 8, 12: 8, 13: 24}  # as the replies report them
    seconds = {11: 0.1, 12: 0.9, 13: 0.5}
    replies = []
    for m in first:
        node = m.metadata.dst_node_id
        metrics = MetricRecord({"num-examples": 10, "train_loss": 1.0, "train_s": seconds[node],
                                "train_tokens": tokens[node]})
        replies.append(Message(RecordDict({"arrays": m.content["arrays"], "metrics": metrics}), reply_to=m))
    strategy.aggregate_train(1, replies)
    assert strategy.run.rates == {"phone": 0.6 / 32, "desktop": 0.9 / 8}
    second = list(strategy.configure_train(2, ArrayRecord(state), ConfigRecord({}), grid))
    # every client plans 1 step x 2 x 4 tokens: the desktop's rate is six times the phones'
    predicted = [strategy.predicted_s(m.metadata.dst_node_id) for m in second]
    assert predicted == sorted(predicted, reverse=True) and predicted[0] == 8 * (0.9 / 8)
    assert second[0].metadata.dst_node_id == 12 and predicted[1] == predicted[2] == 8 * (0.6 / 32)
    # a tier not measured yet is predicted at the measured tiers' mean rate
    del strategy.run.rates["desktop"]
    assert strategy.predicted_s(12) == 8 * (0.6 / 32)
