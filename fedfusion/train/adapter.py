"""One client's LoRA training on a frozen base, as the LoRA client role and the in-process LoRA loop both run it:
the frozen global update hooked onto the base, a fresh peft adapter of the client's rank with the received
factors in front, :func:`fedfusion.train.loop.train_steps`, and the adapter removed from the base again (so one
cached base serves every rank)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from fedfusion.models.adapters import adapter_factors, attach_adapter, load_factors, merged_update
from fedfusion.train.dp import DpSgd
from fedfusion.train.loop import LM, Loss, TrainResult, train_steps


@dataclass(frozen=True)
class AdapterSetting:
    """The adapter a client trains: rank, LoRA alpha (scaling alpha / rank), the base modules it adapts, dropout."""

    rank: int
    alpha: float
    modules: tuple[str, ...]
    dropout: float = 0.0


def train_adapter(base: PreTrainedModel, arrays: dict[str, torch.Tensor], data: Any, adapter: AdapterSetting,
                  seed: int, *, steps: int, lr: float, batch_size: int, weight_decay: float = 0.0,
                  loss: Loss = LM, dp: DpSgd | None = None,
                  meter: AbstractContextManager[Any] | None = None) -> tuple[dict[str, torch.Tensor], TrainResult]:
    """Train ``adapter`` on ``data`` from the received ``arrays`` (``m.lora_A``/``m.lora_B`` to start from, and any
    frozen ``m.merged_*`` update); returns the trained factors, in the order received where factors were sent, and
    the loop's result. ``meter`` (the host's meters) is entered around the training steps alone. ``base`` is left as
    it was."""
    with merged_update(base, arrays):  # hooks sit on the base layers, which peft keeps as base_layer
        model = attach_adapter(base, adapter.rank, adapter.alpha, list(adapter.modules), adapter.dropout, seed)
        try:
            load_factors(model, arrays)
            with meter or nullcontext():
                result = train_steps(model, data, steps=steps, lr=lr, batch_size=batch_size, seed=seed,
                                     weight_decay=weight_decay, loss=loss, dp=dp)
            factors = adapter_factors(model)
        finally:
            model.unload()  # the base loses the adapter layers again
    sent = [k for k in arrays if k.endswith((".lora_A", ".lora_B"))]
    if sent:  # reply in the order received: Flower's DP mods compare the key lists as sent
        factors = {k: factors[k] for k in sent}
    return factors, result
