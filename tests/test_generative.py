"""Generative distillation: sampling, the pool, the strategy on hand-built Flower messages and the client role."""

from __future__ import annotations

import json

import pytest
import torch
from fedfusion.clients import generative as role
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from fp_bounds import assert_within, gamma, unit_roundoff
from transformers import LlamaForCausalLM

from fedfusion.devices.catalog import load_catalog
from fedfusion.fusion.generative.config import GenerativeConfig
from fedfusion.fusion.generative.method import GenerativeMethod
from fedfusion.fusion.generative.reply import (
    SAMPLES_KEY,
    TOP_IDS_KEY,
    TOP_LOGP_KEY,
    SamplePool,
    check_samples,
    check_teacher,
    sample_windows,
    top_tokens,
)
from fedfusion.fusion.generative.spec import GenerativeSpec
from fedfusion.selection.participation import Participation
from fedfusion.selection.selectors import make_selector
from fedfusion.train.distill import TopTokensLoss
from fedfusion.wire.specs import ClientSpec, FaultSpec, ModelSpec, RoundSpec, TrainSpec, merge
from tests.conftest import tiny_config
from tests.test_strategy import FakeGrid, new_strategy, task_identity  # noqa: F401  (autouse fixture)


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
    pool.add(1, {"ids": torch.zeros(3, 4, dtype=torch.long), "x": torch.zeros(3, 2)}, cap=4)
    pool.add(0, {"ids": torch.ones(2, 4, dtype=torch.long), "x": torch.ones(2, 2)}, cap=2)
    pool.add(1, {"ids": torch.full((2, 4), 7), "x": torch.full((2, 2), 7.0)}, cap=4)
    assert pool.windows()[:, 0].tolist() == [1, 1, 0, 0, 7, 7]  # client order; client 1's oldest dropped
    assert pool.arrays()["x"][:, 0].tolist() == [1, 1, 0, 0, 7, 7]  # every array kept row for row with the ids
    with pytest.raises(ValueError, match="earlier ones"):
        pool.add(0, {"ids": torch.ones(1, 4, dtype=torch.long)}, cap=2)
    with pytest.raises(ValueError):
        SamplePool().windows()


def test_top_tokens_are_the_models_likeliest_next_tokens_and_checked():
    cfg = tiny_config(heads=4, kv_heads=4, hidden=32, inter=48)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    windows = torch.randint(0, cfg.vocab_size, (5, 9))
    ids, logp = top_tokens(model, windows, 4, batch_size=2)
    assert ids.shape == logp.shape == (5, 8, 4) and ids.dtype == torch.int32 and logp.dtype == torch.float16
    # the same batches of 2 as top_tokens: the same float32 operations, so the same log-probabilities bit for bit,
    # which top_tokens then rounds to float16: within half a float16 ulp, u16 |value| (all in float16's normal range)
    with torch.no_grad():
        full = torch.cat([torch.log_softmax(model(input_ids=windows[i:i + 2, :-1]).logits.float(), dim=-1)
                          for i in range(0, len(windows), 2)])
    top = full.topk(4, dim=-1)
    assert torch.equal(ids.long(), top.indices)
    assert_within(logp, top.values, unit_roundoff(torch.float16) * top.values.double().abs())
    check_teacher(ids, logp, windows, 4, cfg.vocab_size)
    for bad_ids, bad_logp, match in ((ids[:, :-1], logp[:, :-1], "must be"), (ids + cfg.vocab_size, logp, "outside"),
                                     (ids, logp.abs() + 1, "<= 0"), (ids, logp.float() * float("nan"), "finite")):
        with pytest.raises(ValueError, match=match):
            check_teacher(bad_ids, bad_logp, windows, 4, cfg.vocab_size)


