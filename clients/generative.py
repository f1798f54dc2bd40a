"""Client role for generative distillation: train this device's own small model, then write samples of it.

It returns the trained model and, under ``fedfusion.models.samples.SAMPLES_KEY``, the sampled token windows the
server trains the target on (and, with ``generative.top_k``, each position's likeliest tokens under
``TEACHER_KEYS``). With ``generative.device_state=server`` all of it is the reply (the server sends the model back
next round); with ``node`` the client app keeps the model in the node's ``context.state`` and replies the samples.
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

from fedfusion.models.samples import SAMPLES_KEY, samples_reply
from fedfusion.train.loop import train_steps
from fedfusion.wire.specs import GenerativeSpec, RoundSpec

__all__ = ["evaluate", "num_examples", "train"]


def train(state: dict[str, torch.Tensor], spec: ConfigRecord, partition: int,
          accelerator: str = "cpu") -> tuple[dict, dict]:
    """Train the device's model in ``state`` as ``spec`` says, then sample the windows its
    :class:`~fedfusion.wire.specs.GenerativeSpec` asks for from it; returns the trained model with the samples, and
    metrics. An injected corruption (``faults.corrupt_prob``) hits what goes up: the model with ``device_state``
    server, the samples with node (whose model stays on the node, unharmed), so the server rejects the reply either
    way."""
    corrupt, delay = inject_faults(spec, partition)
    ask = GenerativeSpec.from_config(spec)
    on_node = ask.device_state == "node"
    set_threads(spec)
    windows = _windows(spec, partition, "train")
    model = _model(state, spec, accelerator)
    steps = local_steps(spec)
    new_state, metrics = trained_reply(model, windows, (corrupt and not on_node, delay),
                                       lambda: train_steps(model, windows, **steps))
    samples = samples_reply(model, windows, ask, RoundSpec.from_config(spec).seed, private=steps["dp"] is not None)
    if corrupt and on_node:
        samples[SAMPLES_KEY].view(-1)[0] = -1  # a token id outside every vocabulary
    new_state.update(samples)
    return new_state, metrics
