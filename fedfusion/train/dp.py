"""DP-SGD on a device (Abadi et al., 2016) and its privacy accounting (plain torch, no Flower).

A private step computes every example's gradient on its own, clips it to ``clip`` in L2 norm over all trainable
tensors, sums them, adds Gaussian noise of standard deviation ``noise_multiplier * clip`` and divides by the
batch size; the optimizer then steps on that. An example is one training window of the client's data (``seq_len``
tokens): a document spread over several windows is protected as a group, at a proportionally weaker guarantee.

The noise is drawn from a generator seeded by the operating system, never by the round's seed: the server chooses
that seed, and noise it could reproduce would protect nothing. A private run is therefore not bit-for-bit
repeatable.

Accounting (:func:`epsilon_spent`) is Opacus' Rényi-DP accountant over the client's whole history of steps, each
with its sampling rate ``batch_size / examples``. Batches are drawn uniformly with replacement; the accountant's
analysis is for Poisson sampling at the same rate, the approximation DP-SGD implementations usually make.
"""

from __future__ import annotations

import importlib
import logging
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType

import torch


@dataclass(frozen=True)
class DpSgd:
    """The private step's two settings: the per-example L2 clipping bound and the noise multiplier."""

    clip: float
    noise_multiplier: float

    def __post_init__(self) -> None:
        if not self.clip > 0 or not self.noise_multiplier > 0:
            raise ValueError(f"DP-SGD needs clip > 0 and noise_multiplier > 0, got {self.clip}, {self.noise_multiplier}")


def noise_generator() -> torch.Generator:
    """A CPU generator seeded from the operating system's entropy (see the module docstring)."""
    return torch.Generator().manual_seed(secrets.randbits(63))


def private_gradients(params: Sequence[torch.Tensor], example_grads: Iterable[Sequence[torch.Tensor]],
                      batch_size: int, dp: DpSgd, noise: torch.Generator) -> list[torch.Tensor]:
    """The noisy mean of the clipped per-example gradients of ``params``. ``example_grads`` yields the examples'
    gradients in chunks, one tensor per parameter with the chunk's examples along a leading dim (a chunk of one
    where they are computed one at a time); each example's gradient is clipped to ``dp.clip`` in L2 over all
    tensors."""
    total = [torch.zeros_like(p) for p in params]
    for chunk in example_grads:
        norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1, dtype=torch.float64).pow(2)
                             for g in chunk]).sum(0).sqrt()
        scale = (dp.clip / (norms + 1e-12)).clamp(max=1.0)
        for t, g in zip(total, chunk):
            t.add_(torch.einsum("k,k...->...", scale.to(g.dtype), g))
    sd = dp.noise_multiplier * dp.clip
    for t in total:
        t.add_(torch.randn(t.shape, generator=noise, dtype=torch.float32).to(t.device, t.dtype), alpha=sd)
        t.div_(batch_size)
    return total


def opacus_module(name: str) -> ModuleType:
    """An Opacus module (the server's only use of Opacus is its accountant, imported when first needed), without the
    root logging handler that importing Opacus installs (``logging.basicConfig`` in ``opacus.utils.module_utils``):
    Flower's logger passes its records on to the root, so with that handler every log line of the run printed twice."""
    root = logging.getLogger()
    before = list(root.handlers)
    module = importlib.import_module(name)
    for handler in [h for h in root.handlers if h not in before]:
        root.removeHandler(handler)
    return module


def epsilon_spent(history: Sequence[tuple[float, float, int]], delta: float) -> float:
    """The epsilon at ``delta`` of a client's whole DP-SGD history: (noise multiplier, sampling rate, steps) per
    round it trained (Opacus' RDP accountant). 0 for an empty history."""
    if not history:
        return 0.0
    accountant = opacus_module("opacus.accountants").RDPAccountant()
    accountant.history = [(float(sigma), min(float(q), 1.0), int(steps)) for sigma, q, steps in history]
    return float(accountant.get_epsilon(delta))


@lru_cache(maxsize=4096)
def calibrated_noise(epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """The smallest noise multiplier whose ``steps`` steps at ``sample_rate`` spend at most ``epsilon`` at ``delta``
    (Opacus' search over its RDP accountant, to 0.01 in epsilon); cached, as clients often share their rate."""
    get_noise_multiplier = opacus_module("opacus.accountants.utils").get_noise_multiplier
    return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate,
                                      steps=steps, accountant="rdp"))


@dataclass
class ClientBudgets:
    """Each client's DP-SGD history (by partition) and what it has spent at ``delta``, against a run's budget
    ``epsilon``: the server's side of ``privacy.mode=dp_sgd``. Plain data, so a checkpoint keeps it.

    ``noise_multiplier`` 0 calibrates each client's noise instead (:meth:`sigma`): the smallest that keeps
    ``rounds`` rounds of its work (its sampling rate, its steps) within ``epsilon``, so a client sampled as often
    as expected spends its budget by the run's end, and one sampled more often is left out once it would pass it."""

    noise_multiplier: float
    delta: float
    epsilon: float
    history: dict[int, list[tuple[float, float, int]]]
    rounds: int = 0  # auto noise: the rounds a client's budget is spread over (its expected participation; 0: unset)

    def spent(self, partition: int) -> float:
        """Epsilon spent by ``partition`` so far."""
        return epsilon_spent(self.history.get(partition, []), self.delta)

    def after(self, partition: int, examples: int, batch_size: int, steps: int) -> float:
        """Epsilon ``partition`` would have spent after ``steps`` more steps of ``batch_size`` of its ``examples``."""
        return epsilon_spent([*self.history.get(partition, []), self._entry(examples, batch_size, steps)], self.delta)

    def spend(self, partition: int, examples: int, batch_size: int, steps: int) -> float:
        """Record a round ``partition`` trained; returns its epsilon now."""
        self.history.setdefault(partition, []).append(self._entry(examples, batch_size, steps))
        return self.spent(partition)

    def sigma(self, examples: int, batch_size: int, steps: int) -> float:
        """The noise multiplier of a round of ``steps`` steps of ``batch_size`` of ``examples``: the run's, or
        (auto) the one calibrated to spend ``epsilon`` over ``rounds`` such rounds."""
        if self.noise_multiplier:
            return self.noise_multiplier
        if self.rounds < 1:
            raise ValueError("auto noise (noise_multiplier 0) needs the rounds each client's budget is spread over")
        return calibrated_noise(self.epsilon, self.delta, min(1.0, batch_size / max(examples, 1)), steps * self.rounds)

    def _entry(self, examples: int, batch_size: int, steps: int) -> tuple[float, float, int]:
        return (self.sigma(examples, batch_size, steps), min(1.0, batch_size / max(examples, 1)), steps)