def test_top_tokens_loss_with_every_token_is_the_cross_entropy_against_the_teacher():
    cfg = tiny_config(heads=4, kv_heads=4, hidden=32, inter=48)
    torch.manual_seed(0)
    teacher, student = LlamaForCausalLM(cfg), LlamaForCausalLM(cfg)
    windows = torch.randint(0, cfg.vocab_size, (3, 7))
    ids, logp = top_tokens(teacher, windows, cfg.vocab_size)  # every token: nothing renormalised away
    rows = torch.tensor([2, 0])
    step = TopTokensLoss(ids, logp.float())(student, windows[rows], rows)
    teacher_logp = torch.log_softmax(teacher(input_ids=windows[rows, :-1]).logits.float(), -1)
    p_t = teacher_logp.exp()
    log_s = torch.log_softmax(student(input_ids=windows[rows, :-1]).logits.float(), -1)
    assert step.tokens == 12
    # The loss reads the teacher's float16 log-probabilities: off by delta <= half a float16 ulp each, so each
    # renormalised probability within a factor e^(+-2 delta) of the teacher's, and as both sum to 1 the loss moves by
    # at most (e^(2 delta) - 1) sum_j p_j |log_s_j - c| (c the teacher-weighted mean of log_s), per position; and the
    # float32 softmax, products and sums on both sides, gamma_{V+16} of sum_j p_j |log_s_j| each.
    sent = torch.zeros_like(teacher_logp).scatter(-1, ids[rows].long(), logp[rows].float())
    delta = (sent.double() - teacher_logp.double()).abs().amax(-1)
    centre = (p_t * log_s).sum(-1, keepdim=True)
    moved = ((2 * delta).expm1() * (p_t.double() * (log_s - centre).double().abs()).sum(-1)).mean()
    size = (p_t.double() * log_s.double().abs()).sum(-1).mean()
    bound = moved + 2 * gamma(cfg.vocab_size + 16, torch.float32) * size
    assert abs(float(step.loss) - float(-(p_t * log_s).sum(-1).mean())) <= float(bound)
    few = TopTokensLoss(ids[..., :2], logp[..., :2])(student, windows[rows], rows)  # two tokens: renormalised
    p2 = torch.softmax(logp[rows, :, :2].float(), -1)  # the loss's own operations on the same values: bit for bit
    assert torch.equal(few.loss, -(p2 * log_s.gather(-1, ids[rows, :, :2].long())).sum(-1).mean())


def _strategy(top_k: int = 0, device_state: str = "server"):
    cfg = tiny_config(heads=4, kv_heads=4, hidden=32, inter=48)
    torch.manual_seed(0)
    state = LlamaForCausalLM(cfg).state_dict()
    method = GenerativeMethod(cfg, {"phone": 0.25, "desktop": 0.5}, state,
                              GenerativeConfig(sample_fraction=0.5, server_steps=3, server_batch=4, top_k=top_k,
                                               device_state=device_state), seq_len=8, population=20)
    strategy = new_strategy(
        {"phone": method, "desktop": method}, clients_per_round=2, min_clients=1,
        query_config={"population": "{}"}, participation=Participation(make_selector("random", seed=0), load_catalog()),
        train_config={"local-steps": 1, "lr": 0.1, "seed": 0, "seq-len": 8}, wait_nodes_s=1.0)
    return strategy, state, cfg


def _reply(msg: Message, arrays: dict) -> Message:
    metrics = MetricRecord({"num-examples": 10, "train_loss": 1.0, "train_s": 0.1})
    return Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics}), reply_to=msg)


