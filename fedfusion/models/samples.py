"""Generative (data-free) distillation: each client's own small model writes text, the target learns from it.

Public transfer text cannot carry a client's private facts, and averaging parameters of models trained on
disjoint facts dilutes every client's contribution. Here each client keeps a small model of its own (never
averaged), trains it on its own data, and sends the server a batch of token windows sampled from it (from
``<bos>``, like its training windows). The server trains the target on the latest samples of every client it
has heard from, so knowledge moves as text and the target's size is free of the clients'.

What this reveals: the samples are drawn from a model fitted to the client's private documents, so they
carry the client's facts almost verbatim (that is why they teach the target). Treat them as the client's
data: this method trades the privacy of parameter averaging for recall, and differential privacy on the
small model's training is the remedy, not anything here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from fedfusion.models.build import generate

SAMPLES_KEY = "generated-ids"  # the reply's ArrayRecord key for the sampled token ids, next to the model's keys


@dataclass(frozen=True)
class GenerativeConfig:
    """Settings of generative distillation."""

    sample_fraction: float = 0.5  # a sampled client writes this many windows per window of its own data
    temperature: float = 1.0
    server_steps: int = 30  # target steps per round on the pooled samples
    server_lr: float = 3e-3
    server_batch: int = 64
    max_windows: int = 4096  # the most training windows the server credits a client with (its samples and pool share)

    def __post_init__(self) -> None:
        if self.server_steps < 1 or self.server_batch < 1 or self.max_windows < 1:
            raise ValueError(f"server_steps, server_batch and max_windows must be >= 1, got {self}")
        if not self.sample_fraction > 0:
            raise ValueError(f"sample_fraction must be > 0, got {self.sample_fraction}")
        if not self.temperature > 0 or not self.server_lr > 0:
            raise ValueError(f"temperature and server_lr must be > 0, got {self.temperature}, {self.server_lr}")


@torch.no_grad()
def sample_windows(model: PreTrainedModel, own: torch.Tensor, n: int, temperature: float,
                   seed: int) -> torch.Tensor:
    """``n`` windows shaped like ``own`` (the client's training windows) sampled from ``model`` (ancestral
    sampling, KV-cached), each opened by the first token of a random own window (``<bos>`` for facts); seeded
    without touching the caller's global random state."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    start = own[torch.randint(len(own), (n,), generator=gen), :1].to(model.device)
    width = own.shape[1]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return generate(model, input_ids=start, attention_mask=torch.ones_like(start), do_sample=True,
                        temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=width - 1,
                        min_new_tokens=width - 1, pad_token_id=int(start[0, 0])).cpu()


def check_samples(samples: torch.Tensor, width: int, vocab: int, most: int) -> None:
    """Raise ValueError unless ``samples`` are at most ``most`` windows of ``width`` token ids in [0, vocab)."""
    if samples.dtype not in (torch.int32, torch.int64) or samples.dim() != 2 or samples.shape[1] != width:
        raise ValueError(f"samples must be (n, {width}) integer token ids, got {tuple(samples.shape)} {samples.dtype}")
    if not 0 < samples.shape[0] <= most:
        raise ValueError(f"{samples.shape[0]} sampled windows; expected 1 to {most}")
    if int(samples.min()) < 0 or int(samples.max()) >= vocab:
        raise ValueError(f"sampled token ids outside the vocabulary [0, {vocab})")


class SamplePool:
    """Every client's most recent samples, at most ``cap[client]`` windows each (oldest dropped first): what the
    server trains the target on. A client's newer samples come from a better-trained model."""

    def __init__(self) -> None:
        self.kept: dict[int, torch.Tensor] = {}

    def add(self, client: int, windows: torch.Tensor, cap: int) -> None:
        """Append ``client``'s new samples, keeping its newest ``cap``."""
        old = self.kept.get(client)
        joined = windows if old is None else torch.cat([old, windows])
        self.kept[client] = joined[-cap:]

    def windows(self) -> torch.Tensor:
        """All clients' kept samples as one tensor (client order)."""
        if not self.kept:
            raise ValueError("no client has sent samples yet")
        return torch.cat([self.kept[c] for c in sorted(self.kept)])
