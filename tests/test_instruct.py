"""Instruction pairs: corpus splits, chat formatting with response-only labels, training and evaluation."""

from __future__ import annotations

import json
from importlib.util import find_spec

import pytest
import torch
from fp_bounds import gamma, log_softmax_bound, unit_roundoff
from transformers import LlamaConfig, LlamaForCausalLM

from fedfusion.data.instruct import instruct_clients, pooled_held_out
from fedfusion.data.pairs import Pair, load_chatterbot, partition_pairs, split_held_out
from fedfusion.data.text import build_char_tokenizer
from fedfusion.train.instruct import IGNORE, RESPONSE, encode_pair, encode_pairs, evaluate_instruct, generate_responses
from fedfusion.train.loop import train_steps

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<eos>\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


def chat_tokenizer():
    """The 100-id character tokenizer with a small chat template (<eos> is its end-of-turn token)."""
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def corpus(sizes: dict[str, int]) -> dict[str, tuple[Pair, ...]]:
    return {c: tuple(Pair(f"{c} q{i}?", f"{c} a{i}.", c) for i in range(n)) for c, n in sizes.items()}


def test_chat_pairs_are_labelled_on_the_response_and_end_of_turn_only():
    tok = chat_tokenizer()
    ids, labels = encode_pair(tok, Pair("Hi there?", "Hello!"), max_len=200)
    assert tok.decode(ids) == "[user] Hi there?<eos>\n[assistant] Hello!<eos>\n"
    start = labels.count(IGNORE)
    assert labels[:start] == [IGNORE] * start and IGNORE not in labels[start:]
    assert labels[start:] == ids[start:]
    assert tok.decode(ids[:start]) == "[user] Hi there?<eos>\n[assistant] "
    assert tok.decode(labels[start:]) == "Hello!<eos>\n"


def test_without_a_chat_template_the_documented_fallback_is_used():
    tok = build_char_tokenizer()
    ids, labels = encode_pair(tok, Pair("Why?", "Because."), max_len=200)
    start = labels.count(IGNORE)
    assert tok.decode(ids[:start]) == "Question: Why?\nAnswer: "
    assert ids[start:] == tok.encode("Because.", add_special_tokens=False) + [tok.eos_token_id]


def test_truncation_cuts_on_the_right_and_drops_pairs_without_a_response_token():
    tok = chat_tokenizer()
    prompt_len = len("[user] abc?<eos>\n[assistant] ") - 4  # <eos> is one token
    ids, labels = encode_pair(tok, Pair("abc?", "a long answer"), max_len=prompt_len + 3)
    assert len(ids) == prompt_len + 3 and tok.decode(labels[-3:]) == "a l"
    assert encode_pair(tok, Pair("abc?", "x"), max_len=prompt_len) is None
    data = encode_pairs(tok, [Pair("abc?", "yes"), Pair("a much longer question here?", "no")], max_len=prompt_len + 2)
    assert len(data) == 1 and data.dropped == 1
    with pytest.raises(ValueError, match="no pair keeps a response token"):
        encode_pairs(tok, [Pair("a much longer question here?", "no")], max_len=prompt_len)


def test_padding_is_masked_and_rows_are_trimmed_to_the_batch():
    tok = chat_tokenizer()
    data = encode_pairs(tok, [Pair("a?", "b"), Pair("a longer one?", "a longer answer")], max_len=200)
    short = data.attention_mask[0].sum()
    assert (data.labels[0, short:] == IGNORE).all() and (data.input_ids[0, short:] == tok.pad_token_id).all()
    ids, labels, mask = data.rows(torch.tensor([0, 0]))
    assert ids.shape[1] == short and mask.all()


def test_held_out_split_is_disjoint_seeded_and_keeps_every_category():
    pairs = corpus({"a": 20, "b": 3, "c": 1})
    train, held = split_held_out(pairs, 0.1, seed=1)
    for c in pairs:
        assert sorted(train[c] + held[c], key=str) == sorted(pairs[c], key=str)
        assert not set(train[c]) & set(held[c])
    assert [len(held[c]) for c in "abc"] == [2, 1, 0] and len(train["c"]) == 1
    assert split_held_out(pairs, 0.1, seed=1) == (train, held)
    assert split_held_out(pairs, 0.1, seed=2) != (train, held)
    with pytest.raises(ValueError, match="held_out"):
        split_held_out(pairs, 1.0, seed=1)