def test_server_state_strategy_keeps_device_models_rejects_bad_samples_and_trains_the_target():
    strategy, state, cfg = _strategy()
    grid = FakeGrid({11: "phone", 12: "desktop"})
    msgs = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), grid)}
    spec = msgs[11].content["config"]
    assert spec["role"] == "generative" and spec["samples"] == 1  # caps carry no example count: 1 window
    own = {k: v + 0.01 for k, v in msgs[11].content["arrays"].to_torch_state_dict().items()}
    good = {**own, SAMPLES_KEY: torch.randint(0, cfg.vocab_size, (1, 9))}
    bad = {**msgs[12].content["arrays"].to_torch_state_dict(), SAMPLES_KEY: torch.randint(0, cfg.vocab_size, (1, 5))}
    arrays, metrics = strategy.aggregate_train(1, [_reply(msgs[11], good), _reply(msgs[12], bad)])
    assert {n: c.status for n, c in strategy.run.round.rows.items()} == {11: "ok", 12: "rejected"}
    assert "integer token ids" in strategy.run.round.rows[12].error
    assert metrics["clients_ok"] == 1 and strategy.run.round.server_cost["flops"] > 0
    new = arrays.to_torch_state_dict()
    assert any(not torch.equal(new[k], state[k]) for k in state)  # the target trained on the samples
    assert all(torch.equal(strategy.run.methods["phone"].devices[11][k], own[k]) for k in own)  # node 11's model is kept as returned
    again = {m.metadata.dst_node_id: m for m in strategy.configure_train(2, arrays, ConfigRecord({}), grid)}
    sent = again[11].content["arrays"].to_torch_state_dict()  # both nodes train every round (2 per round)
    assert all(torch.equal(sent[k], own[k]) for k in own)  # its own model back, not a fresh slice
    restored, _, _ = _strategy()
    restored.run.load_state_dict(json.loads(json.dumps(strategy.run.state_dict())), 2)
    assert torch.equal(restored.run.methods["phone"].pool.windows(), strategy.run.methods["phone"].pool.windows())
    assert all(torch.equal(restored.run.methods["phone"].devices[11][k], strategy.run.methods["phone"].devices[11][k]) for k in own)


def _round(strategy, rnd: int, arrays: ArrayRecord, grid: FakeGrid, extra) -> ArrayRecord:
    """One round in which every node returns its model nudged by 0.01 and ``extra(node, arrays sent)`` samples."""
    msgs = strategy.configure_train(rnd, arrays, ConfigRecord({}), grid)
    replies = []
    for m in msgs:
        own = {k: v + 0.01 for k, v in m.content["arrays"].to_torch_state_dict().items()}
        replies.append(_reply(m, {**own, **extra(m.metadata.dst_node_id)}))
    out, _ = strategy.aggregate_train(rnd, replies)
    return out


def test_top_k_replies_are_checked_and_the_servers_adamw_carries_across_rounds_and_resumes():
    strategy, state, cfg = _strategy(top_k=2)
    grid = FakeGrid({11: "phone", 12: "desktop"})
    gen = torch.Generator().manual_seed(0)

    def samples(node: int) -> dict:
        ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=gen)
        top = torch.randint(0, cfg.vocab_size, (1, 8, 2), generator=gen).int()
        logp = torch.log_softmax(torch.randn(1, 8, 2, generator=gen), -1).half()
        return {SAMPLES_KEY: ids, TOP_IDS_KEY: top, **({} if node == 12 else {TOP_LOGP_KEY: logp})}

    first = _round(strategy, 1, ArrayRecord(state), grid, samples)
    assert strategy.run.round.rows[11].status == "ok" and strategy.run.round.rows[12].status == "rejected"
    assert TOP_LOGP_KEY in strategy.run.round.rows[12].error  # names the array the reply lacks
    method = strategy.run.methods["phone"]
    assert set(method.pool.arrays()) == {"ids", TOP_IDS_KEY, TOP_LOGP_KEY}
    model, opt = method.server
    assert all(opt.state[p]["step"] == 3 for p in model.parameters())  # one round's server steps so far
    saved = json.loads(json.dumps(strategy.run.state_dict()))
    gen_state = gen.get_state()
    second = _round(strategy, 2, first, grid, samples)
    assert all(opt.state[p]["step"] == 6 for p in model.parameters())  # the same AdamW continued
    restored, _, _ = _strategy(top_k=2)
    restored.run.load_state_dict(saved, 1)
    gen.set_state(gen_state)
    again = _round(restored, 2, first, grid, samples)
    a, b = second.to_torch_state_dict(), again.to_torch_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # a resumed run's server takes the same steps


