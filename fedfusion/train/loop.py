"""The one local training loop, its loss plug-ins' protocol and result, and evaluation of a causal LM (plain torch,
no Flower).

:func:`train_steps` is every local training there is (clients, the servers' distillation and generative folds, the
in-process driver): batches, forward and loss (a plug-in: :data:`LM` here, FjORD's ordered loss, the response-only
loss and the distillation loss beside their data in this package), backward, the optimizer step through
:func:`make_optimizer`, timing, token counting and the :class:`TrainResult`, each written once.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from fedfusion.config.choices import OPTIMIZERS
from fedfusion.data.text import scoring_batch
from fedfusion.devices.energy import train_flops
from fedfusion.models.frozen import FrozenTargetModel
from fedfusion.models.full_forward import WindowModel
from fedfusion.models.low_rank import LowRankModel
from fedfusion.train.dp import DpSgd, noise_generator, private_gradients


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
    """The local optimizer of the training loop, over the model's trainable parameters: AdamW, or plain SGD (see
    :data:`OPTIMIZERS`). ValueError for a model with no trainable parameter."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameter")
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)


def finite_loss(loss: torch.Tensor, what: str = "training") -> float:
    """The loss as a float, refused (FloatingPointError naming ``what`` loss) when it is not finite: the one check
    every training step makes before it touches the weights."""
    value = loss.item()
    if not math.isfinite(value):
        raise FloatingPointError(f"{what} loss became {value}")
    return value


def optimizer_step(opt: torch.optim.Optimizer, loss: torch.Tensor, what: str = "training") -> float:
    """The one local step every training loop takes: refuse a non-finite loss (:func:`finite_loss`), back-propagate
    and step (:func:`gradient_step`). Returns the loss."""
    value = finite_loss(loss, what)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    _update(opt)
    return value


def gradient_step(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                  grads: Sequence[torch.Tensor | None]) -> None:
    """The step of a loop that computes its gradients itself (DP-SGD's noisy mean, the units mode's micro-batches
    summed in order): ``params``' gradients set to ``grads`` (None: none), then the update :func:`optimizer_step`
    makes."""
    opt.zero_grad(set_to_none=True)
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    _update(opt)


def _update(opt: torch.optim.Optimizer) -> None:
    """The update from the gradients in place, for every step there is: clipping, a schedule or mixed precision go
    here, once."""
    opt.step()


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


@dataclass(frozen=True)
class Step:
    """One step's loss, as a loss plug-in computes it: what backward sees, the tokens the batch held and what the
    step reports.

    ``reported``: the step's loss as :attr:`TrainResult.losses` records it (None: ``loss`` itself; FjORD reports
    the sampled width's loss without its self-distillation terms); ``parts``: floats :class:`TrainResult` averages
    over the steps (the KD and LM parts of a distillation loss, the sampled width); ``flops``: forward work the
    loss spent beyond the student (teachers)."""

    loss: torch.Tensor
    tokens: int
    reported: float | None = None
    parts: Mapping[str, float] = field(default_factory=dict)
    flops: float = 0.0


class Loss(Protocol):
    """A loss plug-in of :func:`train_steps`: one step's :class:`Step` from the model and the batch ``data[rows]``
    (``rows``: the batch's indices into the data, for plug-ins that precompute per row, as teachers do).
    ``what`` names the loss in the error a non-finite loss raises."""

    @property
    def what(self) -> str: ...

    def __call__(self, model: Any, batch: Any, rows: torch.Tensor) -> Step: ...


@dataclass(frozen=True)
class LMLoss:
    """The language-model loss: next-token cross-entropy of token windows (:func:`lm_loss`)."""

    what: str = "training"

    def __call__(self, model: Any, batch: torch.Tensor, rows: torch.Tensor) -> Step:
        loss, _ = lm_loss(model, batch)
        return Step(loss, batch.shape[0] * (batch.shape[1] - 1))


