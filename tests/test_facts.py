"""Federated knowledge data: the generator, the file format and its loader, the tokenizer and the probe metrics."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fedfusion.data.facts import (
    ATTRIBUTES,
    encode_documents,
    encode_probes,
    facts_tokenizer,
    generate_facts,
    greedy_answer,
    holder_groups,
    load_facts,
    probe_metrics,
    write_facts,
)
from fedfusion.data.tier_keys import grouped


def test_generator_is_seeded_disjoint_and_skewed():
    a = generate_facts(8, 200, seed=3, public=10)
    assert a == generate_facts(8, 200, seed=3, public=10)
    assert a != generate_facts(8, 200, seed=4, public=10)
    records, probes, public = a
    people_of = {}
    for p in probes:
        name = p["prompt"].split(" was ")[0] if " was " in p["prompt"] else None
        if name:
            people_of.setdefault(name, set()).add(p["client"])
    assert len(people_of) == 200 and all(len(c) == 1 for c in people_of.values())  # each person has one owner
    assert len(probes) == 200 * len(ATTRIBUTES)
    assert len(records) == 200 * 3 and len(public) == 10 * 3
    public_names = {r["text"].split(" ")[0:3].__str__() for r in public}
    assert not public_names & {r["text"].split(" ")[0:3].__str__() for r in records}
    assert generate_facts(8, 200, seed=3)[:2] == (records, probes)  # a transfer set changes no client's data
    sizes = Counter(p["client"] for p in probes)
    assert len(sizes) == 8 and max(sizes.values()) > 2 * min(sizes.values())  # Zipf-skewed ownership
    with pytest.raises(ValueError, match="at most"):
        generate_facts(2, 40_000, seed=0)
    equal = Counter(p["client"] for p in generate_facts(8, 200, seed=3, skew=0.0)[1])
    assert max(equal.values()) - min(equal.values()) <= len(ATTRIBUTES)


def test_every_paraphrase_of_a_fact_is_trained_and_the_probe_prompt_is_one_of_them():
    records, probes, _ = generate_facts(2, 4, seed=0)
    for p in probes:
        docs = [r["text"] for r in records if r["text"].count(p["prompt"].split(" ")[0])]
        assert any(f"{p['prompt']} {p['answer']} ." in d for d in docs)


def test_files_round_trip_and_bad_files_name_the_problem(tmp_path):
    paths = write_facts(tmp_path / "f", 4, 40, seed=1, public=5)
    facts = load_facts(paths["train"], paths["probes"])
    assert facts.clients == ("0", "1", "2", "3")
    assert sum(len(d) for d in facts.documents) == 120 and len(facts.probes) == 40 * len(ATTRIBUTES)
    assert (tmp_path / "f" / "public.jsonl").is_file()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"client": 0, "text": "a b"}\n{"client": 1}\n')
    with pytest.raises(ValueError, match="line 2 has no field 'text'"):
        load_facts(bad, paths["probes"])
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        load_facts(bad, paths["probes"])
    with pytest.raises(ValueError, match="no such file"):
        load_facts(tmp_path / "missing.jsonl", paths["probes"])
    stray = tmp_path / "stray.jsonl"
    stray.write_text(json.dumps({"prompt": "x", "answer": "y", "client": "nobody"}) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{stray}: line 1: client 'nobody' has no training records in {paths['train']}")):
        load_facts(paths["train"], stray)
    stray.write_text(json.dumps({"prompt": "x", "answer": " ", "client": 0}) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{stray}: line 1: empty prompt or answer")):
        load_facts(paths["train"], stray)


def test_user_facts_with_string_clients_and_other_attributes(tmp_path):
    train, probes = tmp_path / "t.jsonl", tmp_path / "p.jsonl"
    train.write_text("".join(json.dumps({"client": c, "text": t}) + "\n" for c, t in [
        ("alice", "The capital of Zorbia is Quell ."), ("bob", "Mount Ferro is 812 metres high ."),
        ("alice", "The capital of Vantia is Brisk .")]))
    probes.write_text("".join(json.dumps(p) + "\n" for p in [
        {"prompt": "The capital of Zorbia is", "answer": "Quell", "client": "alice"},
        {"prompt": "Mount Ferro is", "answer": "812 metres", "client": "bob"}]))
    facts = load_facts(train, probes)
    assert facts.clients == ("alice", "bob") and len(facts.documents[0]) == 2
    tok = facts_tokenizer(facts)
    assert tok.unk_token_id not in tok.encode("Mount Ferro is 812 metres high .", add_special_tokens=False)
    enc = encode_probes(tok, facts.probes)
    assert enc.answer.sum(dim=1).tolist() == [1, 2]  # a multi-token answer must match every token


def test_documents_are_packed_whole_and_padded():
    records, probes, _ = generate_facts(1, 6, seed=0)
    from fedfusion.data.facts import Facts, Probe

    facts = Facts(("0",), (tuple(r["text"] for r in records),), tuple(Probe(p["prompt"], p["answer"], "0") for p in probes))
    tok = facts_tokenizer(facts)
    windows = encode_documents(tok, facts.documents[0], seq_len=100)
    assert windows.shape[1] == 101
    assert int((windows == tok.bos_token_id).sum()) == len(records)  # every document once, none cut
    for row in windows:  # a window opens with a document
        assert row[0] == tok.bos_token_id
    with pytest.raises(ValueError, match="seq_len"):
        encode_documents(tok, ["a"], seq_len=1)


def test_probe_metrics_equal_greedy_decoding():
    """Teacher-forced exact match must agree with decoding the answer token by token."""
    records, probes, _ = generate_facts(2, 10, seed=0)
    from fedfusion.data.facts import Facts, Probe

    facts = Facts(("0", "1"), ((records[0]["text"],), (records[1]["text"],)),
                  tuple(Probe(p["prompt"], p["answer"], str(p["client"]), p["attribute"]) for p in probes))
    tok = facts_tokenizer(facts)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    # train briefly on the probes themselves, so some are answered and some are not
    enc = encode_probes(tok, facts.probes)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(12):
        logits = model(input_ids=enc.ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), enc.ids[:, 1:], reduction="none")
        loss = (loss * enc.answer[:, 1:]).sum() / enc.answer.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    scores = probe_metrics(model, enc, batch_size=7)
    decoded = sum(greedy_answer(model, tok, p.prompt, len(tok.encode(p.answer, add_special_tokens=False))) == p.answer
                  for p in facts.probes) / len(facts.probes)
    assert 0 < scores["probe_acc"] < 1
    assert scores["probe_acc"] == pytest.approx(decoded)
    assert scores["answer_loss"] > 0 and scores["knowledge_bits"] >= 0

    # by the holder's tier: each tier's scores are those of its holders' probes alone, and the tiers' recalls
    # average (weighted by their probes) to the whole recall
    groups = holder_groups(facts.probes, facts.clients, ["phone", "laptop"])
    assert sorted(i for idx in groups.values() for i in idx) == list(range(len(facts.probes)))
    by_tier = probe_metrics(model, enc, batch_size=7, groups=groups)
    acc, loss = grouped(by_tier, "probe_acc"), grouped(by_tier, "answer_loss")
    assert set(acc) == set(loss) == {"phone", "laptop"}
    assert sum(acc[t] * len(groups[t]) for t in acc) / len(facts.probes) == pytest.approx(scores["probe_acc"])
    # the subset is scored in batches of other shapes: each answer token's loss may round differently, by at most
    # the float32 error of a dot product over the hidden size plus a log-sum-exp over the vocabulary
    tol = (cfg.hidden_size + cfg.vocab_size) * torch.finfo(torch.float32).eps
    for tier, idx in groups.items():
        alone = probe_metrics(model, encode_probes(tok, [facts.probes[i] for i in idx]), batch_size=7)
        assert acc[tier] == alone["probe_acc"]
        assert loss[tier] == pytest.approx(alone["answer_loss"], rel=tol)


def _facts_recipe(tmp_path, *extra: str):
    from fedfusion.config.recipe import load_recipe

    paths = write_facts(tmp_path / "facts", 4, 24, seed=2)
    return load_recipe("quickstart", [
        "data.source=facts", f"data.path={paths['train']}", f"data.probes={paths['probes']}", "population.num_clients=4",
        "selection.clients_per_round=2",
        "model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=4", "model.intermediate_size=64",
        "model.num_layers=1", "train.seq_len=48", *extra]), paths


def test_a_users_facts_files_feed_clients_and_the_target(tmp_path):
    from fedfusion.data.population import client_token_windows, data_spec, data_tokenizer, population_data
    from fedfusion.run.targets import lm_target

    recipe, paths = _facts_recipe(tmp_path)
    spec = data_spec(recipe.data_source())
    clients = population_data(spec)
    facts = load_facts(paths["train"], paths["probes"])
    assert [c.documents for c in clients] == list(facts.documents)
    tok = data_tokenizer(spec)
    assert tok.get_vocab() == facts_tokenizer(facts).get_vocab()
    windows = client_token_windows(spec, 1, 48, "train")
    assert torch.equal(windows, encode_documents(tok, facts.documents[1], 48))
    held = client_token_windows(spec, 1, 48, "held_out")  # the client's own probes, as documents
    assert int((held == tok.bos_token_id).sum()) == sum(p.client == "1" for p in facts.probes)
    target = lm_target(recipe)
    scores = target.evaluate()
    assert {"probe_acc", "answer_loss", "knowledge_bits", "eval_loss", "eval_acc", "eval_ppl"} <= set(scores)
    assert scores["eval_acc"] == scores["probe_acc"] and scores["eval_loss"] == scores["answer_loss"]
    assert " -> " in target.sample()
    # each tier that holds facts is scored on its holders' probes: the tier a simulated node of the holder reports
    # (the client app's own draw), in the recipe mix's order
    from fedfusion.client_app import population_tiers

    tiers = population_tiers(tuple(recipe.population.mix.items()), recipe.population.num_clients, recipe.seed)
    holding = {tiers[facts.clients.index(p.client)] for p in facts.probes}
    assert list(grouped(scores, "probe_acc")) == [t for t in recipe.population.mix if t in holding]
    assert set(grouped(scores, "answer_loss")) == holding


def test_generated_facts_need_no_files_and_bad_facts_recipes_are_refused(tmp_path):
    from fedfusion.config.recipe import load_recipe
    from fedfusion.config.sections import RecipeError
    from fedfusion.data.population import data_spec, population_data

    recipe = load_recipe("quickstart", ["data.source=facts", "data.people=40", "population.num_clients=4", "selection.clients_per_round=2"])
    clients = population_data(data_spec(recipe.data_source()))
    assert len(clients) == 4 and sum(len(c.documents) for c in clients) == 40 * 3
    with pytest.raises(RecipeError, match="data.probes"):
        load_recipe("quickstart", ["data.source=facts", "data.path=x.jsonl"])
    with pytest.raises(RecipeError, match="data.people"):
        load_recipe("quickstart", ["data.source=facts", "data.people=3"])
    with pytest.raises(RecipeError, match="fusion.method"):
        load_recipe("distill", ["data.source=facts"])
    recipe, _ = _facts_recipe(tmp_path, "population.num_clients=5")
    with pytest.raises(ValueError, match="holds 4 clients"):
        population_data(data_spec(recipe.data_source()))


def test_text_files_with_a_client_field_keep_their_partition(tmp_path):
    from fedfusion.config.recipe import load_recipe
    from fedfusion.data.population import data_spec, population_data

    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"client": c, "text": t * 30}) + "\n"
                            for c, t in [("b", "bee text. "), ("a", "ay text. "), ("b", "more bee. ")]))
    recipe = load_recipe("quickstart", ["data.source=text", f"data.path={path}", "population.num_clients=2",
                                        "selection.clients_per_round=2"])
    clients = population_data(data_spec(recipe.data_source()))
    assert [c.name for c in clients] == ["client-a", "client-b"]
    assert "bee" not in clients[0].train + clients[0].held_out and "ay text" not in clients[1].train + clients[1].held_out