def test_client_role_trains_and_samples(tmp_path):
    from fedfusion.config.recipe import load_recipe
    from fedfusion.data.population import data_spec
    from fedfusion.models.slicing import extract, plan_slice, sub_config

    recipe = load_recipe("rolling", ["data.source=facts", "data.people=20", "population.num_clients=2",
                                     "selection.clients_per_round=2", "fusion.method=generative"])
    from fedfusion.run.targets import lm_target

    target = lm_target(recipe)
    cfg = target.model.config
    plan = plan_slice(cfg, 0.25, "static")
    spec = ConfigRecord(merge(ClientSpec(data_spec(recipe.data_source()), 48, 1), TrainSpec(2, 1e-2, 4, 0.0, "adamw"), RoundSpec(1, 5),
                              GenerativeSpec(0.25, 3, 1.0, 2, "server", False), ModelSpec(sub_config(cfg, plan).to_dict())))
    state, metrics = role.train(extract(target.model.state_dict(), cfg, plan), spec, partition=1)
    samples = state.pop(SAMPLES_KEY)
    assert samples.shape == (3, 49) and bool((samples[:, 0] == target.tokenizer.bos_token_id).all())
    check_teacher(state.pop(TOP_IDS_KEY), state.pop(TOP_LOGP_KEY), samples, 2, cfg.vocab_size)  # top_k 2 asked
    assert metrics["num-examples"] > 0 and metrics["train_loss"] > 0
    # an injected corruption hits what goes up: a node-state node's samples, never the model it keeps
    corrupt = ConfigRecord({**spec, **GenerativeSpec(0.25, 3, 1.0, 0, "node", False).to_config(),
                            **FaultSpec(0.0, 0.0, 0.0, 1.0).to_config()})
    state, _ = role.train(extract(target.model.state_dict(), cfg, plan), corrupt, partition=1)
    assert int(state.pop(SAMPLES_KEY).min()) == -1 and all(bool(torch.isfinite(v).all()) for v in state.values())


