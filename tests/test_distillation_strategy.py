"""FusionStrategy driving distillation (DistillMethod) on hand-built Flower Messages (no Ray): per-family messages, FedAvg within families,
distillation into the target and back, rejection of bad replies, void rounds; and the small-model client role."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict

import pytest
import torch
from fedfusion.clients import smallmodel
from fedfusion.strategies import FusionStrategy
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from fp_bounds import assert_within, gamma, log_softmax_bound, unit_roundoff
from transformers import GPT2Config, LlamaConfig, LlamaForCausalLM

from fedfusion.config.sections import DataConfig
from fedfusion.data.text import build_char_tokenizer
from fedfusion.devices.catalog import load_catalog
from fedfusion.fusion.distill.config import DistillConfig
from fedfusion.fusion.distill.method import DistillMethod, Family, family_eval_set, score_per_char
from fedfusion.models import build as models
from fedfusion.selection.participation import Participation
from fedfusion.selection.selectors import make_selector
from fedfusion.train.transfer import family_tokenizer, train_bpe, wrap_tokenizer
from tests.test_strategy import FakeGrid, new_strategy, task_identity  # noqa: F401  (autouse fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

TEXT = ("Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds "
        "that lour'd upon our house in the deep bosom of the ocean buried.\n") * 12
CHAR = build_char_tokenizer()


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(TEXT, 300)


def llama(hidden: int, vocab: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=hidden // 2,
                       max_position_embeddings=256, tie_word_embeddings=False)


def make(bpe, min_clients: int = 1, back_distill: bool = False, teacher: str = "feddf", eval_text: str = "",
         diversity_weight: float = 0.0) -> tuple[FusionStrategy, dict]:
    families = {"tiny": Family(llama(16, len(CHAR))),
                "gpt": Family(GPT2Config(vocab_size=len(bpe), n_embd=16, n_layer=1, n_head=2, n_positions=256,
                                         bos_token_id=2, eos_token_id=3), bpe)}
    settings = DistillConfig(teacher=teacher, kd_weight=1.0, diversity_weight=diversity_weight, server_steps=4,
                             server_batch_size=4, back_distill=back_distill, back_steps=2)
    method = DistillMethod(llama(32, len(CHAR)), CHAR, families, {"phone": "tiny", "laptop": "gpt"}, TEXT, 16,
                           settings, eval_text=eval_text)
    strategy = new_strategy(
        {"phone": method, "laptop": method}, clients_per_round=3,
        min_clients=min_clients, participation=Participation(make_selector("random", seed=0), load_catalog()),
        query_config={"population": "{}"},
        train_config={"local-steps": 1, "lr": 0.1, "seed": 0, "seq-len": 16, "batch-size": 2},
        wait_nodes_s=0.0,  # a FakeGrid's nodes are all there: a grid of fewer than clients_per_round need not wait
    )
    torch.manual_seed(0)
    return strategy, LlamaForCausalLM(method.config).state_dict()


def dm(strategy: FusionStrategy) -> DistillMethod:
    """The strategy's distillation method (every tier's)."""
    return strategy.run.methods["phone"]


def fed_eval(strategy: FusionStrategy) -> dict:
    """The fed_eval part of the round's report: the family scores and any federated evaluation."""
    return dict(strategy.report(1, None, {}).fed_eval)


def _reply(msg: Message, arrays: dict | None, error: str | None = None, n: int = 10) -> Message:
    if error:
        return Message(Error(code=1, reason=error), reply_to=msg)
    metrics = MetricRecord({"num-examples": n, "train_loss": 1.0, "train_s": 0.1})
    return Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics}), reply_to=msg)


def _shifted(msg: Message, by: float) -> dict:
    return {k: v + by for k, v in msg.content["arrays"].to_torch_state_dict().items()}


GRID = {11: "phone", 12: "laptop", 13: "phone"}


def test_each_node_gets_its_family_model_and_a_spec_to_rebuild_it(bpe):
    strategy, target = make(bpe)
    msgs = list(strategy.configure_train(2, ArrayRecord(target), ConfigRecord({}), FakeGrid(GRID)))
    assert sorted(m.metadata.dst_node_id for m in msgs) == [11, 12, 13]
    assert len({id(m.content) for m in msgs}) == 3  # a fresh RecordDict per node
    for m in msgs:
        spec, node = m.content["config"], m.metadata.dst_node_id
        family = {"phone": "tiny", "laptop": "gpt"}[GRID[node]]
        assert spec["role"] == "smallmodel" and spec["family"] == family and spec["server-round"] == 2
        state = m.content["arrays"].to_torch_state_dict()
        model = models.small_model(str(spec["model-config"]), state)  # the client can rebuild it
        assert type(model).__name__ == ("LlamaForCausalLM" if family == "tiny" else "GPT2LMHeadModel")
        row = strategy.run.round.rows[node]
        assert row.assignment == {"family": family} and row.params == sum(t.numel() for t in state.values())
    tok = {m.content["config"]["family"]: str(m.content["config"]["tokenizer-json"]) for m in msgs}
    assert tok["tiny"] == ""  # the target's tokenizer
    assert wrap_tokenizer(tok["gpt"]).get_vocab() == bpe.get_vocab()