@dataclass(frozen=True)
class TrainResult:
    """What every local training run returns, whatever its loss (the one result schema).

    ``losses``: every step's reported loss; ``tokens``: tokens trained on; ``seconds``: wall time of the loop;
    ``parts``: the loss plug-in's parts, each the mean over the steps (e.g. ``kd``, ``lm``, ``mean_fraction``);
    ``flops``: the training work, ``train_flops`` of the model's parameters and the tokens, plus the forward work
    the loss spent on teachers."""

    losses: tuple[float, ...]
    tokens: float
    seconds: float
    parts: Mapping[str, float] = field(default_factory=dict)
    flops: float = 0.0

    @property
    def loss(self) -> float:
        """The mean reported loss of the steps."""
        return sum(self.losses) / len(self.losses)

    def metrics(self) -> dict[str, float]:
        """The reply metrics of a client's training (``train_loss``, ``train_tokens``, ``train_s`` and the parts)."""
        return {"train_loss": self.loss, "train_tokens": self.tokens, "train_s": self.seconds, **self.parts}

    def cost(self) -> dict[str, float]:
        """The server's cost of this training as a fold reports it (:attr:`fedfusion.fusion.base.Fold.server_cost`)."""
        return {"flops": self.flops, "seconds": self.seconds, "tokens": self.tokens}


LM = LMLoss()


@dataclass(frozen=True)
class CoreLoss:
    """A full-forward window with a core (``fusion.core_forward: small``): the target's loss, which trains the
    window outside the core, plus the small model's own loss (:meth:`WindowModel.core_loss`), which alone trains the
    core. Reports the target's loss; ``core_loss`` is a part; the small model's work is counted in ``flops``."""

    what: str = "training"

    def __call__(self, model: Any, batch: torch.Tensor, rows: torch.Tensor) -> Step:
        full, _ = lm_loss(model, batch)
        small = model.core_loss(batch)
        tokens = batch.shape[0] * (batch.shape[1] - 1)
        return Step(full + small, tokens, reported=full.item(), parts={"core_loss": small.item()},
                    flops=train_flops(model.core_params(), tokens))


CORE = CoreLoss()


def loss_of(model: Any) -> Loss:
    """The loss plug-in a client's model trains with: :data:`CORE` for a window with a core, else :data:`LM`."""
    return CORE if isinstance(model, WindowModel) and model.has_core else LM


