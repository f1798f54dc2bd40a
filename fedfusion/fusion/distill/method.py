"""Distillation as a fusion method: small client families, FedAvg within each, distilled into the target.

Each tier trains its family's global model (``distill.tier_family``); a round's replies are averaged per family
(FedAvg within the family). Then, on the transfer set, the families that have ever been trained teach the target
(FedDF average or Fed-ET weighted consensus, through a :class:`~fedfusion.fusion.distill.align.TokenBridge` where a family's
tokenizer differs), and optionally the target teaches each family back (FedMKT's bidirectional transfer).

After fusion every trained family model is scored on the pooled held-out text (``eval_text``) in its own tokens,
as loss in nats per *character* (total nats / characters predicted), so character and BPE families compare with
each other and with the character-level target: ``family_<name>_loss``, ``family_<name>_ppl`` and, for families
whose every predicted token is one character, ``family_<name>_acc`` (next-character accuracy; for the others
``family_<name>_token_acc``, next-token accuracy in their own tokens). The distillation's counted work is the
fold's ``server_cost``, so the server can be priced like a client.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from fedfusion.config.choices import TEACHERS
from fedfusion.config.methods import SUBMODEL
from fedfusion.data.text import encode_text, lm_windows
from fedfusion.fusion.base import (
    Client,
    Fold,
    FusionMethod,
    Payload,
    State,
    TierCost,
    Update,
    check_same_layout,
    state_norm,
    state_size,
)
from fedfusion.fusion.distill.align import BridgedWindows, TokenBridge
from fedfusion.fusion.distill.config import DistillConfig
from fedfusion.fusion.distill.spec import FamilySpec
from fedfusion.fusion.state import pack_tensors, unpack_tensors
from fedfusion.models.build import config_aliases, model_from_state, small_model, tied_aliases, wire_state
from fedfusion.train.distill import DistillationLoss, Teacher, feddf_teacher, fedet_teacher, fit_vocab, forward_flops
from fedfusion.train.loop import TrainResult, evaluate_lm, train_steps
from fedfusion.wire.specs import ModelSpec, RoleSpec, merge


@dataclass(frozen=True)
class Family:
    """A small model family: its Hugging Face config and tokenizer (None: the target's tokenizer)."""

    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None = None


def _wire(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """A family model's state as the method keeps and sends it: copies, tied aliases left out."""
    return wire_state({k: v.detach().clone() for k, v in model.state_dict().items()}, tied_aliases(model))


class DistillMethod(FusionMethod):
    """FedDF / Fed-ET / FedMKT-style fusion of small model families into a larger Llama target."""

    name, role, noun = "distill", "smallmodel", "family model"

    def __init__(self, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, families: dict[str, Family],
                 tier_family: dict[str, str], transfer_text: str, seq_len: int, settings: DistillConfig,
                 eval_text: str = "", run_seed: int = 0) -> None:
        if settings.teacher not in TEACHERS:
            raise ValueError(f"teacher {settings.teacher!r} is not one of {', '.join(TEACHERS)}")
        for tier, name in tier_family.items():
            if name not in families:
                raise ValueError(f"tier_family.{tier}: unknown family {name!r}; families are {', '.join(sorted(families))}")
        self.config, self.tokenizer, self.families, self.tier_family = config, tokenizer, families, tier_family
        self.s, self.seed = settings, run_seed
        self.aliases = config_aliases(config)
        self.transfer = lm_windows(encode_text(tokenizer, transfer_text), seq_len)
        self.family_states: dict[str, dict[str, torch.Tensor]] = {}  # tied aliases left out, as sent
        self.family_aliases: dict[str, dict[str, str]] = {}
        self.tokenizer_json: dict[str, str] = {}
        self.family_transfer: dict[str, torch.Tensor] = {}  # transfer windows in the family's tokens
        self.bridges: dict[str, tuple[TokenBridge, BridgedWindows, TokenBridge, BridgedWindows]] = {}
        for i, (name, family) in enumerate(sorted(families.items())):
            torch.manual_seed(run_seed * 1000 + i)
            model = small_model(json.dumps(family.config.to_dict()))
            self.family_aliases[name] = tied_aliases(model)
            self.family_states[name] = _wire(model)
            ftok = family.tokenizer
            if ftok is None or ftok.get_vocab() == tokenizer.get_vocab():
                if family.config.vocab_size != len(tokenizer):
                    raise ValueError(f"family {name!r}: vocab_size {family.config.vocab_size} differs from the "
                                     f"target tokenizer's {len(tokenizer)}")
                self.tokenizer_json[name] = ""
                self.family_transfer[name] = self.transfer
                continue
            if family.config.vocab_size < len(ftok):
                raise ValueError(f"family {name!r}: vocab_size {family.config.vocab_size} < its tokenizer's {len(ftok)}")
            self.tokenizer_json[name] = ftok.backend_tokenizer.to_str()
            self.family_transfer[name] = lm_windows(encode_text(ftok, transfer_text), seq_len)
            up, down = TokenBridge(ftok, tokenizer), TokenBridge(tokenizer, ftok)
            self.bridges[name] = (
                up, up.prepare(self.transfer, _max_len(family.config)),
                down, down.prepare(self.family_transfer[name], _max_len(config)),
            )
        self.eval_sets = {name: family_eval_set(family.tokenizer or tokenizer, eval_text, seq_len)
                          for name, family in sorted(families.items())} if eval_text else {}
        self.family_scores: dict[str, dict[str, float]] = {}
        self.trained: set[str] = set()
        self.server_cost = {"flops": 0.0, "seconds": 0.0, "tokens": 0.0}

    def describe(self) -> str:
        return (f"distill: teacher={self.s.teacher} T={self.s.temperature} families={sorted(self.families)} "
                f"tiers={self.tier_family} server_steps={self.s.server_steps} back={self.s.back_distill}")

    def state_dict(self) -> dict[str, Any]:
        """The family models (safetensors, base64), their scores and which families have trained."""
        return {"trained": sorted(self.trained), "family_scores": self.family_scores,
                "families": {n: pack_tensors(s) for n, s in self.family_states.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trained = set(state["trained"])
        self.family_scores = state.get("family_scores", {})
        self.family_states = {n: wire_state(unpack_tensors(b), self.family_aliases[n])
                              for n, b in state["families"].items()}

    def family_model(self, name: str) -> PreTrainedModel:
        """The current global model of family ``name``."""
        return small_model(json.dumps(self.families[name].config.to_dict()), self.family_states[name])

    def tier_cost(self, tier: str) -> TierCost:
        """Training the tier's family model and moving it both ways."""
        return state_size(self.family_states[self.tier_family[tier]])

    def payloads(self, server_round: int, target: State, clients: Sequence[Client]) -> list[Payload]:
        """Each client's family model and the spec to train it."""
        target_params = sum(t.numel() for t in wire_state(target, self.aliases).values())
        out = []
        for client in clients:
            name = self.tier_family[client.tier]
            state = self.family_states[name]
            spec = merge(RoleSpec(self.role), ModelSpec(self.families[name].config.to_dict()),
                         FamilySpec(name, self.tokenizer_json[name]))
            params = sum(t.numel() for t in state.values())
            out.append(Payload(client, state, spec, width=params / target_params, params=params,
                               sent_norm=state_norm(state), assignment={"family": name}, context=name))
        return out

    def check(self, payload: Payload, reply: State, weight: float) -> Update:
        check_same_layout(reply, self.family_states[payload.context], "family model")
        return Update(payload, weight, state_norm(reply), reply)

    def fold(self, server_round: int, target: State, updates: Sequence[Update]) -> Fold:
        """FedAvg within each family, then distillation into the target (and back), then the family scores."""
        sums: dict[str, dict[str, torch.Tensor]] = {}
        weights: dict[str, float] = {}
        for update in updates:
            name, w = update.payload.context, update.weight
            acc = sums.setdefault(name, {k: torch.zeros_like(v, dtype=torch.float32) for k, v in update.data.items()})
            for k, v in update.data.items():
                acc[k] += w * v.float()
            weights[name] = weights.get(name, 0.0) + w
        for name, acc in sums.items():
            old = self.family_states[name]
            self.family_states[name] = {k: (v / weights[name]).to(old[k].dtype) for k, v in acc.items()}
            self.trained.add(name)
        self.server_cost = {"flops": 0.0, "seconds": 0.0, "tokens": 0.0}
        new, stats = self.fuse(server_round, target)
        self.score_families()
        return Fold(new, 1.0, stats, dict(self.server_cost))  # distillation moves every parameter of the target

    def evaluation(self, target: State, tier: str) -> tuple[State, dict[str, Any]]:
        """The whole target, scored by a sub-model client (it is a Llama of the target's config)."""
        return wire_state(target, self.aliases), merge(RoleSpec(SUBMODEL), ModelSpec(self.config.to_dict()))

    def metrics(self) -> dict[str, float]:
        """The latest family scores as flat ``family_<name>_<metric>`` floats for the round's metrics row."""
        return {f"family_{name}_{k}": v for name, scores in sorted(self.family_scores.items())
                for k, v in scores.items()}

    def score_families(self) -> None:
        """Score every trained family model on the held-out text (no-op without ``eval_text``)."""
        for name in sorted(self.trained & set(self.eval_sets)):
            self.family_scores[name] = score_per_char(self.family_model(name), self.eval_sets[name])

    # -- server-side distillation --------------------------------------------------------------
    def fuse(self, server_round: int, state: State) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Distil the trained families into the target, then (optionally) the target into each family."""
        s = self.s
        target = model_from_state(self.config, state)
        teachers = {name: self.family_model(name).eval() for name in sorted(self.trained)}
        seed = self.seed * 100003 + server_round
        fused = train_steps(target, self.transfer, s.server_steps, s.server_lr, s.server_batch_size, seed,
                            loss=DistillationLoss(self._ensemble_teacher(teachers), s.temperature, s.kd_weight,
                                                  s.diversity_weight))
        self._charge(fused)
        stats = {"distill_loss": fused.loss, **({"distill_kd": fused.parts["kd"]} if "kd" in fused.parts else {})}
        target.eval()
        if s.back_distill:
            for name, student in teachers.items():
                back = train_steps(student, self.family_transfer[name], s.back_steps, s.back_lr, s.server_batch_size,
                                   seed + 7919, loss=DistillationLoss(self._target_teacher(target, name), s.temperature,
                                                                      s.kd_weight))
                self._charge(back)
                self.family_states[name] = _wire(student)
                if "kd" in back.parts:
                    stats[f"back_kd_{name}"] = back.parts["kd"]
        return {k: v.detach().clone() for k, v in target.state_dict().items()}, stats

    def _charge(self, result: TrainResult) -> None:
        for key, value in result.cost().items():
            self.server_cost[key] += value

    def _ensemble_teacher(self, teachers: dict[str, PreTrainedModel]):
        """Teacher function over transfer rows: every family's prediction on the target's vocabulary, combined."""

        vocab = self.config.vocab_size

        def teacher_fn(rows: torch.Tensor) -> Teacher:
            logits, masks, flops = [], [], 0.0
            batch = self.transfer[rows]
            for name, model in teachers.items():
                params = sum(p.numel() for p in model.parameters())
                if name not in self.bridges:
                    out = model(input_ids=batch[:, :-1]).logits.float()
                    logits.append(fit_vocab(out, vocab))
                    masks.append(torch.ones(out.shape[:-1], dtype=torch.bool))
                    flops += forward_flops(params, batch[:, :-1].numel())
                    continue
                bridge, bridged = self.bridges[name][:2]
                attention = bridged.attention_mask[rows]
                out = model(input_ids=bridged.teacher_ids[rows], attention_mask=attention).logits
                log_probs, mask = bridge.map(out[..., : len(bridge.teacher)], bridged, rows)
                logits.append(fit_vocab(log_probs, vocab))
                masks.append(mask)
                flops += forward_flops(params, int(attention.sum()))
            stack, valid = torch.stack(logits), torch.stack(masks)
            if self.s.teacher == "feddf":
                teacher = feddf_teacher(stack, self.s.temperature, self.s.average, valid)
            else:
                teacher = fedet_teacher(stack, self.s.temperature, self.s.confidence, valid)
            teacher.flops = flops
            return teacher

        return teacher_fn

    def _target_teacher(self, target: PreTrainedModel, name: str):
        """Teacher function over family ``name``'s transfer rows: the target's prediction on its vocabulary."""
        params = sum(p.numel() for p in target.parameters())
        vocab = self.families[name].config.vocab_size

        def teacher_fn(rows: torch.Tensor) -> Teacher:
            if name not in self.bridges:
                inputs = self.family_transfer[name][rows, :-1]
                out = target(input_ids=inputs).logits.float()[..., : len(self.tokenizer)]
                teacher = feddf_teacher(fit_vocab(out, vocab)[None], self.s.temperature)
                teacher.flops = forward_flops(params, inputs.numel())
                return teacher
            _, _, bridge, bridged = self.bridges[name]
            attention = bridged.attention_mask[rows]
            out = target(input_ids=bridged.teacher_ids[rows], attention_mask=attention).logits
            log_probs, mask = bridge.map(out[..., : len(self.tokenizer)], bridged, rows)
            teacher = feddf_teacher(fit_vocab(log_probs, vocab)[None], self.s.temperature, masks=mask[None])
            teacher.flops = forward_flops(params, int(attention.sum()))
            return teacher

        return teacher_fn



@dataclass(frozen=True)
class EvalSet:
    """Held-out text in one tokenizer: windows, characters per token id, and whether it is character-level."""

    windows: torch.Tensor
    chars: int  # characters spanned by the predicted tokens (labels) of ``windows``
    char_level: bool  # every predicted token is one character: accuracy is next-character accuracy


def family_eval_set(tokenizer: PreTrainedTokenizerBase, text: str, seq_len: int) -> EvalSet:
    """``text`` as non-overlapping windows of ``tokenizer``'s ids, with the characters its labels span.

    A token's characters are those of its decoded string (a byte-level BPE token holding part of a
    multi-byte character decodes to one replacement character, so counts are exact for ASCII text).
    """
    windows = lm_windows(encode_text(tokenizer, text), seq_len)
    labels = windows[:, 1:]
    ids = labels.unique()
    length = torch.zeros(int(ids.max()) + 1, dtype=torch.long)
    length[ids] = torch.tensor([len(tokenizer.decode([int(i)])) for i in ids])
    chars = int(length[labels].sum())
    if chars < 1:
        raise ValueError("eval_text: the held-out text decodes to no characters")
    return EvalSet(windows, chars, bool((length[ids] == 1).all()))


def score_per_char(model: PreTrainedModel, data: EvalSet) -> dict[str, float]:
    """Held-out loss in nats per character (total nats / characters), its perplexity, and next-token
    accuracy: ``acc`` for a character-level tokenizer (it is next-character accuracy, comparable with the
    target's), ``token_acc`` for any other (in the family's own tokens, so not comparable across tokenizers)."""
    scores = evaluate_lm(model, data.windows)
    loss = scores["eval_loss"] * data.windows[:, 1:].numel() / data.chars
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), ("acc" if data.char_level else "token_acc"): scores["eval_acc"]}


def _max_len(config: PretrainedConfig) -> int | None:
    """Longest input a model of ``config`` takes (None when the config does not say)."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