def assert_fedavg(got: torch.Tensor, before: torch.Tensor, shifts: tuple[float, ...]) -> float:
    """``got`` is DistillMethod.fold's float32 FedAvg, at equal weights, of replies ``before + s`` (_shifted), against
    ``before + mean(s)`` in float64: each reply rounds the shift and the add (``u (|s| + |b + s|)``), the fold
    weights it (1), adds K of them (K - 1) and divides (1), relative to ``|b| + max |s|``: ``gamma_{K+3}`` of it.
    Returns the worst ratio of difference to bound."""
    b = before.double()
    bound = gamma(len(shifts) + 3, torch.float32) * (b.abs() + max(abs(s) for s in shifts))
    return assert_within(got, b + sum(shifts) / len(shifts), bound)


def test_families_are_averaged_and_distilled_into_the_target(bpe):
    strategy, target = make(bpe)
    before = {k: {n: t.clone() for n, t in s.items()} for k, s in dm(strategy).family_states.items()}
    msgs = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord(target), ConfigRecord({}), FakeGrid(GRID))}
    arrays, metrics = strategy.aggregate_train(1, [_reply(msgs[11], _shifted(msgs[11], 0.01)),
                                                   _reply(msgs[13], _shifted(msgs[13], 0.03)),
                                                   _reply(msgs[12], _shifted(msgs[12], -0.01))])
    assert metrics["clients_ok"] == 3 and strategy.run.round.coverage == 1.0 and not strategy.run.round.void
    for name, shifts in (("tiny", (0.01, 0.03)), ("gpt", (-0.01,))):  # FedAvg within each family
        for k, v in dm(strategy).family_states[name].items():
            assert_fedavg(v, before[name][k], shifts)
    new = arrays.to_torch_state_dict()
    assert new.keys() == target.keys() and any(not torch.equal(new[k], target[k]) for k in target)
    # the server's counted work: the target's training plus both teachers' forward passes
    tokens = 4 * 4 * 16
    target_params = sum(t.numel() for t in target.values())
    assert strategy.run.round.server_cost["tokens"] == tokens
    assert strategy.run.round.server_cost["flops"] > 6 * target_params * tokens
    assert metrics["server_flops"] == strategy.run.round.server_cost["flops"] and strategy.run.round.server_cost["seconds"] > 0


@pytest.mark.parametrize("teacher", ["feddf", "fedet"])
def test_back_distillation_moves_every_trained_family(bpe, teacher):
    strategy, target = make(bpe, back_distill=True, teacher=teacher, diversity_weight=0.1)
    msgs = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord(target), ConfigRecord({}), FakeGrid(GRID))}
    _, metrics = strategy.aggregate_train(1, [_reply(m, _shifted(m, 0.0)) for m in msgs.values()])
    # every reply returned the model it was sent, so FedAvg alone would leave the families as sent
    for name in ("tiny", "gpt"):
        sent = next(m for m in msgs.values() if m.content["config"]["family"] == name)
        sent_state = sent.content["arrays"].to_torch_state_dict()
        assert any(not torch.equal(dm(strategy).family_states[name][k], sent_state[k]) for k in sent_state)
        assert metrics[f"back_kd_{name}"] >= 0


def test_untrained_families_neither_teach_nor_learn(bpe):
    strategy, target = make(bpe, back_distill=True)
    gpt_before = {k: v.clone() for k, v in dm(strategy).family_states["gpt"].items()}
    grid = FakeGrid({11: "phone", 13: "phone"})
    msgs = list(strategy.configure_train(1, ArrayRecord(target), ConfigRecord({}), grid))
    _, metrics = strategy.aggregate_train(1, [_reply(m, _shifted(m, 0.0)) for m in msgs])
    assert dm(strategy).trained == {"tiny"} and "back_kd_tiny" in metrics and "back_kd_gpt" not in metrics
    for k, v in dm(strategy).family_states["gpt"].items():
        assert torch.equal(v, gpt_before[k])


