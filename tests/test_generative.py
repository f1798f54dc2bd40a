"""Generative distillation: sampling, the pool, the strategy on hand-built Flower messages and the client role."""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from transformers import LlamaForCausalLM

from fedfusion.clients import generative as role
from fedfusion.devices.catalog import load_catalog
from fedfusion.fusion.generative.method import GenerativeMethod
from fedfusion.models.samples import SAMPLES_KEY, GenerativeConfig, SamplePool, check_samples, sample_windows
from fedfusion.selection.participation import Participation
from fedfusion.selection.selectors import make_selector
from fedfusion.strategies import FusionStrategy
from fedfusion.wire.specs import ClientSpec, GenerativeSpec, ModelSpec, RoundSpec, TrainSpec, merge
from tests.conftest import tiny_config
from tests.test_strategy import FakeGrid, task_identity  # noqa: F401  (autouse fixture)


def test_samples_are_seeded_shaped_like_the_data_and_start_like_it():
    cfg = tiny_config(heads=4, kv_heads=4, hidden=32, inter=48)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    own = torch.randint(5, cfg.vocab_size, (7, 9))
    own[:, 0] = 2
    a = sample_windows(model, own, 5, 1.0, seed=3)
    assert a.shape == (5, 9) and bool((a[:, 0] == 2).all())
    assert torch.equal(a, sample_windows(model, own, 5, 1.0, seed=3))
    assert not torch.equal(a, sample_windows(model, own, 5, 1.0, seed=4))
    check_samples(a, 9, cfg.vocab_size, most=5)
    for bad, match in ((a[:, :4], "integer token ids"), (a.float(), "integer token ids"),
                       (torch.cat([a, a]), "expected 1 to 5"), (a + cfg.vocab_size, "outside the vocabulary")):
        with pytest.raises(ValueError, match=match):
            check_samples(bad, 9, cfg.vocab_size, most=5)


def test_pool_keeps_each_clients_newest_samples():
    pool = SamplePool()
    pool.add(1, torch.zeros(3, 4, dtype=torch.long), cap=4)
    pool.add(0, torch.ones(2, 4, dtype=torch.long), cap=2)
    pool.add(1, torch.full((2, 4), 7), cap=4)
    assert pool.windows()[:, 0].tolist() == [1, 1, 0, 0, 7, 7]  # client order; client 1's oldest dropped
    with pytest.raises(ValueError):
        SamplePool().windows()


def _strategy():
    cfg = tiny_config(heads=4, kv_heads=4, hidden=32, inter=48)
    torch.manual_seed(0)
    state = LlamaForCausalLM(cfg).state_dict()
    method = GenerativeMethod(cfg, {"phone": 0.25, "desktop": 0.5}, state,
                              GenerativeConfig(sample_fraction=0.5, server_steps=3, server_batch=4), seq_len=8,
                              population=20)
    strategy = FusionStrategy(
        {"phone": method, "desktop": method}, clients_per_round=2, min_clients=1,
        query_config={"population": "{}"}, participation=Participation(make_selector("random", seed=0), load_catalog()),
        train_config={"local-steps": 1, "lr": 0.1, "seed": 0, "seq-len": 8}, wait_nodes_s=1.0)
    return strategy, state, cfg


def _reply(msg: Message, arrays: dict) -> Message:
    metrics = MetricRecord({"num-examples": 10, "train_loss": 1.0, "train_s": 0.1})
    return Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics}), reply_to=msg)


def test_strategy_keeps_device_models_rejects_bad_samples_and_trains_the_target():
    strategy, state, cfg = _strategy()
    grid = FakeGrid({11: "phone", 12: "desktop"})
    msgs = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), grid)}
    spec = msgs[11].content["config"]
    assert spec["role"] == "generative" and spec["samples"] == 1  # caps carry no example count: 1 window
    own = {k: v + 0.01 for k, v in msgs[11].content["arrays"].to_torch_state_dict().items()}
    good = {**own, SAMPLES_KEY: torch.randint(0, cfg.vocab_size, (1, 9))}
    bad = {**msgs[12].content["arrays"].to_torch_state_dict(), SAMPLES_KEY: torch.randint(0, cfg.vocab_size, (1, 5))}
    arrays, metrics = strategy.aggregate_train(1, [_reply(msgs[11], good), _reply(msgs[12], bad)])
    assert {n: c.status for n, c in strategy.round.rows.items()} == {11: "ok", 12: "rejected"}
    assert "integer token ids" in strategy.round.rows[12].error
    assert metrics["clients_ok"] == 1 and strategy.round.server_cost["flops"] > 0
    new = arrays.to_torch_state_dict()
    assert any(not torch.equal(new[k], state[k]) for k in state)  # the target trained on the samples
    assert all(torch.equal(strategy.methods["phone"].devices[11][k], own[k]) for k in own)  # node 11's model is kept as returned
    again = {m.metadata.dst_node_id: m for m in strategy.configure_train(2, arrays, ConfigRecord({}), grid)}
    sent = again[11].content["arrays"].to_torch_state_dict()  # both nodes train every round (2 per round)
    assert all(torch.equal(sent[k], own[k]) for k in own)  # its own model back, not a fresh slice
    restored, _, _ = _strategy()
    restored.load_state_dict(json.loads(json.dumps(strategy.state_dict())), 2)
    assert torch.equal(restored.methods["phone"].pool.windows(), strategy.methods["phone"].pool.windows())
    assert all(torch.equal(restored.methods["phone"].devices[11][k], strategy.methods["phone"].devices[11][k]) for k in own)


def test_client_role_trains_and_samples(tmp_path):
    from fedfusion.config.recipe import load_recipe
    from fedfusion.data.population import data_spec
    from fedfusion.models.slicing import extract, plan_slice, sub_config

    recipe = load_recipe("quickstart", ["data.source=facts", "data.people=20", "population.num_clients=2",
                                        "selection.clients_per_round=2", "fusion.method=generative"])
    from fedfusion.run.targets import lm_target

    target = lm_target(recipe)
    cfg = target.model.config
    plan = plan_slice(cfg, 0.25, "static")
    spec = ConfigRecord(merge(ClientSpec(data_spec(recipe), 48, 1), TrainSpec(2, 1e-2, 4, 0.0, "adamw"), RoundSpec(1, 5),
                              GenerativeSpec(0.25, 3, 1.0), ModelSpec(sub_config(cfg, plan).to_dict())))
    state, metrics = role.train(extract(target.model.state_dict(), cfg, plan), spec, partition=1)
    samples = state.pop(SAMPLES_KEY)
    assert samples.shape == (3, 49) and bool((samples[:, 0] == target.tokenizer.bos_token_id).all())
    assert metrics["num-examples"] > 0 and metrics["train_loss"] > 0
