"""Local training and evaluation of a causal LM on token windows (plain torch, no Flower)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import PreTrainedModel

from fedfusion.config.choices import OPTIMIZERS
from fedfusion.data.text import sample_batch
from fedfusion.models.frozen import FrozenTargetModel
from fedfusion.models.full_forward import WindowModel
from fedfusion.models.low_rank import LowRankModel


def lm_loss(model: PreTrainedModel | WindowModel | LowRankModel, batch: torch.Tensor,
            reduction: str = "mean") -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy of ``batch`` windows (input = [:, :-1], target = [:, 1:]) and the logits."""
    batch = batch.to(model.device)
    inputs, labels = batch[:, :-1], batch[:, 1:]
    logits = model(input_ids=inputs).logits.float()
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction=reduction
    )
    return loss, logits


def make_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The local optimizer every training loop uses: AdamW, or plain SGD (see :data:`OPTIMIZERS`)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}")
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    return torch.optim.SGD(model.parameters(), lr=lr, weight_decay=weight_decay)


def optimizer_step(opt: torch.optim.Optimizer, loss: torch.Tensor, what: str = "training") -> float:
    """The one local step every training loop takes: refuse a non-finite loss (naming ``what`` loss), zero the
    gradients, back-propagate and step. Returns the loss. Clipping, a schedule or mixed precision go here, once."""
    value = loss.item()
    if not math.isfinite(value):
        raise FloatingPointError(f"{what} loss became {value}")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return value


def checkpoint_activations(model: PreTrainedModel | FrozenTargetModel) -> None:
    """Turn on activation checkpointing (Hugging Face's, non-reentrant: the frozen target's inputs need no grad) in
    ``model`` or a window's frozen target. ValueError for a model that has none (the CNN)."""
    base = model.target() if isinstance(model, FrozenTargetModel) else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(f"train.checkpoint: {type(base).__name__} has no activation checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.2x; the older name warns there
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@contextmanager
def seeded_randomness(seed: int, device: torch.device) -> Iterator[None]:
    """Run the block with torch's global generators (the CPU's and ``device``'s) seeded by ``seed``, restoring
    them after: dropout draws from the global generator, so without this a client's training would depend on
    what its process ran before (a Ray actor serves many clients, in an order that changes between runs)."""
    accelerators = [device.index or 0] if device.type in ("cuda", "mps") else []
    with torch.random.fork_rng(devices=accelerators, device_type=device.type if accelerators else "cuda"):
        torch.manual_seed(seed)
        yield


def train_steps(
    model: PreTrainedModel | WindowModel | LowRankModel,
    windows: torch.Tensor,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    weight_decay: float = 0.0,
    optimizer: str = "adamw",
    checkpoint: bool = False,
) -> dict[str, float]:
    """Run ``steps`` optimizer steps on random batches of ``windows``; returns mean loss, tokens, seconds.

    ``checkpoint``: recompute each layer's activations in backward (:func:`checkpoint_activations`).
    ``optimizer``: ``adamw`` (default), or ``sgd`` (plain SGD: an update moves only what the batch's gradient
    touches, which a server-side outer optimizer can then scale; see :mod:`fedfusion.fusion.outer`).

    Batches are drawn on the CPU with a seeded generator (the same batches on any accelerator) and
    moved to wherever ``model`` lives; dropout, where the model has any, follows ``seed`` too.
    """
    gen = torch.Generator().manual_seed(seed)
    if checkpoint:
        checkpoint_activations(model)
    opt = make_optimizer(model, optimizer, lr, weight_decay)
    model.train()
    start, total = time.perf_counter(), 0.0
    with seeded_randomness(seed, model.device):
        for _ in range(steps):
            batch = sample_batch(windows, batch_size, gen)
            loss, _ = lm_loss(model, batch)
            total += optimizer_step(opt, loss)
    return {
        "train_loss": total / steps,
        "train_tokens": float(steps * batch_size * (windows.shape[1] - 1)),
        "train_s": time.perf_counter() - start,
    }


@torch.no_grad()
def evaluate_lm(model: PreTrainedModel, windows: torch.Tensor, batch_size: int = 64) -> dict[str, float]:
    """Mean next-token loss, perplexity and accuracy over every position of ``windows``."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for i in range(0, windows.shape[0], batch_size):
        batch = windows[i : i + batch_size]
        loss, logits = lm_loss(model, batch, reduction="sum")
        labels = batch[:, 1:].to(logits.device)
        loss_sum += loss.item()
        correct += int((logits.argmax(-1) == labels).sum())
        count += labels.numel()
    mean = loss_sum / count
    return {"eval_loss": mean, "eval_ppl": math.exp(min(mean, 50.0)), "eval_acc": correct / count}