def test_bad_replies_are_rejected_and_good_ones_fold_in(bpe):
    strategy, target = make(bpe)
    before = {k: v.clone() for k, v in dm(strategy).family_states["tiny"].items()}
    msgs = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord(target), ConfigRecord({}), FakeGrid(GRID))}
    nan = _shifted(msgs[13], 0.0)
    nan["model.norm.weight"][0] = float("nan")
    wrong_shape = _shifted(msgs[12], 0.0)
    wrong_shape["transformer.wte.weight"] = torch.zeros(3, 3)
    _, metrics = strategy.aggregate_train(1, [_reply(msgs[11], _shifted(msgs[11], 0.5)), _reply(msgs[13], nan),
                                              _reply(msgs[12], wrong_shape)])
    status = {n: c.status for n, c in strategy.run.round.rows.items()}
    assert status == {11: "ok", 12: "rejected", 13: "rejected"} and metrics["clients_ok"] == 1
    assert "NaN" in strategy.run.round.rows[13].error and "shape" in strategy.run.round.rows[12].error
    for k, v in dm(strategy).family_states["tiny"].items():  # only node 11's update averaged in
        assert_fedavg(v, before[k], (0.5,))
    assert dm(strategy).trained == {"tiny"}


def test_errors_absurd_norms_and_missing_replies(bpe):
    strategy, target = make(bpe, min_clients=2)
    msgs = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord(target), ConfigRecord({}), FakeGrid(GRID))}
    before = {k: {n: t.clone() for n, t in s.items()} for k, s in dm(strategy).family_states.items()}
    huge = {k: v * 1000 for k, v in msgs[11].content["arrays"].to_torch_state_dict().items()}
    arrays, metrics = strategy.aggregate_train(1, [_reply(msgs[11], huge),
                                                   _reply(msgs[12], None, error="boom\nRuntimeError: device crashed")])
    status = {n: c.status for n, c in strategy.run.round.rows.items()}
    assert status == {11: "rejected", 12: "failed", 13: "timeout"}
    assert "norm" in strategy.run.round.rows[11].error and strategy.run.round.rows[12].error == "RuntimeError: device crashed"
    # a void round: the target (no arrays returned) and every family stay as they were, and nothing is charged
    assert arrays is None and metrics["clients_ok"] == 0 and strategy.run.round.void
    assert strategy.run.round.server_cost["flops"] == 0.0 and not dm(strategy).trained
    for name, state in dm(strategy).family_states.items():
        assert all(torch.equal(v, before[name][k]) for k, v in state.items())


def test_checkpoint_state_restores_families_and_sampling(bpe):
    strategy, target = make(bpe)
    grid = FakeGrid({11: "phone", 12: "laptop", 13: "phone", 14: "laptop", 15: "phone", 16: "phone"})
    msgs = list(strategy.configure_train(1, ArrayRecord(target), ConfigRecord({}), grid))
    arrays, _ = strategy.aggregate_train(1, [_reply(m, _shifted(m, 0.1)) for m in msgs])
    saved = json.loads(json.dumps(strategy.run.state_dict()))  # what a checkpoint writes and reads back
    resumed, _ = make(bpe)
    resumed.run.load_state_dict(saved, rounds_done=1)
    assert dm(resumed).trained == dm(strategy).trained and dm(strategy).trained
    for name, state in dm(strategy).family_states.items():
        assert all(torch.equal(dm(resumed).family_states[name][k], v) for k, v in state.items())
    # both continue with the same sample, round number and family models
    a = [list(strategy.configure_train(r, arrays, ConfigRecord({}), grid)) for r in (2, 3)]
    b = [list(resumed.configure_train(r, arrays, ConfigRecord({}), grid)) for r in (1, 2)]
    a, b = a[0] + a[1], b[0] + b[1]
    assert [(m.metadata.dst_node_id, m.content["config"]["server-round"]) for m in a] == \
        [(m.metadata.dst_node_id, m.content["config"]["server-round"]) for m in b]
    for x, y in zip(a, b):
        sx, sy = x.content["arrays"].to_torch_state_dict(), y.content["arrays"].to_torch_state_dict()
        assert all(torch.equal(sx[k], sy[k]) for k in sx)


def test_unknown_family_names_the_tier(bpe):
    with pytest.raises(ValueError, match="tier_family.laptop: unknown family 'huge'"):
        DistillMethod(llama(32, len(CHAR)), CHAR, {"tiny": Family(llama(16, len(CHAR)))},
                      {"phone": "tiny", "laptop": "huge"}, TEXT, 16, DistillConfig())
    with pytest.raises(ValueError, match="family 'tiny': vocab_size 7"):
        DistillMethod(llama(32, len(CHAR)), CHAR, {"tiny": Family(llama(16, 7))}, {"phone": "tiny"}, TEXT, 16,
                      DistillConfig())
    with pytest.raises(ValueError, match="teacher 'mean' is not one of feddf, fedet"):
        DistillMethod(llama(32, len(CHAR)), CHAR, {"tiny": Family(llama(16, len(CHAR)))}, {"phone": "tiny"}, TEXT, 16,
                      DistillConfig(teacher="mean"))