def test_category_split_is_non_iid_and_iid_split_mixes():
    train, held = split_held_out(corpus({"a": 30, "b": 20, "c": 10}), 0.1, seed=0)
    few = partition_pairs(train, held, 2, "category", seed=0)
    assert [c.categories for c in few] == [("a", "c"), ("b",)]
    assert {p.category for p in few[1].train} == {"b"} and {p.category for p in few[1].held_out} == {"b"}
    many = partition_pairs(train, held, 5, "category", seed=0)  # a and b are shared by two clients each
    assert [c.categories for c in many] == [("a",), ("b",), ("c",), ("a",), ("b",)]
    assert not set(many[0].train) & set(many[3].train)
    assert set(many[0].train) | set(many[3].train) == set(train["a"])
    iid = partition_pairs(train, held, 3, "iid", seed=0)
    assert sum(len(c.train) for c in iid) == sum(len(v) for v in train.values())
    assert all({p.category for p in c.train} == {"a", "b", "c"} for c in iid)
    with pytest.raises(ValueError, match="gets no training pair"):
        partition_pairs(*split_held_out(corpus({"a": 2}), 0.5, 0), 2, "category", seed=0)
    with pytest.raises(ValueError, match="split must be one of"):
        partition_pairs(train, held, 2, "dirichlet", seed=0)


@pytest.mark.skipif(find_spec("chatterbot_corpus") is None, reason="chatterbot-corpus is not installed")
def test_the_chatterbot_corpus_gives_categories_of_pairs_and_a_pooled_held_out_set():
    corpus_ = load_chatterbot()
    assert len(corpus_) == 21 and Pair("What is AI?", corpus_["ai"][0].response, "ai") == corpus_["ai"][0]
    # repeated pairs count once (tech_support is 10 pairs repeated); no malformed one-character pairs
    assert len(corpus_["tech_support"]) == 10 and all(len(set(v)) == len(v) for v in corpus_.values())
    assert sum(len(v) for v in corpus_.values()) == 1177  # chatterbot-corpus==1.3.3, English
    assert not [p for v in corpus_.values() for p in v if len(p.prompt) < 2]
    spec = json.dumps({"source": "chatterbot", "num_clients": 21, "split": "category", "held_out": 0.1, "seed": 0})
    clients = instruct_clients(spec)
    assert len(clients) == 21 and len({c.categories for c in clients}) == 21
    pooled = pooled_held_out(spec)
    assert not set(pooled) & {p for c in clients for p in c.train}
    assert len(pooled_held_out(spec, 50)) == 50
    with pytest.raises(ValueError, match="must be 'chatterbot'"):
        instruct_clients(json.dumps({"source": "shakespeare", "num_clients": 2}))


def tiny_lm(vocab: int = 100) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=128))


def test_evaluation_scores_response_tokens_only():
    tok = chat_tokenizer()
    data = encode_pairs(tok, [Pair("a?", "yes"), Pair("why not?", "no idea")], max_len=100)
    model = tiny_lm().double()  # float64 logits: one row at a time and padded in a batch agree to its rounding
    got = evaluate_instruct(model, data, batch_size=1)
    with torch.no_grad():
        logits = model(input_ids=data.input_ids, attention_mask=data.attention_mask).logits[:, :-1]
    target = data.labels[:, 1:]
    scored = target != IGNORE
    assert int(scored.sum()) == len("yes<eos>\n") - 4 + len("no idea<eos>\n") - 4
    z, y = logits[scored], target[scored]
    want = torch.nn.functional.cross_entropy(z, y)
    # evaluate_instruct rounds the logits to float32 (moving each token's loss by at most 2 u max|z|) and takes the
    # cross-entropy there (log_softmax's error, fp_bounds) and its sum over the n tokens (gamma_n)
    per_token = torch.nn.functional.cross_entropy(z, y, reduction="none")
    u = unit_roundoff(torch.float32)
    each = log_softmax_bound(z).gather(-1, y[:, None])[:, 0] + 2 * u * z.abs().amax(-1)
    bound = float(each.mean()) + gamma(len(y), torch.float32) * float(per_token.abs().mean())
    assert abs(got["eval_loss"] - want.item()) <= bound


def test_training_lowers_the_response_loss_and_only_touches_trainable_parameters():
    tok = chat_tokenizer()
    data = encode_pairs(tok, [Pair(f"q{i}?", "same answer") for i in range(8)], max_len=100)
    model = tiny_lm()
    model.model.embed_tokens.weight.requires_grad_(False)
    frozen = model.model.embed_tokens.weight.clone()
    before = evaluate_instruct(model, data)["eval_loss"]
    stats = train_steps(model, data, steps=20, lr=1e-2, batch_size=4, seed=0, loss=RESPONSE)
    assert evaluate_instruct(model, data)["eval_loss"] < before - 1.0
    assert torch.equal(model.model.embed_tokens.weight, frozen)
    assert stats.tokens > 0 and stats.seconds > 0 and stats.metrics()["train_tokens"] == stats.tokens
    answer = generate_responses(model, tok, ["q1?"], max_new_tokens=11)[0]
    assert answer.startswith("same")
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        train_steps(model, data, steps=1, lr=1e-2, batch_size=1, seed=0, loss=RESPONSE)
