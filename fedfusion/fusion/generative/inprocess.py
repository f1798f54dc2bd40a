"""Generative distillation on the in-process driver (:func:`fedfusion.fusion.inprocess.run_rounds`): the same
:class:`~fedfusion.fusion.generative.method.GenerativeMethod` as a Flower run, each client trained and sampled as its
client role does, for benchmarks and tests."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig

from fedfusion.fusion import inprocess
from fedfusion.fusion.base import Payload, State
from fedfusion.fusion.generative.config import GenerativeConfig
from fedfusion.fusion.generative.method import GenerativeMethod
from fedfusion.fusion.generative.reply import SAMPLES_KEY, samples_reply
from fedfusion.fusion.generative.spec import GenerativeSpec
from fedfusion.fusion.inprocess import Evaluate, Rounds, RunStats, spec_config, wire_of
from fedfusion.models.build import model_from_state
from fedfusion.models.slicing import plan_slice, sub_config
from fedfusion.train.loop import train_steps
from fedfusion.wire.keys import NUM_EXAMPLES
from fedfusion.wire.quantize import decode
from fedfusion.wire.specs import Caps, RoleSpec


@dataclass(frozen=True)
class GenerativeRun(Rounds):
    """One generative-distillation federation (:class:`~fedfusion.fusion.generative.method.GenerativeMethod`): each
    client trains its own small model (the static slice of the target at ``width``, kept between rounds, never
    averaged; on its node or on the server, as ``generative.device_state`` says) and sends samples of it; the server
    trains the target (``config``) on every client's latest samples (:mod:`fedfusion.fusion.generative.reply`)."""

    config: PretrainedConfig
    width: float
    windows: Sequence[torch.Tensor]  # per partition
    axes: tuple[str, ...] | None = None
    generative: GenerativeConfig = field(default_factory=GenerativeConfig)
    grow_round: int = 0  # rounds of smallest-only training before devices' own models start from the grown target

    @property
    def client_config(self) -> PretrainedConfig:
        """The config of every client's own model."""
        return sub_config(self.config, plan_slice(self.config, self.width, "static", axes=self.axes))


def run_generative(run: GenerativeRun, initial: dict[str, torch.Tensor], evaluate: Evaluate | None = None,
                   ) -> tuple[dict[str, torch.Tensor], RunStats, dict[int, dict[str, torch.Tensor]]]:
    """Train the target ``initial`` from the clients' samples for ``run.rounds`` rounds (see :class:`GenerativeRun`):
    :class:`~fedfusion.fusion.generative.method.GenerativeMethod` through :func:`run_rounds`, each client training
    and sampling its model as the client app and role :mod:`fedfusion.clients.generative` do, a node-state device
    (``device_state=node``) keeping it in a per-partition dict as its node would in ``context.state``. Bytes are the
    messages' (with ``server`` the model both ways; with ``node`` the model down in a device's first round only and
    never up; the samples up as the client sends them); the clients' sampling counts as work (~2 x params per
    generated token, forward only, KV-cached). Returns the target, the costs and each sampled partition's own model as
    its device ends the run (what the samples could carry: the ceiling of what the target can learn)."""
    run.on_cpu("run_generative")
    tier = f"w{run.width:g}"
    method = GenerativeMethod(run.config, {tier: run.width}, initial, run.generative, run.windows[0].shape[1] - 1,
                              len(run.windows), run.seed, run.axes, grow_round=run.grow_round)
    sampling = {"seconds": 0.0, "flops": 0.0}
    nodes: dict[int, State] = {}  # device_state=node: each partition's own model, as its node keeps it

    def train(rnd: int, payload: Payload) -> tuple[State, dict[str, float]]:
        partition = payload.client.partition
        if RoleSpec.from_config(payload.spec).role != method.role:  # a grow round: the slice, as the submodel role
            model = model_from_state(spec_config(run.config, payload), decode(payload.arrays))
            out = train_steps(model, run.windows[partition], run.steps_for(len(run.windows[partition])),
                              run.lr_at(rnd) * payload.lr_scale, run.batch_size, payload.client.seed, run.weight_decay,
                              run.optimizer, dp=run.private(len(run.windows[partition]), len(run.windows)))
            return wire_of(model), {**out.metrics(), NUM_EXAMPLES: len(run.windows[partition])}
        ask = GenerativeSpec.from_config(payload.spec)
        start_from = nodes[partition] if ask.kept else payload.arrays
        model = model_from_state(sub_config(run.config, method.plans[tier]), start_from)
        own, seed = run.windows[partition], payload.client.seed
        dp = run.private(len(own), len(run.windows))
        out = train_steps(model, own, run.steps_for(len(own)), run.lr_at(rnd) * payload.lr_scale, run.batch_size, seed,
                          run.weight_decay, run.optimizer, dp=dp)
        trained = wire_of(model)
        if ask.device_state == "node":
            nodes[partition], reply = trained, {}
        else:
            reply = trained
        start = time.perf_counter()
        reply.update(samples_reply(model, own, ask, seed, private=dp is not None))
        params = sum(p.numel() for p in model.parameters())
        sampling["seconds"] += time.perf_counter() - start
        # generation, plus the teacher's forward pass over the samples with top_k
        sampling["flops"] += 2.0 * params * reply[SAMPLES_KEY].numel() * (2 if ask.top_k else 1)
        return reply, {**out.metrics(), NUM_EXAMPLES: len(own)}

    caps = [{Caps.key("examples"): len(w)} for w in run.windows]  # what each node reports of itself
    # by its module name, as the other loops call it (benchmarks/privacy.py wraps it to read the replies)
    target, stats = inprocess.run_rounds({tier: method}, [tier] * len(run.windows), initial, train, run, evaluate, caps=caps)
    stats.client_s += sampling["seconds"]
    stats.flops += sampling["flops"]
    return target, stats, nodes if method.on_node else method.devices
