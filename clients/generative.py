"""Client role for generative distillation: train this device's own small model, then write samples of it.

It returns the trained model and, under ``fedfusion.fusion.generative.reply.SAMPLES_KEY``, the sampled token windows the
server trains the target on (and, with ``generative.top_k``, each position's likeliest tokens under
``TEACHER_KEYS``). With ``generative.device_state=server`` all of it is the reply (the server sends the model back
next round); with ``node`` the node keeps the model (its :class:`Node` state) and replies the samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Self

import torch
from fedfusion.clients.node import StateLost
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
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedfusion.fusion.generative.reply import SAMPLES_KEY, samples_reply, split_reply
from fedfusion.fusion.generative.spec import GenerativeSpec
from fedfusion.train.loop import train_steps
from fedfusion.wire.specs import STATE_LOST, RoundSpec

__all__ = ["Node", "evaluate", "num_examples", "train"]


@dataclass
class Node:
    """What a generative node keeps between rounds: its device's own model, when its messages say
    ``device_state=node`` (after the first, they carry none: ``kept``)."""

    KEY: ClassVar[str] = "generative-model"
    model: ArrayRecord | None = None  # None: this node holds none (new, or restarted)

    @classmethod
    def load(cls, records: RecordDict) -> Self:
        kept = records.get(cls.KEY)
        return cls(kept if isinstance(kept, ArrayRecord) else None)

    def save(self, records: RecordDict) -> None:
        if self.model is not None:
            records[self.KEY] = self.model


def train(state: dict[str, torch.Tensor], spec: ConfigRecord, partition: int, accelerator: str = "cpu",
          node: Node | None = None) -> tuple[dict, dict]:
    """Train the device's model in ``state`` (or, when the message says ``kept``, the one ``node`` keeps) and sample
    from it (:func:`sampled`); returns the trained model with the samples (with ``device_state=node``: the samples
    only, the model kept in ``node``), and metrics. A ``kept`` message to a node that holds no model (it restarted)
    raises :class:`~fedfusion.clients.node.StateLost`, and the server sends the initial model again."""
    ask = GenerativeSpec.from_config(spec)
    if ask.device_state != "node":
        return sampled(state, spec, partition, accelerator, ask)
    node = Node() if node is None else node
    if ask.kept:
        if node.model is None:
            raise StateLost(f"{STATE_LOST} partition {partition} was asked to train its kept generative model, but "
                            "this node holds none (restarted?)")
        state = node.model.to_torch_state_dict()
    reply, metrics = sampled(state, spec, partition, accelerator, ask)
    kept, samples = split_reply(reply)
    node.model = ArrayRecord(kept)
    return samples, metrics


def sampled(state: dict[str, torch.Tensor], spec: ConfigRecord, partition: int, accelerator: str,
            ask: GenerativeSpec) -> tuple[dict, dict]:
    """Train the device's model in ``state`` as ``spec`` says, then sample the windows ``ask`` asks for from it;
    returns the trained model with the samples, and metrics. An injected corruption (``faults.corrupt_prob``) hits
    what goes up: the model with ``device_state`` server, the samples with node (whose model stays on the node,
    unharmed), so the server rejects the reply either way."""
    corrupt, delay = inject_faults(spec, partition)
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
