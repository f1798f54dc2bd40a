"""Generative distillation as a fusion method: each device keeps a small model of its own and sends samples.

Each sampled client gets *its own* small model (the static slice of the initial target at its tier's width the
first time, afterwards the model it returned last; the server holds it for stateless deployed clients) and is
asked for samples. A reply's model is kept as that device's, its samples in a
:class:`~fedfusion.models.samples.SamplePool`; the fold trains the target on every client's latest samples.

The server sees every client's samples, which carry its private data almost verbatim: see
:mod:`fedfusion.models.samples`. The server's training is the fold's ``server_cost``, priced like distillation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PretrainedConfig

from fedfusion.config.methods import SUBMODEL
from fedfusion.fusion.base import (
    Client,
    Fold,
    FusionMethod,
    Payload,
    State,
    TierCost,
    Update,
    check_same_layout,
    state_norm,
    state_size,
)
from fedfusion.fusion.rounds import server_seed
from fedfusion.fusion.state import pack_tensors, unpack_tensors
from fedfusion.fusion.submodel.method import SliceWire
from fedfusion.models.build import model_from_state
from fedfusion.models.samples import SAMPLES_KEY, GenerativeConfig, SamplePool, check_samples
from fedfusion.models.slicing import extract, plan_slice, sub_config
from fedfusion.train.loop import train_steps
from fedfusion.wire.specs import Caps, GenerativeSpec, ModelSpec, RoleSpec, merge


class GenerativeMethod(FusionMethod):
    """Each tier trains its own small model (a static slice of the target at the tier's width); the target
    learns from the text those models write."""

    name, role, noun = "generative", "generative", "model"

    def __init__(self, config: PretrainedConfig, widths: dict[str, float], template: State,
                 generative: GenerativeConfig, seq_len: int, population: int, run_seed: int = 0,
                 axes: tuple[str, ...] | None = None, scale: bool = True) -> None:
        self.config, self.widths, self.generative = config, widths, generative
        self.seq_len, self.population, self.run_seed, self.axes, self.scale = seq_len, population, run_seed, axes, scale
        self.wire = SliceWire(config)
        self.plans = {tier: plan_slice(config, w, "static", axes=axes, scale=scale) for tier, w in widths.items()}
        # a tier's own model is the static slice at its width, priced both ways (samples are small next to it and
        # counted when they arrive)
        self.costs = {tier: state_size(self.wire(extract(template, config, plan)), widths[tier])
                      for tier, plan in self.plans.items()}
        self.devices: dict[int, dict[str, torch.Tensor]] = {}  # partition -> its own model, as last returned
        self.pool = SamplePool()
        self.examples: dict[int, int] = {}  # partition -> its training windows (caps its samples)
        self.initial: dict[str, torch.Tensor] | None = None  # the target before round 1: what device models start from

    def describe(self) -> str:
        g = self.generative
        return f"generative: widths={self.widths} samples/window={g.sample_fraction} server_steps={g.server_steps}"

    def state_dict(self) -> dict[str, Any]:
        """Every device's model and the sample pool (safetensors, base64) for a resumed run."""
        return {"examples": self.examples,
                "devices": {str(p): pack_tensors(s) for p, s in self.devices.items()},
                "pool": {str(p): pack_tensors({"ids": w}) for p, w in self.pool.kept.items()},
                "initial": pack_tensors(self.initial) if self.initial is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.examples = {int(p): int(n) for p, n in state["examples"].items()}
        self.devices = {int(p): unpack_tensors(s) for p, s in state["devices"].items()}
        self.pool.kept = {int(p): unpack_tensors(s)["ids"] for p, s in state["pool"].items()}
        self.initial = unpack_tensors(state["initial"]) if state["initial"] else None

    def tier_cost(self, tier: str) -> TierCost:
        return self.costs[tier]

    def payloads(self, server_round: int, target: State, clients: Sequence[Client]) -> list[Payload]:
        """Each client's own small model and the spec to train and sample it."""
        if self.initial is None:
            self.initial = {k: v.clone() for k, v in target.items()}
        out = []
        for client in clients:
            width, plan = self.widths[client.tier], self.plans[client.tier]
            own = self.devices.get(client.partition) or extract(self.initial, self.config, plan)
            sent = self.wire(own)
            # the client's own count of training windows, capped by the server: a client cannot claim the pool
            windows = min(int(client.caps.get(Caps.key("examples"), 1)), self.generative.max_windows)
            self.examples[client.partition] = windows
            spec = merge(RoleSpec(self.role), ModelSpec(sub_config(self.config, plan).to_dict()),
                         GenerativeSpec(width, math.ceil(self.generative.sample_fraction * windows),
                                        self.generative.temperature))
            out.append(Payload(client, sent, spec, width, params=sum(t.numel() for t in sent.values()),
                               sent_norm=state_norm(sent), context=sent))
        return out

    def check(self, payload: Payload, reply: State, weight: float) -> Update:
        arrays = dict(reply)
        samples = arrays.pop(SAMPLES_KEY, None)
        if samples is None:
            raise ValueError(f"reply has no {SAMPLES_KEY!r} array")
        check_same_layout(arrays, payload.context, "model sent")
        norm = state_norm(arrays)
        check_samples(samples, self.seq_len + 1, self.config.vocab_size, math.ceil(
            self.generative.sample_fraction * self.examples.get(payload.client.partition, 1)))
        return Update(payload, weight, norm, (arrays, samples))

    def fold(self, server_round: int, target: State, updates: Sequence[Update]) -> Fold:
        """Keep each reply's model and samples, then train the target on every client's latest samples."""
        for update in updates:
            partition, (arrays, samples) = update.payload.client.partition, update.data
            self.devices[partition] = {k: v.float() if v.is_floating_point() else v for k, v in arrays.items()}
            self.pool.add(partition, samples.long(), cap=max(1, self.examples.get(partition, 1)))
        model = model_from_state(self.config, target)
        g = self.generative
        out = train_steps(model, self.pool.windows(), g.server_steps, g.server_lr, g.server_batch,
                          server_seed(self.run_seed, server_round, self.population))
        new = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return Fold(new, 1.0, {"server_loss": out.loss}, out.cost())

    def evaluation(self, target: State, tier: str) -> tuple[State, dict[str, Any]]:
        return self.wire(target), merge(RoleSpec(SUBMODEL), ModelSpec(self.config.to_dict()))