def test_family_configs_and_tokenizers_build_the_models_they_name(bpe):
    for model_type, cls in (("llama", "LlamaForCausalLM"), ("gpt2", "GPT2LMHeadModel")):
        config = models.family_config(model_type, bpe, hidden_size=16, num_layers=1, num_heads=2)
        model = models.small_model(json.dumps(config.to_dict()))
        assert type(model).__name__ == cls and model.get_output_embeddings().weight.shape[0] == len(bpe)
    with pytest.raises(ValueError, match="model_type 'rnn'"):
        models.family_config("rnn", bpe, 16, 1, 2)
    with pytest.raises(ValueError, match="num_heads 3 does not divide hidden_size 16"):
        models.family_config("llama", bpe, 16, 1, 3)
    assert family_tokenizer("target") is None and len(family_tokenizer("char")) == len(CHAR)
    assert len(family_tokenizer("bpe", TEXT, 280)) == 280
    with pytest.raises(ValueError, match="family tokenizer 'word'"):
        family_tokenizer("word")


@pytest.mark.parametrize("family", ["tiny", "gpt"])
def test_client_role_trains_and_evaluates_its_family_model(bpe, family, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    data = json.dumps({"data": asdict(DataConfig(source="text", path=str(corpus))), "num_clients": 2, "seed": 0,
                       "tokenizer": None}, sort_keys=True)
    strategy, target = make(bpe)
    msg = next(m for m in strategy.configure_train(1, ArrayRecord(target), ConfigRecord({}), FakeGrid(GRID))
               if m.content["config"]["family"] == family)
    spec = ConfigRecord({**dict(msg.content["config"]), "data-spec": data, "threads": 1, "weight-decay": 0.0, "optimizer": "adamw",
                         "local-steps": 2, "lr": 1e-2, "checkpoint": False})
    sent = msg.content["arrays"].to_torch_state_dict()
    state, metrics = smallmodel.train(sent, spec, partition=1)
    assert state.keys() == sent.keys() and any(not torch.equal(state[k], sent[k]) for k in sent)
    assert metrics["num-examples"] > 0 and metrics["train_tokens"] == 2 * 2 * 16
    scores = smallmodel.evaluate(state, spec, partition=1)
    assert scores["num-examples"] > 0 and 0 <= scores["eval_acc"] <= 1


HELD_OUT = ("But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n") * 6


def _nats_per_char(model, tokenizer, text: str, seq_len: int) -> float:
    """Independent reference: summed next-token cross-entropy over non-overlapping windows, divided by the
    length of the text the predicted tokens decode to."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    nats, chars = 0.0, 0
    for i in range(0, len(ids) - seq_len, seq_len + 1):
        window = torch.tensor(ids[i : i + seq_len + 1])
        if len(window) < seq_len + 1:
            break
        with torch.no_grad():
            logits = model(input_ids=window[None, :-1]).logits[0].float()
        nats += float(torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum"))
        chars += sum(len(tokenizer.decode([int(t)])) for t in window[1:])
    return nats / chars


def test_eval_sets_count_the_characters_their_labels_span(bpe):
    char = family_eval_set(CHAR, HELD_OUT, 16)
    assert char.char_level and char.chars == char.windows[:, 1:].numel()
    subword = family_eval_set(bpe, HELD_OUT, 16)
    assert not subword.char_level and subword.chars > subword.windows[:, 1:].numel()
    assert subword.chars == sum(len(bpe.decode(row[1:].tolist())) for row in subword.windows)  # ASCII: exact
    with pytest.raises(ValueError, match="seq_len=500"):
        family_eval_set(CHAR, "too short", 500)


def test_family_scores_are_per_character_for_char_and_bpe_models(bpe):
    strategy, _ = make(bpe)
    torch.manual_seed(1)
    for name, tok, char_level in (("tiny", CHAR, True), ("gpt", bpe, False)):
        model = copy.deepcopy(dm(strategy).family_model(name)).double()  # float64 logits, batched or not alike
        data = family_eval_set(tok, HELD_OUT, 16)
        scores = score_per_char(model, data)
        # both round the logits to float32 and take the cross-entropy there: each token's within log_softmax's
        # error (fp_bounds) and 2 u max|z| of the exact, the sums over the n tokens within gamma_n
        with torch.no_grad():
            z = model(input_ids=data.windows[:, :-1]).logits.reshape(-1, model.config.vocab_size)
        y = data.windows[:, 1:].reshape(-1)
        per_token = torch.nn.functional.cross_entropy(z, y, reduction="none")
        each = log_softmax_bound(z).gather(-1, y[:, None])[:, 0] + 2 * unit_roundoff(torch.float32) * z.abs().amax(-1)
        bound = 2 * (float(each.sum()) + gamma(len(y), torch.float32) * float(per_token.abs().sum())) / data.chars
        assert abs(scores["loss"] - _nats_per_char(model, tok, HELD_OUT, 16)) <= bound
        assert scores["ppl"] == pytest.approx(math.exp(scores["loss"]))
        assert ("acc" in scores) == char_level and ("token_acc" in scores) != char_level  # BPE: next-token accuracy
        assert 0 <= scores.get("acc", scores.get("token_acc")) <= 1
    # an untrained model is near uniform over its vocabulary per token: per char that is log(V) for the
    # character model and log(V) x tokens / chars for the BPE model
    char, subword = family_eval_set(CHAR, HELD_OUT, 16), family_eval_set(bpe, HELD_OUT, 16)
    assert score_per_char(dm(strategy).family_model("tiny"), char)["loss"] == pytest.approx(math.log(len(CHAR)), rel=0.1)
    per_char = math.log(len(bpe)) * subword.windows[:, 1:].numel() / subword.chars
    assert score_per_char(dm(strategy).family_model("gpt"), subword)["loss"] == pytest.approx(per_char, rel=0.1)


def test_every_trained_family_is_scored_each_round_and_void_rounds_keep_the_scores(bpe):
    strategy, target = make(bpe, back_distill=True, eval_text=HELD_OUT)
    msgs = list(strategy.configure_train(1, ArrayRecord(target), ConfigRecord({}), FakeGrid({11: "phone", 13: "phone"})))
    strategy.aggregate_train(1, [_reply(m, _shifted(m, 0.01)) for m in msgs])
    tiny = score_per_char(dm(strategy).family_model("tiny"), family_eval_set(CHAR, HELD_OUT, 16))
    assert fed_eval(strategy) == {"family_tiny_loss": tiny["loss"], "family_tiny_ppl": tiny["ppl"],
                                      "family_tiny_acc": tiny["acc"]}  # the untrained gpt family is not scored
    msgs = list(strategy.configure_train(2, ArrayRecord(target), ConfigRecord({}), FakeGrid(GRID)))
    strategy.aggregate_train(2, [_reply(m, _shifted(m, 0.01)) for m in msgs])
    scores = fed_eval(strategy)
    assert set(scores) == {"family_tiny_loss", "family_tiny_ppl", "family_tiny_acc", "family_gpt_loss", "family_gpt_ppl",
                           "family_gpt_token_acc"}
    assert scores["family_tiny_loss"] != tiny["loss"]  # re-scored after this round's FedAvg and back-distillation
    gpt = score_per_char(dm(strategy).family_model("gpt"), family_eval_set(bpe, HELD_OUT, 16))
    assert scores["family_gpt_loss"] == gpt["loss"]
    # the target's federated evaluation is merged, not substituted
    reply = Message(RecordDict({"metrics": MetricRecord({"num-examples": 4, "eval_loss": 2.0, "eval_acc": 0.5})}),
                    reply_to=msgs[0])
    strategy.aggregate_evaluate(2, [reply])
    assert fed_eval(strategy) == {**scores, "fed_eval_loss": 2.0, "fed_eval_acc": 0.5}
    # a void round changes no family, and reports the same scores
    msgs = list(strategy.configure_train(3, ArrayRecord(target), ConfigRecord({}), FakeGrid(GRID)))
    strategy.aggregate_train(3, [_reply(m, None, error="boom") for m in msgs])
    assert strategy.run.round.void and fed_eval(strategy) == scores
    resumed, _ = make(bpe, eval_text=HELD_OUT)  # a resumed run reports them too until the next round scores
    resumed.run.load_state_dict(json.loads(json.dumps(strategy.run.state_dict())), rounds_done=3)
    assert dm(resumed).metrics() == scores


def test_without_eval_text_nothing_is_scored(bpe):
    strategy, target = make(bpe)
    msgs = list(strategy.configure_train(1, ArrayRecord(target), ConfigRecord({}), FakeGrid(GRID)))
    strategy.aggregate_train(1, [_reply(m, _shifted(m, 0.0)) for m in msgs])
    assert fed_eval(strategy) == {}
