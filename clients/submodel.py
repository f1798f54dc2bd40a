"""Client role for sub-model fusion: rebuild the sub-model from the message spec, train or evaluate it."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from typing import Any

import torch
from fedfusion.clients.cache import MODELS
from fedfusion.clients.node import Stateless
from fedfusion.clients.privacy import private_training
from flwr.app import ConfigRecord
from transformers import PreTrainedModel

from fedfusion.data.population import client_windows
from fedfusion.devices.meters import HostMeter, gpu_index
from fedfusion.models.build import model_from_state, tied_aliases, wire_state
from fedfusion.models.families import config_from_dict
from fedfusion.train.loop import TrainResult, evaluate_lm, train_steps
from fedfusion.train.ordered import ordered_loss
from fedfusion.wire.keys import NUM_EXAMPLES
from fedfusion.wire.specs import ClientSpec, FaultSpec, ModelSpec, OrderedSpec, RoundSpec, SliceSpec, TrainSpec, read_train

Node = Stateless  # this role keeps nothing on its node (fedfusion.clients.node)


def num_examples(spec: ConfigRecord, partition: int) -> int:
    """This client's number of training windows, for the capability query (its :class:`ClientSpec`)."""
    return int(_windows(spec, partition, "train").shape[0])


def _windows(spec: ConfigRecord, partition: int, split: str) -> torch.Tensor:
    client = ClientSpec.from_config(spec)
    return client_windows(client.data_spec, partition, client.seq_len, split)


def _model(state: dict[str, torch.Tensor], spec: ConfigRecord, accelerator: str = "cpu") -> PreTrainedModel:
    """The message's model holding ``state``: built once per (config, accelerator, checkpointing) in this process
    and reloaded after (:mod:`fedfusion.clients.cache`)."""
    config = ModelSpec.from_config(spec).model_config

    def build() -> PreTrainedModel:
        model = model_from_state(config_from_dict(config), state)
        return model.to(accelerator)  # type: ignore[arg-type]  # transformers' functools.wraps on .to reads as unbound

    checkpointing = bool(spec.get(TrainSpec.key("checkpoint"), False))  # it changes the built model: a key of its own
    key = ("submodel", json.dumps(config, sort_keys=True), accelerator, checkpointing)
    return MODELS.model(key, build, state)  # type: ignore[return-value]


def set_threads(spec: ConfigRecord) -> None:
    """Use the torch threads the message's :class:`ClientSpec` allows."""
    torch.set_num_threads(ClientSpec.from_config(spec).threads)


def inject_faults(spec: ConfigRecord, partition: int) -> tuple[bool, float]:
    """Recipe-injected faults for this (round, client): raise if it crashes; (corrupt?, straggle seconds).

    Drawn from a generator seeded by the message's seed and the partition, so a run's faults repeat.
    """
    rng = random.Random(RoundSpec.from_config(spec).seed * 7919 + partition)
    draws = [rng.random() for _ in range(3)]
    faults = FaultSpec.read(spec)
    if draws[0] < faults.crash_prob:
        raise RuntimeError(f"injected crash (faults.crash_prob) on partition {partition}")
    delay = faults.straggler_delay_s if draws[1] < faults.straggler_prob else 0.0
    return draws[2] < faults.corrupt_prob, delay


def local_steps(spec: ConfigRecord) -> dict[str, Any]:
    """The spec's local training settings, as ``train_steps`` takes them (:func:`fedfusion.wire.specs.read_train`),
    with DP-SGD's where the run asks for it."""
    return {**read_train(spec), "dp": private_training(spec)}


def trained_reply(model: torch.nn.Module, windows: torch.Tensor, faults: tuple[bool, float],
                  fit: Callable[[], TrainResult], trained: Callable[[], dict] | None = None) -> tuple[dict, dict]:
    """Run ``fit()`` (local training of ``model``) under the host's energy meters, then apply the injected
    ``faults`` (from :func:`inject_faults`: corrupt?, straggle seconds); returns the state (``trained()``, by
    default the model's state with tied aliases left out, in float32 whatever dtype it arrived in; a copy, as the
    model may be a cached one the next message reloads) and metrics."""
    corrupt, delay = faults
    with HostMeter(gpu_index(next(model.parameters()).device)) as meter:  # the host's own meters (labelled, not priced)
        stats = fit().metrics()
    stats.update(meter.metrics())
    new_state = (trained() if trained is not None else
                 wire_state({k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
                            tied_aliases(model)))
    if corrupt:
        next(iter(new_state.values())).view(-1)[0] = float("nan")
    time.sleep(delay)
    return new_state, {NUM_EXAMPLES: int(windows.shape[0]), **stats}


def train(state: dict[str, torch.Tensor], spec: ConfigRecord, partition: int, accelerator: str = "cpu",
          node: Stateless | None = None) -> tuple[dict, dict]:
    """Train the sub-model in ``state`` on ``accelerator`` as ``spec`` says; returns the new state and metrics."""
    faults = inject_faults(spec, partition)  # an injected crash happens before any work
    set_threads(spec)
    windows = _windows(spec, partition, "train")
    model = _model(state, spec, accelerator)
    sliced = SliceSpec.from_config(spec)

    def fit() -> TrainResult:
        steps = local_steps(spec)
        if sliced.policy == "ordered":  # FjORD: a nested width per step, up to this sub-model
            ordered = OrderedSpec.from_config(spec)
            loss = ordered_loss(model, ordered.fractions, sliced.axes, ordered.distill, steps["seed"])
            return train_steps(model, windows, loss=loss, **steps)
        return train_steps(model, windows, checkpoint=TrainSpec.from_config(spec).checkpoint, **steps)

    return trained_reply(model, windows, faults, fit)


def evaluate(state: dict[str, torch.Tensor], spec: ConfigRecord, partition: int, accelerator: str = "cpu") -> dict:
    """Score the model in ``state`` on this client's held-out text."""
    set_threads(spec)
    windows = _windows(spec, partition, "held_out")
    return {NUM_EXAMPLES: int(windows.shape[0]), **evaluate_lm(_model(state, spec, accelerator), windows)}
