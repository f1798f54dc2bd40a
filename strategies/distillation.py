"""Distillation fusion as a Flower Strategy: small client families, FedAvg within each, distilled into the target.

Round flow (``Strategy.start`` drives it; the ``arrays`` it passes around are the target's state, the
family models live on the strategy):
1. ``configure_train``: capability query and seeded sampling as in sub-model fusion; each sampled node
   gets a fresh Message with its tier's family model and a spec (role ``smallmodel``, family, model
   config JSON, tokenizer JSON, steps, lr, seed, data spec).
2. ``aggregate_train``: replies are checked (error, NaN/Inf, keys, shapes, num-examples, norm) and
   averaged per family (FedAvg within the family). Then, on the transfer set, the families that have
   ever been trained teach the target (FedDF average or Fed-ET weighted consensus, through a
   :class:`~fedfusion.align.TokenBridge` where a family's tokenizer differs), and optionally the target
   teaches each family back (FedMKT's bidirectional transfer). Fewer than ``min_clients`` good replies
   leave the target and the families unchanged (a void round).
3. After fusion every trained family model is scored on the pooled held-out text (``eval_text``) in its
   own tokens, as loss in nats per *character* (total nats / characters predicted), so character and BPE
   families compare with each other and with the character-level target; the scores go to
   ``last.fed_eval`` (``family_<name>_loss``, ``family_<name>_ppl`` and, for families whose every predicted
   token is one character, ``family_<name>_acc``: next-character accuracy; for the others
   ``family_<name>_token_acc``, next-token accuracy in their own tokens), which the run recorder writes.

The distillation's counted work is kept in :attr:`DistillationFusion.server_cost` so the server can be
priced like a client.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from logging import INFO, WARNING

import torch
from fedfusion.strategies.submodel import (
    ClientRound,
    RoundLog,
    SubModelFusion,
    reply_metrics,
    state_norm,
)
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.logger import log
from flwr.serverapp import Grid
from transformers import (
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from fedfusion.align import BridgedWindows, TokenBridge
from fedfusion.checkpoint import pack_tensors, unpack_tensors
from fedfusion.data import encode_text, lm_windows
from fedfusion.distill import (
    Teacher,
    distil,
    feddf_teacher,
    fedet_teacher,
    fit_vocab,
    forward_flops,
)
from fedfusion.energy import WorkCost, price_work, train_flops
from fedfusion.models import model_from_state, small_model, tied_aliases, wire_state
from fedfusion.participation import Participation
from fedfusion.training import evaluate_lm

TEACHERS = ("feddf", "fedet")


@dataclass(frozen=True)
class Family:
    """A small model family: its Hugging Face config and tokenizer (None: the target's tokenizer)."""

    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None = None


def _wire(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """A family model's state as the strategy keeps and sends it: copies, tied aliases left out."""
    return wire_state({k: v.detach().clone() for k, v in model.state_dict().items()}, tied_aliases(model))


def check_update(update: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    """Raise ValueError unless ``update`` has exactly ``reference``'s keys and shapes and finite values."""
    if set(update) != set(reference):
        missing, extra = set(reference) - set(update), set(update) - set(reference)
        raise ValueError(f"update keys differ from the family model: missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]}")
    for name, value in update.items():
        if value.shape != reference[name].shape:
            raise ValueError(f"{name}: shape {tuple(value.shape)} does not match the family's {tuple(reference[name].shape)}")
        if not torch.isfinite(value).all():
            raise ValueError(f"{name}: update holds NaN or Inf")


class DistillationFusion(SubModelFusion):
    """FedDF / Fed-ET / FedMKT-style fusion of small model families into a larger Llama target.

    Sampling, capability discovery and federated evaluation of the target are sub-model fusion's (every
    tier's "width" is 1: it trains its whole family model), so this class extends :class:`SubModelFusion`
    and replaces training and aggregation.
    """

    def __init__(
        self,
        config: LlamaConfig,
        tokenizer: PreTrainedTokenizerBase,
        families: dict[str, Family],
        tier_family: dict[str, str],
        transfer_text: str,
        clients_per_round: int,
        min_clients: int,
        participation: Participation,
        query_config: dict[str, str | int | float],
        train_config: dict[str, str | int | float],
        teacher: str = "feddf",
        average: str = "logits",
        confidence: str = "variance",
        temperature: float = 1.0,
        kd_weight: float = 1.0,
        diversity_weight: float = 0.0,
        server_steps: int = 50,
        server_lr: float = 1e-3,
        server_batch_size: int = 16,
        back_distill: bool = True,
        back_steps: int = 20,
        back_lr: float = 1e-3,
        eval_text: str = "",
        weighting: str = "uniform",
        evaluate_clients: int = 0,
        seed: int = 0,
        wait_nodes_s: float = 60.0,
        query_timeout_s: float = 600.0,
        max_norm_ratio: float = 10.0,
        overselect: float = 0.0,
    ) -> None:
        super().__init__(
            config=config, widths={tier: 1.0 for tier in tier_family}, policy="static", stride=1.0, stagger=False,
            clients_per_round=clients_per_round, min_clients=min_clients, participation=participation,
            query_config=query_config,
            train_config=train_config, weighting=weighting, evaluate_clients=evaluate_clients, seed=seed,
            wait_nodes_s=wait_nodes_s, query_timeout_s=query_timeout_s, max_norm_ratio=max_norm_ratio,
            overselect=overselect,
        )
        if teacher not in TEACHERS:
            raise ValueError(f"teacher {teacher!r} is not one of {', '.join(TEACHERS)}")
        for tier, name in tier_family.items():
            if name not in families:
                raise ValueError(f"tier_family.{tier}: unknown family {name!r}; families are {', '.join(sorted(families))}")
        self.tokenizer, self.families, self.tier_family = tokenizer, families, tier_family
        self.teacher, self.average, self.confidence = teacher, average, confidence
        self.temperature, self.kd_weight, self.diversity_weight = temperature, kd_weight, diversity_weight
        self.server_steps, self.server_lr, self.server_batch_size = server_steps, server_lr, server_batch_size
        self.back_distill, self.back_steps, self.back_lr = back_distill, back_steps, back_lr
        self.seed = seed
        seq_len = int(train_config["seq-len"])
        self.transfer = lm_windows(encode_text(tokenizer, transfer_text), seq_len)
        self.family_states: dict[str, dict[str, torch.Tensor]] = {}  # tied aliases left out, as sent
        self.family_aliases: dict[str, dict[str, str]] = {}
        self.tokenizer_json: dict[str, str] = {}
        self.family_transfer: dict[str, torch.Tensor] = {}  # transfer windows in the family's tokens
        self.bridges: dict[str, tuple[TokenBridge, BridgedWindows, TokenBridge, BridgedWindows]] = {}
        for i, (name, family) in enumerate(sorted(families.items())):
            torch.manual_seed(seed * 1000 + i)
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
        self.sent: dict[int, str] = {}

    def summary(self) -> None:
        """Log the strategy's settings."""
        log(INFO, "DistillationFusion: teacher=%s T=%s families=%s tiers=%s server_steps=%d back=%s clients/round=%d",
            self.teacher, self.temperature, sorted(self.families), self.tier_family, self.server_steps,
            self.back_distill, self.clients_per_round)

    def state_dict(self) -> dict:
        """Sampling state plus the family models (safetensors, base64) and which families have trained:
        everything a resumed run needs, in a JSON-able dict."""
        return {**super().state_dict(), "trained": sorted(self.trained), "family_scores": self.family_scores,
                "families": {n: pack_tensors(s) for n, s in self.family_states.items()}}

    def load_state_dict(self, state: dict, rounds_done: int) -> None:
        """Continue from a checkpoint taken after ``rounds_done`` rounds."""
        super().load_state_dict(state, rounds_done)
        self.trained = set(state["trained"])
        self.family_scores = state.get("family_scores", {})
        self.family_states = {n: wire_state(unpack_tensors(b), self.family_aliases[n])
                              for n, b in state["families"].items()}

    def family_model(self, name: str) -> PreTrainedModel:
        """The current global model of family ``name``."""
        return small_model(json.dumps(self.families[name].config.to_dict()), self.family_states[name])

    def tier_costs(self) -> dict[str, WorkCost]:
        """Each tier's planned work, priced once: training its family model and moving it both ways."""
        if not self.costs:
            for tier, name in self.tier_family.items():
                state = self.family_states[name]
                params, nbytes = sum(t.numel() for t in state.values()), sum(t.nbytes for t in state.values())
                self.sizes[tier] = (params, nbytes)
                self.costs[tier] = price_work(self.participation.catalog[tier],
                                              train_flops(params, self._tokens()), nbytes, nbytes)
        return self.costs

    # -- train --------------------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One fresh Message per sampled node: its tier's family model and the spec to train it."""
        server_round += self.round_offset
        self.target = arrays.to_torch_state_dict()
        self.last = RoundLog(server_round=server_round)
        self.sent = {}
        target_params = sum(t.numel() for t in wire_state(self.target, self.aliases).values())
        messages = []
        for node in self.sample(grid, server_round):
            device = self.caps[node]["device"]
            name = self.tier_family[device]
            partition = int(self.caps[node].get("partition", -1))
            seed = self.client_seed(server_round, node)
            state = self.family_states[name]
            record = ArrayRecord(state)
            spec = ConfigRecord({
                **config, **self.train_config,
                "role": "smallmodel", "server-round": server_round, "family": name, "seed": seed,
                "model-config": json.dumps(self.families[name].config.to_dict()),
                "tokenizer-json": self.tokenizer_json[name],
            })
            params = sum(t.numel() for t in state.values())
            self.sent[node] = name
            self.last.clients[node] = ClientRound(
                node=node, device=device, width=params / target_params, partition=partition,
                assignment={"family": name}, bytes_down=record.count_bytes(), params=params,
                sent_norm=state_norm(state), tokens=self._tokens(),
            )
            messages.append(Message(RecordDict({"arrays": record, "config": spec}), dst_node_id=node,
                                    message_type=MessageType.TRAIN))
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """FedAvg within each family, then distillation into the target (and back); bad replies are rejected."""
        server_round += self.round_offset
        start = time.perf_counter()
        sums: dict[str, dict[str, torch.Tensor]] = {}
        weights: dict[str, float] = {}
        losses, examples = [], 0
        for reply, row in self.replies_in_order(server_round, replies):
            name = self.sent[row.node]
            try:
                update = reply.content["arrays"].to_torch_state_dict()
                n, loss, seconds, tokens = reply_metrics(reply.content["metrics"], row)
                row.bytes_up = reply.content["arrays"].count_bytes()
                check_update(update, self.family_states[name])
                if self.max_norm_ratio and state_norm(update) > self.max_norm_ratio * row.sent_norm:
                    raise ValueError(f"update norm {state_norm(update):.3g} is over {self.max_norm_ratio:g}x the "
                                     f"norm of the family model sent ({row.sent_norm:.3g})")
            except Exception as exc:  # an untrusted reply can be malformed in any way; it must not stop the run
                self.reject(server_round, row, exc)
                continue
            w = float(n) if self.weighting == "examples" else 1.0
            acc = sums.setdefault(name, {k: torch.zeros_like(v, dtype=torch.float32) for k, v in update.items()})
            for k, v in update.items():
                acc[k] += w * v.float()
            weights[name] = weights.get(name, 0.0) + w
            row.status, row.examples, row.train_loss, row.train_s, row.tokens = "ok", n, loss, seconds, tokens
            losses.append(loss)
            examples += n
        self.close_round(server_round)
        ok = len(losses)
        self.server_cost = {"flops": 0.0, "seconds": 0.0, "tokens": 0.0}
        self.last.void = ok < self.min_clients or not ok
        if self.last.void:
            log(WARNING, "round %d: %d good replies < selection.min_clients=%d; target and families unchanged",
                server_round, ok, self.min_clients)
            self.last.aggregate_s = time.perf_counter() - start
            self.last.fed_eval = self.family_eval()
            return None, MetricRecord({"clients_ok": ok})
        for name, acc in sums.items():
            old = self.family_states[name]
            self.family_states[name] = {k: (v / weights[name]).to(old[k].dtype) for k, v in acc.items()}
            self.trained.add(name)
        target, stats = self.fuse(server_round)
        self.last.coverage = 1.0  # distillation moves every parameter of the target
        self.last.aggregate_s = time.perf_counter() - start
        self.score_families()
        self.last.fed_eval = self.family_eval()
        return ArrayRecord(target), MetricRecord({
            "train_loss": sum(losses) / ok, "num-examples": examples, "clients_ok": ok,
            "coverage": self.last.coverage, **stats,
            "server_flops": self.server_cost["flops"], "server_s": self.server_cost["seconds"],
        })

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The target's federated evaluation (as in sub-model fusion), kept next to the family scores."""
        families = self.family_eval()
        result = super().aggregate_evaluate(server_round, replies)
        self.last.fed_eval = {**families, **self.last.fed_eval}
        return result

    # -- family evaluation ----------------------------------------------------------------------
    def score_families(self) -> None:
        """Score every trained family model on the held-out text (no-op without ``eval_text``)."""
        for name in sorted(self.trained & set(self.eval_sets)):
            self.family_scores[name] = score_per_char(self.family_model(name), self.eval_sets[name])

    def family_eval(self) -> dict[str, float]:
        """The latest family scores as flat ``family_<name>_<metric>`` floats for the round's metrics row."""
        return {f"family_{name}_{k}": v for name, scores in sorted(self.family_scores.items())
                for k, v in scores.items()}

    # -- server-side distillation --------------------------------------------------------------
    def fuse(self, server_round: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Distil the trained families into the target, then (optionally) the target into each family."""
        target = model_from_state(self.config, self.target)
        teachers = {name: self.family_model(name).eval() for name in sorted(self.trained)}
        seed = self.seed * 100003 + server_round
        fused = distil(target, self._ensemble_teacher(teachers), self.transfer, self.server_steps, self.server_lr,
                       self.temperature, self.server_batch_size, seed, self.kd_weight, self.diversity_weight)
        self._charge(fused)
        stats = {"distill_loss": fused["loss"], **({"distill_kd": fused["kd"]} if "kd" in fused else {})}
        target.eval()
        if self.back_distill:
            for name, student in teachers.items():
                back = distil(student, self._target_teacher(target, name), self.family_transfer[name],
                              self.back_steps, self.back_lr, self.temperature, self.server_batch_size,
                              seed + 7919, self.kd_weight)
                self._charge(back)
                self.family_states[name] = _wire(student)
                if "kd" in back:
                    stats[f"back_kd_{name}"] = back["kd"]
        return {k: v.detach().clone() for k, v in target.state_dict().items()}, stats

    def _charge(self, stats: dict[str, float]) -> None:
        for key in ("flops", "seconds", "tokens"):
            self.server_cost[key] += stats[key]

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
            if self.teacher == "feddf":
                teacher = feddf_teacher(stack, self.temperature, self.average, valid)
            else:
                teacher = fedet_teacher(stack, self.temperature, self.confidence, valid)
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
                teacher = feddf_teacher(fit_vocab(out, vocab)[None], self.temperature)
                teacher.flops = forward_flops(params, inputs.numel())
                return teacher
            _, _, bridge, bridged = self.bridges[name]
            attention = bridged.attention_mask[rows]
            out = target(input_ids=bridged.teacher_ids[rows], attention_mask=attention).logits
            log_probs, mask = bridge.map(out[..., : len(self.tokenizer)], bridged, rows)
            teacher = feddf_teacher(fit_vocab(log_probs, vocab)[None], self.temperature, masks=mask[None])
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
