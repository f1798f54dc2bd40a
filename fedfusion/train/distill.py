"""Ensemble distillation: teachers built from several models' logits, the KD loss, and the distillation loss plug-in
of the training loop (:class:`DistillationLoss` for :func:`fedfusion.train.loop.train_steps`).

Used by distillation fusion (FedDF, Fed-ET, FedMKT) to fold small client families into the target on a
transfer set, and the target back into the families. Plain torch, no Flower.

Teachers take a stack of per-teacher logits of shape (K, ..., V) over one vocabulary (the student's).
A teacher whose tokenizer differs from the student's is first mapped onto the student's vocabulary by
:mod:`fedfusion.fusion.distill.align`, which yields log-probabilities: these are valid logits (softmax is invariant to
a per-position shift), so every rule below accepts them as they are.

- :func:`feddf_teacher`: FedDF's plain ensemble. The default averages **logits** (the FedDF paper's
  choice; a geometric mean of the teachers' distributions, sharper where they agree); ``average="probs"``
  averages probabilities (an arithmetic mixture, which keeps every teacher's modes).
- :func:`fedet_teacher`: Fed-ET's weighted consensus. Per position, each teacher's confidence
  (variance of its softmax by default, or information = log V - entropy, or max probability) weights a
  vote on the next token; the teachers that agree with the vote form the consensus, whose
  confidence-weighted logit average is the teacher. The dissenting teachers' mean distribution is kept
  as the diversity target, which :func:`distillation_loss` adds with weight ``diversity_weight``
  (Fed-ET's diversity regulariser: the student also learns what the minority sees).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from fedfusion.config.choices import AVERAGES, CONFIDENCES
from fedfusion.train.loop import Step, lm_loss


@dataclass
class Teacher:
    """Soft targets for one batch: log-probabilities at the distillation temperature, on the student vocabulary.

    ``mask`` (shape of the positions) marks positions that have a target; ``diverse_*`` hold Fed-ET's
    dissenting-teacher target where there is one; ``flops`` is the forward work spent producing it.
    """

    log_probs: torch.Tensor
    mask: torch.Tensor | None = None
    diverse_log_probs: torch.Tensor | None = None
    diverse_mask: torch.Tensor | None = None
    flops: float = 0.0


def forward_flops(params: int, tokens: int) -> float:
    """Inference FLOPs: 2 per parameter per token (the forward third of :func:`~fedfusion.devices.energy.train_flops`)."""
    return 2.0 * params * tokens


def fit_vocab(logits: torch.Tensor, size: int) -> torch.Tensor:
    """``logits`` cut or padded (with -1e4: no probability) to a model's ``size`` output ids.

    A model's embedding may be larger than its tokenizer (padded vocabularies); ids no tokenizer emits
    get no teacher mass.
    """
    if logits.shape[-1] >= size:
        return logits[..., :size]
    return torch.cat([logits, logits.new_full((*logits.shape[:-1], size - logits.shape[-1]), -1e4)], dim=-1)


def _check(logits: torch.Tensor, masks: torch.Tensor | None, temperature: float) -> torch.Tensor:
    if logits.dim() < 2 or logits.shape[0] < 1:
        raise ValueError(f"logits must be stacked as (teachers, ..., vocab), got shape {tuple(logits.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if masks is None:
        return torch.ones(logits.shape[:-1], dtype=torch.bool, device=logits.device)
    if masks.shape != logits.shape[:-1]:
        raise ValueError(f"masks shape {tuple(masks.shape)} does not match logits {tuple(logits.shape[:-1])}")
    return masks.bool()


def feddf_teacher(
    logits: torch.Tensor, temperature: float = 1.0, average: str = "logits", masks: torch.Tensor | None = None
) -> Teacher:
    """FedDF: the teachers' average at ``temperature``, over the teachers valid at each position.

    ``logits``: (K, ..., V). ``masks``: (K, ...) booleans, False where a teacher has no prediction (e.g. an
    unaligned position); a position no teacher covers is masked out of the result.
    """
    if average not in AVERAGES:
        raise ValueError(f"average {average!r} is not one of {', '.join(AVERAGES)}")
    valid = _check(logits, masks, temperature)
    w = valid.float().unsqueeze(-1)
    count = w.sum(0).clamp_min(1.0)
    if average == "logits":
        log_probs = F.log_softmax((logits.float() * w).sum(0) / count / temperature, dim=-1)
    else:
        probs = (F.softmax(logits.float() / temperature, dim=-1) * w).sum(0) / count
        log_probs = probs.clamp_min(1e-30).log()
    return Teacher(log_probs=log_probs, mask=valid.any(0))


def confidence(logits: torch.Tensor, rule: str = "variance") -> torch.Tensor:
    """Per-position confidence of each teacher (shape of ``logits`` without the vocabulary axis), >= 0.

    variance: variance of the softmax (Fed-ET); entropy: log V - entropy (0 for a uniform teacher);
    maxprob: the top probability.
    """
    if rule not in CONFIDENCES:
        raise ValueError(f"confidence {rule!r} is not one of {', '.join(CONFIDENCES)}")
    log_p = F.log_softmax(logits.float(), dim=-1)
    p = log_p.exp()
    if rule == "variance":
        return p.var(dim=-1, unbiased=False)
    if rule == "maxprob":
        return p.amax(dim=-1)
    entropy = -(p * log_p).sum(-1)
    return (math.log(logits.shape[-1]) - entropy).clamp_min(0.0)


def fedet_teacher(
    logits: torch.Tensor, temperature: float = 1.0, rule: str = "variance", masks: torch.Tensor | None = None
) -> Teacher:
    """Fed-ET: confidence-weighted consensus of the teachers, plus the dissenters' mean as diversity target.

    At each position every valid teacher votes for its top token with its confidence; the teachers whose
    top token wins form the consensus, and the teacher is softmax(sum_k a_k z_k / T) with a_k their
    normalised confidences. Where some valid teachers dissent, ``diverse_log_probs`` is the mean of their
    distributions at ``T`` and ``diverse_mask`` is True.
    """
    valid = _check(logits, masks, temperature)
    z = logits.float()
    conf = confidence(z, rule) * valid + 1e-12 * valid  # ties among zero-confidence teachers stay valid
    top = z.argmax(-1)  # (K, ...)
    votes = torch.zeros(z.shape[1:], device=z.device).scatter_add_(-1, top.movedim(0, -1), conf.movedim(0, -1))
    winner = votes.argmax(-1)  # (...)
    agree = (top == winner.unsqueeze(0)) & valid
    alpha = conf * agree
    alpha = alpha / alpha.sum(0, keepdim=True).clamp_min(1e-30)
    log_probs = F.log_softmax((alpha.unsqueeze(-1) * z).sum(0) / temperature, dim=-1)
    dissent = valid & ~agree
    n_dissent = dissent.sum(0)
    probs = F.softmax(z / temperature, dim=-1) * dissent.unsqueeze(-1)
    diverse = (probs.sum(0) / n_dissent.clamp_min(1).unsqueeze(-1)).clamp_min(1e-30).log()
    return Teacher(log_probs=log_probs, mask=valid.any(0), diverse_log_probs=diverse, diverse_mask=n_dissent > 0)


def kd_loss(
    student_logits: torch.Tensor, teacher_log_probs: torch.Tensor, temperature: float = 1.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """T^2 * KL(teacher || softmax(student / T)), averaged over the (masked-in) positions.

    The T^2 factor (Hinton et al.) keeps the gradient scale independent of the temperature. A batch with
    no masked-in position gives 0 (and a zero gradient).
    """
    if student_logits.shape != teacher_log_probs.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher {tuple(teacher_log_probs.shape)} differ in shape")
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    p_t = teacher_log_probs.exp()
    per_pos = torch.where(p_t > 0, p_t * (teacher_log_probs - log_s), torch.zeros_like(p_t)).sum(-1)
    if mask is None:
        return temperature**2 * per_pos.mean()
    m = mask.to(per_pos.dtype)
    return temperature**2 * (per_pos * m).sum() / m.sum().clamp_min(1.0)


def _lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def distillation_loss(
    student_logits: torch.Tensor, labels: torch.Tensor, teacher: Teacher | None, temperature: float = 1.0,
    kd_weight: float = 1.0, diversity_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """kd_weight * (KD + diversity_weight * diversity KD) + (1 - kd_weight) * LM cross-entropy.

    ``kd_weight=1`` is pure distillation (FedDF); FedMKT mixes 0.1 KD with 0.9 LM (``kd_weight=0.1``);
    ``kd_weight=0`` is LM training alone and needs no teacher (``teacher`` may be None).
    Returns the loss and its parts as floats.
    """
    if not 0 <= kd_weight <= 1:
        raise ValueError(f"kd_weight must be in [0, 1], got {kd_weight}")
    if diversity_weight < 0:
        raise ValueError(f"diversity_weight must be >= 0, got {diversity_weight}")
    if kd_weight == 0:
        lm = _lm_loss(student_logits, labels)
        return lm, {"lm": lm.item()}
    if teacher is None:
        raise ValueError(f"kd_weight={kd_weight} needs a teacher")
    kd = kd_loss(student_logits, teacher.log_probs, temperature, teacher.mask)
    parts = {"kd": kd.item()}
    loss = kd
    if diversity_weight > 0 and teacher.diverse_log_probs is not None:
        div = kd_loss(student_logits, teacher.diverse_log_probs, temperature, teacher.diverse_mask)
        loss = loss + diversity_weight * div
        parts["diversity"] = div.item()
    loss = kd_weight * loss
    if kd_weight < 1:
        lm = _lm_loss(student_logits, labels)
        loss = loss + (1 - kd_weight) * lm
        parts["lm"] = lm.item()
    return loss, parts


TeacherFn = Callable[[torch.Tensor], Teacher]


@dataclass(frozen=True)
class DistillationLoss:
    """The distillation loss, a plug-in of :func:`fedfusion.train.loop.train_steps` on (transfer) token windows:
    :func:`distillation_loss` of the student against ``teacher_fn``'s :class:`Teacher` for the batch.

    ``teacher_fn(rows)`` gets the row indices of the batch (so per-window precomputed alignments can be looked up)
    and returns the :class:`Teacher` for ``windows[rows]`` inputs (``[:, :-1]``); it runs under ``no_grad`` and its
    ``flops`` are the step's forward work beyond the student. The parts of the loss (``kd``, ``lm``, ``diversity``
    where used) become the result's parts. With ``kd_weight=0`` no teacher runs: it is plain LM training."""

    teacher_fn: TeacherFn
    temperature: float = 1.0
    kd_weight: float = 1.0
    diversity_weight: float = 0.0
    what: str = "distillation"

    def __call__(self, model: PreTrainedModel, batch: torch.Tensor, rows: torch.Tensor) -> Step:
        teacher, flops = None, 0.0
        if self.kd_weight > 0:  # LM training alone (kd_weight=0) runs and charges no teacher
            with torch.no_grad():
                teacher = self.teacher_fn(rows)
            flops = teacher.flops
        _, logits = lm_loss(model, batch)
        loss, parts = distillation_loss(logits, batch[:, 1:].to(logits.device), teacher, self.temperature,
                                        self.kd_weight, self.diversity_weight)
        return Step(loss, batch.shape[0] * (batch.shape[1] - 1), parts=parts, flops=flops)


@dataclass(frozen=True)
class TopTokensLoss:
    """Top-k distillation, a plug-in of :func:`fedfusion.train.loop.train_steps`: the student's cross-entropy
    against a teacher given as each position's ``k`` likeliest tokens ``ids`` and their log-probabilities ``logp``
    ((n, seq_len, k), row-aligned with the training windows), renormalised over those ``k`` (the teacher's other
    tokens carry no target). The windows' own tokens are not used: the teacher's distribution replaces them."""

    ids: torch.Tensor
    logp: torch.Tensor
    what: str = "top-k distillation"

    def __call__(self, model: PreTrainedModel, batch: torch.Tensor, rows: torch.Tensor) -> Step:
        _, logits = lm_loss(model, batch)
        ids = self.ids[rows].long().to(logits.device)
        p_t = torch.softmax(self.logp[rows].float().to(logits.device), dim=-1)
        log_s = F.log_softmax(logits, dim=-1).gather(-1, ids)
        return Step(-(p_t * log_s).sum(-1).mean(), batch.shape[0] * (batch.shape[1] - 1))
