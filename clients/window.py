"""Client role for full-forward windows: rebuild the whole target from the message (frozen, as it travelled) with
the window's exact values written in, train only the window with the target's own loss, reply the window."""

from __future__ import annotations

import torch
from fedfusion.clients.node import Stateless
from fedfusion.clients.submodel import _windows, evaluate, inject_faults, local_steps, num_examples, set_threads, trained_reply
from flwr.app import ConfigRecord

from fedfusion.models.families import config_from_dict
from fedfusion.models.full_forward import from_payload
from fedfusion.train.loop import loss_of, train_steps
from fedfusion.wire.specs import ModelSpec, RoundSpec, TrainSpec, WindowSpec

__all__ = ["Node", "evaluate", "num_examples", "train"]

Node = Stateless  # this role keeps nothing on its node (fedfusion.clients.node)


def train(state: dict[str, torch.Tensor], spec: ConfigRecord, partition: int, accelerator: str = "cpu",
          node: Stateless | None = None) -> tuple[dict, dict]:
    """Train the window of the target in ``state`` as ``spec`` says; returns the window's values and metrics."""
    faults = inject_faults(spec, partition)  # an injected crash happens before any work
    set_threads(spec)
    windows = _windows(spec, partition, "train")
    config = config_from_dict(ModelSpec.from_config(spec).model_config)
    model = from_payload(config, state, WindowSpec.from_config(spec), RoundSpec.from_config(spec).seed).to(accelerator)
    checkpoint = TrainSpec.from_config(spec).checkpoint
    return trained_reply(model, windows, faults, lambda: train_steps(model, windows, checkpoint=checkpoint,
                                                                 loss=loss_of(model), **local_steps(spec)),
                         lambda: {k: v.cpu() for k, v in model.trained().items()})
