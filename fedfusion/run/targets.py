"""The server's side of the target model: build it, load a round's arrays into it, score it, save it.

Sub-model and distillation fusion carry the target's full state between rounds and score it on pooled
held-out text (loss per character, perplexity, next-character accuracy). LoRA fusion carries only the
global low-rank update on a frozen pretrained base and scores response tokens of held-out instruction
pairs. Both expose the same :class:`Target`, so the run loop, the ledger and checkpoints treat them alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from flwr.app import ArrayRecord
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedfusion.analysis.report import CHAR_METRICS, FACTS_METRICS, RESPONSE_METRICS, TOKEN_METRICS
from fedfusion.config.recipe import Recipe
from fedfusion.data.facts import Probe, encode_probes, greedy_answer, probe_metrics
from fedfusion.data.instruct import pooled_held_out as pooled_pairs
from fedfusion.data.population import (
    data_spec,
    data_tokenizer,
    facts_by_tier,
    lora_data_spec,
    pooled_held_out,
)
from fedfusion.data.text import encode_text, general_text, lm_windows
from fedfusion.fusion.lora.config import LoRAConfig
from fedfusion.fusion.lora.method import adapted_modules, apply_global, save_adapter, save_merged, snapshot
from fedfusion.models.build import build_target, count_params, generate
from fedfusion.models.pretrained import load_base, load_base_tokenizer, resolve_base
from fedfusion.train import instruct
from fedfusion.train.loop import evaluate_lm


@dataclass
class Target:
    """The model being trained, as the server sees it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    # the state round 1 starts from, read from the model when called (before round 1's target is loaded into it):
    # a fresh copy each call, so no second copy of the target is held beside the model for the run
    initial: Callable[[], dict[str, torch.Tensor]]
    load: Callable[[ArrayRecord], None]  # put a round's arrays into ``model``
    evaluate: Callable[[], dict[str, float]]  # eval_loss, eval_ppl, eval_acc
    save: Callable[[Path, ArrayRecord], None]  # the run directory's model/ (and adapter/)
    sample: Callable[[], str]  # text for the report
    params: int
    metric_names: dict[str, str]  # what evaluate's eval_loss, eval_ppl and eval_acc measure (fedfusion.analysis.report)


def sample_text(model: torch.nn.Module, tokenizer, prompt: str = "KING:\n", chars: int = 200, seed: int = 0) -> str:
    """A seeded top-k sample from the target, so the report shows what it learned to write."""
    torch.manual_seed(seed)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    out = generate(model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=chars, do_sample=True, top_k=10,
                   pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0])


def lm_target(recipe: Recipe) -> Target:
    """A causal LM trained whole (sub-model and distillation fusion), scored on pooled held-out text; for
    data.source=facts, on every probe of every client (see :func:`facts_evaluator`)."""
    spec = data_spec(recipe.data_source())
    tokenizer = data_tokenizer(spec)
    model = build_target(recipe.model, tokenizer, recipe.seed)
    sample: Callable[[], str] = partial(sample_text, model, tokenizer, seed=recipe.seed)
    evaluate: Callable[[], dict[str, float]]
    names = TOKEN_METRICS if recipe.model.pretrained else CHAR_METRICS  # a pretrained model brings its tokenizer
    if recipe.data.source == "facts":
        facts = facts_target(recipe, model, tokenizer)
        evaluate, sample, names = facts.evaluate, facts.sample, FACTS_METRICS
    else:
        windows = lm_windows(encode_text(tokenizer, pooled_held_out(spec, recipe.data.eval_chars)), recipe.train.seq_len)
        evaluate = partial(evaluate_lm, model, windows)

    def save(out: Path, arrays: ArrayRecord) -> None:
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)

    return Target(
        model=model, tokenizer=tokenizer, initial=lambda: {k: v.detach().clone() for k, v in model.state_dict().items()},
        load=lambda arrays: model.load_state_dict(arrays.to_torch_state_dict()),
        evaluate=evaluate, save=save, sample=sample, params=count_params(model), metric_names=names,
    )


@dataclass(frozen=True)
class _Scoring:
    evaluate: Callable[[], dict[str, float]]
    sample: Callable[[], str]


