"""Client role for generative distillation: train this device's own small model, then write samples of it.

The reply carries the trained model (so a stateless deployed node gets it back next round) and, under
``fedfusion.models.samples.SAMPLES_KEY``, the sampled token windows the server trains the target on (and, with
``generative.top_k``, each position's likeliest tokens under ``TEACHER_KEYS``).
"""

from __future__ import annotations

import torch
from fedfusion.clients.submodel import (
    _model,
    _windows,
    evaluate,
    inject_faults,
    local_steps,
    num_examples,
    set_threads,
    trained_reply,
)
from flwr.app import ConfigRecord

from fedfusion.models.samples import samples_reply
from fedfusion.train.loop import train_steps
from fedfusion.wire.specs import GenerativeSpec, RoundSpec

__all__ = ["evaluate", "num_examples", "train"]


def train(state: dict[str, torch.Tensor], spec: ConfigRecord, partition: int,
          accelerator: str = "cpu") -> tuple[dict, dict]:
    """Train the device's model in ``state`` as ``spec`` says, then sample the windows its
    :class:`~fedfusion.wire.specs.GenerativeSpec` asks for from it."""
    faults = inject_faults(spec, partition)
    ask = GenerativeSpec.from_config(spec)
    set_threads(spec)
    windows = _windows(spec, partition, "train")
    model = _model(state, spec, accelerator)
    new_state, metrics = trained_reply(model, windows, faults, lambda: train_steps(model, windows, **local_steps(spec)))
    new_state.update(samples_reply(model, windows, ask, RoundSpec.from_config(spec).seed))
    return new_state, metrics