def train_steps(
    model: Any,
    data: Any,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    weight_decay: float = 0.0,
    optimizer: str = "adamw",
    checkpoint: bool = False,
    loss: Loss = LM,
    opt: torch.optim.Optimizer | None = None,
    dp: DpSgd | None = None,
) -> TrainResult:
    """The one local training loop: ``steps`` optimizer steps (:func:`make_optimizer`) of ``loss`` on random
    batches of ``data``.

    ``data``: token windows (n, seq_len + 1) for the language-model losses, or anything with ``len`` whose
    ``data[rows]`` is a batch the ``loss`` plug-in reads (:class:`fedfusion.train.instruct.InstructData`).
    ``loss``: :data:`LM` (default), :class:`fedfusion.train.ordered.OrderedLoss` (FjORD),
    :class:`fedfusion.train.instruct.ResponseLoss` (response tokens only) or
    :class:`fedfusion.train.distill.DistillationLoss` (against a teacher).
    ``checkpoint``: recompute each layer's activations in backward (:func:`checkpoint_activations`).
    ``optimizer``: ``adamw`` (default), or ``sgd`` (plain SGD: an update moves only what the batch's gradient
    touches, which a server-side outer optimizer can then scale; see :mod:`fedfusion.fusion.outer`).
    ``opt``: an optimizer over ``model``'s parameters to continue (its moments carry across calls, as the server's
    generative training keeps one across rounds) instead of a fresh one; ``optimizer``, ``lr`` and
    ``weight_decay`` are then its own.
    ``dp``: DP-SGD (:mod:`fedfusion.train.dp`): each step's gradient is the noisy mean of the batch's clipped
    per-example gradients (one example's backward at a time).

    Batches are drawn on the CPU with a seeded generator (the same batches on any accelerator) and
    moved to wherever ``model`` lives; dropout, where the model has any, follows ``seed`` too.
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be positive, got {steps}, {batch_size}")
    if isinstance(data, torch.Tensor) and (data.dim() != 2 or data.shape[1] < 2 or len(data) == 0):
        raise ValueError(f"windows must be (n, seq_len + 1) token ids, got shape {tuple(data.shape)}")
    gen = torch.Generator().manual_seed(seed)
    if checkpoint:
        checkpoint_activations(model)
    opt = opt if opt is not None else make_optimizer(model, optimizer, lr, weight_decay)
    model.train()
    start, losses, tokens, flops, sums = time.perf_counter(), list[float](), 0, 0.0, dict[str, float]()
    noise = noise_generator()  # used only by DP-SGD; never the round's seed (fedfusion.train.dp)
    with seeded_randomness(seed, model.device):
        for _ in range(steps):
            rows = torch.randint(len(data), (batch_size,), generator=gen)
            if dp is None:
                step = loss(model, data[rows], rows)
                value = optimizer_step(opt, step.loss, loss.what)
            else:
                step, value = _private_step(model, opt, loss, data, rows, dp, noise)
            losses.append(value if step.reported is None else step.reported)
            tokens += step.tokens
            flops += step.flops
            for key, part in step.parts.items():
                sums[key] = sums.get(key, 0.0) + part
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    return TrainResult(tuple(losses), float(tokens), seconds, {k: v / steps for k, v in sums.items()},
                       train_flops(params, tokens) + flops)


# per-example gradients of one chunk held at once: at most this many bytes (float32), so a large model's DP step
# takes a few examples at a time rather than a batch of whole-model gradients
CHUNK_BYTES = 256 * 2**20
_LOOPED: set[tuple[type, type]] = set()  # (model, loss) classes whose loss torch.func could not vmap: looped


def _vmappable(model: Any, loss: Loss) -> bool:
    """Whether DP-SGD vmaps this model's per-example gradients: the next-token loss (:data:`LM`) of the library's own
    model families and frozen-target wrappers, which the tests check against the loop; anything else (a peft model,
    another loss plug-in: :data:`CORE` reads its batch in Python) takes one example at a time, as a failure inside
    torch.func can be a crash rather than an exception."""
    from fedfusion.models.families import FAMILIES

    language = {t for family in FAMILIES if family.name != "cnn" for t in family.model_types}
    ours = isinstance(model, FrozenTargetModel) or (isinstance(model, PreTrainedModel)
                                                    and getattr(model.config, "model_type", None) in language)
    return ours and isinstance(loss, LMLoss) and (type(model), type(loss)) not in _LOOPED


class _LossOf(torch.nn.Module):
    """``loss`` of ``model`` as a module's forward, so :func:`torch.func.functional_call` can swap its parameters."""

    def __init__(self, model: Any, loss: Loss) -> None:
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, batch: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.loss(self.model, batch, rows).loss