def facts_target(recipe: Recipe, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> _Scoring:
    """How a facts recipe's target is scored and shown: every client's probes (:func:`facts_evaluator`), with
    ``data.general_chars`` the loss on general text the pretrained model already modelled."""
    facts, groups = facts_by_tier(recipe.data, recipe.population, recipe.seed)
    probes = facts.probes
    general = (lm_windows(encode_text(tokenizer, general_text(recipe.data.general_chars)), recipe.train.seq_len)
               if recipe.data.general_chars else None)
    return _Scoring(facts_evaluator(model, tokenizer, probes, general, groups),
                    partial(facts_sample, model, tokenizer, probes[:5]))


def facts_sample(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, probes: Sequence[Probe]) -> str:
    """The target's greedy answers to a few probes, next to the true ones, for the report."""
    return "\n".join(f"{p.prompt} -> {greedy_answer(model, tokenizer, p.prompt)}   (true: {p.answer})" for p in probes)


def facts_evaluator(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, probes: Sequence[Probe],
                    general: torch.Tensor | None = None,
                    groups: Mapping[str, Sequence[int]] | None = None) -> Callable[[], dict[str, float]]:
    """Scores of the target on all probes: ``probe_acc``, ``answer_loss``, ``knowledge_bits``, and as the
    run's common fields ``eval_acc`` = probe accuracy, ``eval_loss`` = answer loss, ``eval_ppl`` its exp; with
    ``general`` token windows (a pretrained target), ``general_loss``: its loss on text it modelled before; with
    ``groups`` (tier -> its holders' probes, :func:`~fedfusion.data.facts.holder_groups`), each tier's recall and
    answer loss (``probe_acc/<tier>``): whether what the weakest devices hold reaches the target."""
    encoded = encode_probes(tokenizer, probes)

    def evaluate() -> dict[str, float]:
        scores = probe_metrics(model, encoded, groups=groups)
        if general is not None:
            scores["general_loss"] = evaluate_lm(model, general)["eval_loss"]
        loss = scores["answer_loss"]
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_acc": scores["probe_acc"], **scores}

    return evaluate


def lora_target(recipe: Recipe) -> tuple[Target, dict[str, torch.Tensor]]:
    """A frozen pretrained base plus the global LoRA update (empty before round 1); also the base's
    original weights of the adapted modules, which every round's update is applied to."""
    lora = recipe.section(LoRAConfig)
    tokenizer = load_base_tokenizer(lora.base)  # converts and caches a GGUF base once, before any client
    model = load_base(lora.base)
    original = snapshot(model, adapted_modules(model, list(lora.target_modules)))
    if recipe.data.source == "facts":  # the base + update answers every client's probes, as lm_target's target does
        facts = facts_target(recipe, model, tokenizer)
        evaluate, sample, names = facts.evaluate, facts.sample, FACTS_METRICS
    else:
        pairs = pooled_pairs(lora_data_spec(recipe.data_source()), lora.eval_pairs)
        data = instruct.encode_pairs(tokenizer, pairs, recipe.train.seq_len)
        evaluate, sample, names = partial(instruct.evaluate_instruct, model, data), partial(
            pair_sample, model, tokenizer, [p.prompt for p in pairs[: lora.samples]]), RESPONSE_METRICS

    def save(out: Path, arrays: ArrayRecord) -> None:
        """The global update as a peft adapter in ``adapter/``; the merged model in ``out`` only when the recipe
        asks (``output.save_merged``): it is a whole copy of a base the user already has."""
        if not len(arrays):
            return  # no round produced an update: the base is unchanged
        state = arrays.to_torch_state_dict()
        save_adapter(state, out.parent / "adapter", list(lora.target_modules), resolve_base(lora.base))
        if recipe.output.save_merged:
            save_merged(model, original, state, tokenizer, out)

    target = Target(
        model=model, tokenizer=tokenizer, initial=dict,
        load=lambda arrays: apply_global(model, original, arrays.to_torch_state_dict()),
        evaluate=evaluate, save=save, sample=sample, params=count_params(model), metric_names=names,
    )
    return target, original


def pair_sample(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str]) -> str:
    """The target's responses to a few held-out prompts, for the report."""
    answers = instruct.generate_responses(model, tokenizer, list(prompts))
    return "\n".join(f"Q: {q}\nA: {a}" for q, a in zip(prompts, answers))