class KeptModelRole:
    """A generative role's training that nudges the model it is given by 0.01 and writes one window: what the role
    hands it (a sent or a kept model) is recorded by partition."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.given = vocab, {}

    def train(self, state, spec, partition, accelerator, ask):
        self.given[partition] = state
        samples = torch.randint(0, self.vocab, (1, 9), generator=torch.Generator().manual_seed(partition))
        reply = {**{k: v + 0.01 for k, v in state.items()}, SAMPLES_KEY: samples}
        return reply, {"num-examples": 10, "train_loss": 1.0, "train_s": 0.1}


def test_node_state_sends_a_partitions_model_once_and_again_only_to_a_node_that_lost_it(monkeypatch, caplog):
    from fedfusion.clients import generative
    from flwr.app import Context

    import fedfusion.client_app as client_app
    from fedfusion.models.slicing import extract, plan_slice
    from fedfusion.wire.specs import STATE_LOST

    strategy, state, cfg = _strategy(device_state="node")
    method = strategy.run.methods["phone"]
    fake_role = KeptModelRole(cfg.vocab_size)
    monkeypatch.setattr(generative, "sampled", fake_role.train)  # the real role keeps the model, the fake trains
    grid = FakeGrid({11: "phone", 12: "desktop"})
    nodes = {n: Context(run_id=1, node_id=n, node_config={"partition-id": n}, state=RecordDict(), run_config={})
             for n in (11, 12)}
    slices = {n: extract(state, cfg, plan_slice(cfg, w, "static")) for n, w in ((11, 0.25), (12, 0.5))}

    def round_(rnd: int, arrays: ArrayRecord) -> tuple[dict, tuple[dict, dict], ArrayRecord]:
        msgs = {m.metadata.dst_node_id: m for m in strategy.configure_train(rnd, arrays, ConfigRecord({}), grid)}
        replies = {n: client_app.train(m, nodes[n]) for n, m in msgs.items()}
        sent = {n: list(r.content["arrays"]) for n, r in replies.items() if not r.has_error()}  # let go once read
        out, _ = strategy.aggregate_train(rnd, list(replies.values()))
        return msgs, (replies, sent), out

    msgs, (replies, sent), first = round_(1, ArrayRecord(state))  # round 1: the initial slices down, samples up
    for n in (11, 12):
        assert msgs[n].content["config"]["device-state"] == "node" and not msgs[n].content["config"]["kept"]
        assert msgs[n].content["arrays"].to_torch_state_dict().keys() == slices[n].keys()
        assert sent[n] == [SAMPLES_KEY]  # the reply carries no model
        kept = nodes[n].state[generative.Node.KEY].to_torch_state_dict()
        assert all(torch.equal(kept[k], slices[n][k] + 0.01) for k in kept)  # the trained model stays on the node
    assert {r.status for r in strategy.run.round.rows.values()} == {"ok"} and method.devices == {} and method.kept == {11, 12}
    assert "devices" not in strategy.run.state_dict()["methods"]["generative"]  # a checkpoint holds no device model

    nodes[11] = Context(run_id=1, node_id=11, node_config={"partition-id": 11}, state=RecordDict(), run_config={})
    msgs, (replies, _), second = round_(2, first)  # node 11 restarted: its context.state is empty
    for n in (11, 12):
        assert msgs[n].content["config"]["kept"] and len(msgs[n].content["arrays"]) == 0  # no model goes down
        assert strategy.run.round.rows[n].bytes_down == 0
    assert replies[11].has_error() and STATE_LOST in replies[11].error.reason
    assert strategy.run.round.rows[11].status == "failed" and strategy.run.round.rows[12].status == "ok"
    assert "partition 11" in caplog.text and STATE_LOST in caplog.text  # the server's warning names the partition
    assert all(torch.equal(fake_role.given[12][k], slices[12][k] + 0.01) for k in slices[12])  # node 12 trained its own
    assert method.kept == {12}

    msgs, _, third = round_(3, second)  # node 11 gets the initial slice again, node 12 still nothing
    sent = msgs[11].content["arrays"].to_torch_state_dict()
    assert not msgs[11].content["config"]["kept"] and all(torch.equal(sent[k], slices[11][k]) for k in slices[11])
    assert msgs[12].content["config"]["kept"] and len(msgs[12].content["arrays"]) == 0
    assert {r.status for r in strategy.run.round.rows.values()} == {"ok"} and method.kept == {11, 12}

    restored, _, _ = _strategy(device_state="node")  # a resumed run: its nodes are new, so every slice goes again
    restored.run.load_state_dict(json.loads(json.dumps(strategy.run.state_dict())), 3)
    for m in restored.configure_train(4, third, ConfigRecord({}), grid):
        sent, n = m.content["arrays"].to_torch_state_dict(), m.metadata.dst_node_id
        assert not m.content["config"]["kept"] and all(torch.equal(sent[k], slices[n][k]) for k in slices[n])


def test_node_state_refuses_a_reply_that_carries_a_model():
    strategy, state, cfg = _strategy(device_state="node")
    grid = FakeGrid({11: "phone", 12: "desktop"})
    msgs = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), grid)}
    own = msgs[11].content["arrays"].to_torch_state_dict()
    samples = {SAMPLES_KEY: torch.randint(0, cfg.vocab_size, (1, 9))}
    strategy.aggregate_train(1, [_reply(msgs[11], {**own, **samples}), _reply(msgs[12], samples)])
    assert strategy.run.round.rows[11].status == "rejected" and "samples only" in strategy.run.round.rows[11].error
    assert strategy.run.round.rows[12].status == "ok" and strategy.run.methods["phone"].kept == {12}