def _vmapped_grads(model: Any, loss: Loss, batch: torch.Tensor, rows: torch.Tensor,
                   params: list[torch.Tensor]) -> Iterator[tuple[list[torch.Tensor], torch.Tensor]]:
    """Per-example gradients of ``params`` and losses, a chunk of examples at a time (:data:`CHUNK_BYTES`), each
    example's computed on its own by :func:`torch.func.vmap` over :func:`torch.func.grad` (no example sees
    another's)."""
    from torch.func import functional_call, grad_and_value, vmap

    names = {id(p): name for name, p in model.named_parameters()}
    keys = [f"model.{names[id(p)]}" for p in params]
    module = _LossOf(model, loss)

    def one(trained: dict[str, torch.Tensor], example: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        return functional_call(module, trained, (example.unsqueeze(0), row.unsqueeze(0)))

    per_example = vmap(grad_and_value(one), in_dims=(None, 0, 0), randomness="different")
    detached = {k: p.detach() for k, p in zip(keys, params)}
    chunk = max(1, CHUNK_BYTES // max(4 * sum(p.numel() for p in params), 1))
    for i in range(0, len(rows), chunk):
        with warnings.catch_warnings():  # attention ops without a batching rule run per example: slower, not wrong
            warnings.filterwarnings("ignore", message="There is a performance drop")
            grads, values = per_example(detached, batch[i: i + chunk], rows[i: i + chunk])
        yield [grads[k] for k in keys], values


def _looped_grads(model: Any, loss: Loss, data: Any, rows: torch.Tensor,
                  params: list[torch.Tensor]) -> Iterator[tuple[list[torch.Tensor], torch.Tensor]]:
    """Per-example gradients of ``params`` and losses, one example's backward at a time (any loss plug-in)."""
    for i in range(len(rows)):
        one = loss(model, data[rows[i: i + 1]], rows[i: i + 1])
        raw = torch.autograd.grad(one.loss, params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, raw)]
        yield [g.unsqueeze(0) for g in grads], one.loss.detach().reshape(1)


def _private_step(model: Any, opt: torch.optim.Optimizer, loss: Loss, data: Any, rows: torch.Tensor, dp: DpSgd,
                  noise: torch.Generator) -> tuple[Step, float]:
    """One DP-SGD step on the batch ``data[rows]``: the gradient :func:`fedfusion.train.dp.private_gradients` of
    its examples' gradients, vmapped (:func:`_vmapped_grads`) where :func:`_vmappable` allows it, one example at a time
    otherwise (and from then on, for that model and loss, if torch.func raises); the step reports the batch's loss
    and tokens as a plain step would."""
    params = [p for group in opt.param_groups for p in group["params"] if p.requires_grad]
    batch = data[rows]
    key = (type(model), type(loss))

    def chunks(source: Iterator[tuple[list[torch.Tensor], torch.Tensor]]) -> Iterator[list[torch.Tensor]]:
        for grads, values in source:
            if not bool(torch.isfinite(values).all()):
                raise FloatingPointError(f"{loss.what} loss became {values[~torch.isfinite(values)][0].item()}")
            yield grads

    grads = None
    if isinstance(batch, torch.Tensor) and _vmappable(model, loss):
        try:
            grads = private_gradients(params, chunks(_vmapped_grads(model, loss, batch, rows, params)), len(rows), dp,
                                      noise)
        except FloatingPointError:
            raise
        except Exception as exc:  # an op torch.func cannot batch (data-dependent control flow, .item()): loop
            _LOOPED.add(key)
            warnings.warn(f"DP-SGD: per-example gradients one example at a time for {key[0].__name__} with "
                          f"{key[1].__name__} (torch.func could not vmap it: {str(exc).splitlines()[0][:200]})",
                          stacklevel=2)
    if grads is None:
        grads = private_gradients(params, chunks(_looped_grads(model, loss, data, rows, params)), len(rows), dp, noise)
    with torch.no_grad():  # what the step reports: the batch's tokens, parts and extra work, as a plain step's
        plain = loss(model, batch, rows)
    gradient_step(opt, params, grads)
    step = Step(plain.loss, plain.tokens, reported=plain.reported, parts=plain.parts, flops=plain.flops)
    return step, float(plain.loss)


@torch.no_grad()
def evaluate_lm(model: PreTrainedModel, windows: torch.Tensor, batch_size: int = 64) -> dict[str, float]:
    """Mean next-token loss, perplexity and accuracy over every position of ``windows``."""
    model.eval()
    batch_size = scoring_batch(batch_size, windows.shape[1], getattr(getattr(model, "config", None), "vocab_size", 0))
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
