"""FjORD's ordered dropout on a client's sub-model: nested prefixes trained step by step.

Under the ``ordered`` policy the server sends a client the static prefix of its maximum width p_max
(exactly as HeteroFL would) and aggregates it the same way. The difference is local: each step the
client samples a width p <= p_max from a ladder and trains only the first units of its sub-model that a
width-p model keeps, a nested prefix. Every prefix is a genuine smaller model of the family, obtained
with the slicing engine's own (differentiable) :func:`~fedfusion.models.slicing.extract`, so the HeteroFL
scaler stays consistent at every width and gradients flow straight into the sub-model's parameters;
units outside the sampled prefix get zero gradient that step. Optional self-distillation (FjORD's KD)
adds the widest pass as a teacher: loss = CE(p_max) + CE(p) + KL(p_max || p).

Widths: the ladder is given as fractions of the *target* (e.g. the recipe's tier widths, or FjORD's
0.2, 0.4, ..., 1.0); :func:`ordered_fractions` turns them into fractions of the sub-model. A nested
prefix keeps ceil(q * n) of the sub-model's n units, which can exceed FjORD's ceil(p * K) by one unit.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.func import functional_call
from transformers import PreTrainedModel

from fedfusion.models.families import family_of
from fedfusion.models.slicing import SlicePlan, extract, plan_slice, sub_config
from fedfusion.train.loop import Step


def ordered_fractions(max_width: float, ladder: Iterable[float]) -> tuple[float, ...]:
    """The widths a client of ``max_width`` samples from, as fractions of its own sub-model (sorted, 1.0 last).

    Every ladder width (a fraction of the target) at most ``max_width`` is kept; ``max_width`` itself is
    always included.
    """
    if not 0 < max_width <= 1:
        raise ValueError(f"max_width must be in (0, 1], got {max_width}")
    bad = [w for w in ladder if not 0 < w <= 1]
    if bad:
        raise ValueError(f"ladder widths must be in (0, 1], got {bad}")
    return tuple(sorted({round(w / max_width, 9) for w in ladder if w <= max_width} | {1.0}))


def nested_plan(config, fraction: float, axes: Iterable[str] | None = None) -> SlicePlan:
    """The prefix of a (sub-)model of ``config`` that width ``fraction`` keeps (static, hence nested)."""
    return plan_slice(config, fraction, "static", axes=axes)


class OrderedDropout:
    """Runs a model at any width of its ladder, as a nested prefix of its own live parameters.

    ``od(fraction, **inputs)`` is the forward pass of the prefix model (``fraction`` 1.0 = the model
    itself); its loss backpropagates into ``model``'s parameters. ``sample()`` draws a fraction uniformly
    from the ladder (seeded), as FjORD does per step.
    """

    def __init__(self, model: PreTrainedModel, fractions: Iterable[float], axes: Iterable[str] | None = None,
                 seed: int = 0) -> None:
        self.model = model
        self.fractions = tuple(sorted(set(fractions)))
        if not self.fractions or not all(0 < f <= 1 for f in self.fractions):
            raise ValueError(f"fractions must be in (0, 1], got {self.fractions}")
        family = family_of(model.config)
        self.plans = {f: nested_plan(model.config, f, axes) for f in self.fractions if f < 1}
        self.shells = {f: family.build(sub_config(model.config, p)) for f, p in self.plans.items()}
        self.rng = random.Random(seed)

    def sample(self) -> float:
        """One width of the ladder, uniformly."""
        return self.rng.choice(self.fractions)

    def nested_state(self, fraction: float) -> dict[str, torch.Tensor]:
        """The prefix model's parameters as differentiable slices of the model's parameters."""
        return extract(dict(self.model.named_parameters()), self.model.config, self.plans[fraction])

    def __call__(self, fraction: float, *args, **kwargs):
        if fraction == 1.0:
            return self.model(*args, **kwargs)
        if fraction not in self.plans:
            raise ValueError(f"fraction {fraction} is not on the ladder {self.fractions}")
        shell = self.shells[fraction].train(self.model.training)
        return functional_call(shell, self.nested_state(fraction), args, kwargs)


def _lm_logits(od: OrderedDropout, fraction: float, batch: torch.Tensor) -> torch.Tensor:
    return od(fraction, input_ids=batch[:, :-1]).logits.float()


def _ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


@dataclass(frozen=True)
class OrderedLoss:
    """FjORD's loss, a plug-in of :func:`fedfusion.train.loop.train_steps`: each step trains one nested width
    sampled from ``od``'s ladder (the step reports that width's loss, and its width as the ``mean_fraction`` part).
    ``distill``: self-distillation from the widest pass, loss = CE(p) + CE(p_max) + KL(p_max || p)."""

    od: OrderedDropout
    distill: bool = False
    what: str = "training"

    def __call__(self, model: PreTrainedModel, batch: torch.Tensor, rows: torch.Tensor) -> Step:
        labels = batch[:, 1:]
        fraction = self.od.sample()
        logits = _lm_logits(self.od, fraction, batch)
        loss = _ce(logits, labels)
        reported = loss.item()
        if self.distill and fraction < 1.0:
            teacher = _lm_logits(self.od, 1.0, batch)
            kl = torch.nn.functional.kl_div(
                torch.log_softmax(logits, -1).flatten(0, 1), torch.log_softmax(teacher.detach(), -1).flatten(0, 1),
                log_target=True, reduction="batchmean",
            )
            loss = loss + _ce(teacher, labels) + kl
        return Step(loss, labels.numel(), reported, {"mean_fraction": fraction})


def ordered_loss(model: PreTrainedModel, fractions: Iterable[float], axes: Iterable[str] | None = None,
                 distill: bool = False, seed: int = 0) -> OrderedLoss:
    """FjORD's loss for ``model`` over the ladder ``fractions`` (:class:`OrderedDropout`, its width draws seeded by
    ``seed``: pass the training's seed)."""
    return OrderedLoss(OrderedDropout(model, fractions, axes, seed), distill)
