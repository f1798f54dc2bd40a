"""What a client process keeps between messages: the models it built, reloaded with each message's weights.

In simulation a Ray actor serves many client messages over a run (Flower's actors persist across rounds), and a
client role used to build a fresh, randomly initialised model for every message only to overwrite every weight
with the message's. :data:`MODELS` keeps the last few built models per process, keyed by what determines the
object (the role, the model's config as the message carries it, the accelerator, activation checkpointing); a
message whose key is cached gets that model with the message's whole state loaded into it (``strict``: every
parameter and persistent buffer is overwritten), so what it trains and replies is exactly what a fresh model
would give: training seeds its own generators (``fedfusion.train.loop.seeded_randomness``), the optimizer is
built fresh per message, and :meth:`ModelCache.model` drops the previous message's gradients.

The tokenised client data was already cached per process (``fedfusion.data.population.client_windows``,
``clients.smallmodel.family_windows``, ``clients.lora.client_data``), and so is a LoRA role's frozen base.

Memory: at most :data:`MAX_MODELS` models and :data:`MAX_BYTES` of their parameters and buffers per process
(least recently used first out; a model larger than the byte budget is never kept). ``FEDFUSION_CLIENT_CACHE=0``
in the environment of the run (Ray actors inherit it) builds every model afresh, as before; the benchmark
``benchmarks/overhead.py`` compares the two.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

from fedfusion.models.build import full_state, tied_aliases

ENV = "FEDFUSION_CLIENT_CACHE"  # "0": no model cache (every message builds its model)
MAX_MODELS = 4  # a quickstart actor meets 3 slice shapes (phone, laptop, desktop); a mixed one also a family model
MAX_BYTES = 512 * 2**20


def enabled() -> bool:
    """Whether this process keeps built models (``FEDFUSION_CLIENT_CACHE`` is not ``0``)."""
    return os.environ.get(ENV, "1").strip() != "0"


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's distinct parameters and buffers (its gradients may add as much again)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


class ModelCache:
    """A small LRU of built models; :meth:`model` returns one holding a message's state."""

    def __init__(self, max_models: int = MAX_MODELS, max_bytes: int = MAX_BYTES) -> None:
        self.max_models, self.max_bytes = max_models, max_bytes
        self.models: OrderedDict[Hashable, tuple[torch.nn.Module, dict[str, str], int]] = OrderedDict()
        self.hits = self.misses = 0

    def model(self, key: Hashable, build: Callable[[], torch.nn.Module], state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """The model for ``key`` holding ``state`` (with or without its tied aliases): the cached one, its weights
        and persistent buffers all overwritten by ``state``, or ``build()`` (which must load ``state`` itself)."""
        if not enabled() or self.max_models <= 0:
            return build()
        kept = self.models.get(key)
        if kept is None:
            self.misses += 1
            model = build()
            size = model_bytes(model)
            if size <= self.max_bytes:
                self.models[key] = (model, tied_aliases(model), size)
                self._evict()
            return model
        self.hits += 1
        self.models.move_to_end(key)
        model, aliases, _ = kept
        model.zero_grad(set_to_none=True)  # the last message's gradients: memory, never read (a step zeroes first)
        model.load_state_dict(full_state(state, aliases), strict=True)
        return model

    def _evict(self) -> None:
        while self.models and (len(self.models) > self.max_models or
                               sum(size for _, _, size in self.models.values()) > self.max_bytes):
            self.models.popitem(last=False)

    def clear(self) -> None:
        """Forget every kept model."""
        self.models.clear()


MODELS = ModelCache()  # this process's (one per Ray actor, one per deployed node's message process)
