"""Generative distillation as a fusion method: each device keeps a small model of its own and sends samples.

Each sampled client trains *its own* small model (the static slice of the initial target at its tier's width the
first time, afterwards the model it trained last) and is asked for samples, which the server keeps in a
:class:`~fedfusion.fusion.generative.reply.SamplePool`; the fold trains the target on every client's latest samples.

Where a device's model lives between rounds is ``generative.device_state``. ``node``: the node keeps it in its
Flower ``context.state``; a partition's first payload (or the first after its node said it lost the model, a
:data:`~fedfusion.wire.specs.STATE_LOST` error) carries the initial slice, every later one no arrays, and a reply is
its samples only. The server holds no device model, so a checkpoint holds none either: a resumed run sends every
partition the initial slice again. ``server``: the server holds every device's model, sends it down every round and
keeps the one a reply returns (for stateless clients).

The server sees every client's samples, which carry its private data almost verbatim: see
:mod:`fedfusion.fusion.generative.reply`. The server's training is the fold's ``server_cost``, priced like distillation.
It keeps one AdamW over the target across rounds (a fresh one each round would restart its moments, so every
round's first steps would be sign-sized jolts), and with ``top_k`` fits each sampled position's teacher
distribution instead of the one sampled token.

With ``grow_round`` g the run first trains what every device holds, as width slicing's grow-then-fuse does (rounds
1..g are :class:`~fedfusion.fusion.submodel.method.SubModelMethod`'s smallest-only rounds inside a silenced target);
from round g+1 each device's own model starts from its slice of that grown target (the small model's function, with
spare units where its tier is wider) and the server's training starts from the grown target instead of random
weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

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
from fedfusion.fusion.generative.config import GenerativeConfig
from fedfusion.fusion.generative.reply import (
    SAMPLES_KEY,
    TEACHER_KEYS,
    TOP_IDS_KEY,
    TOP_LOGP_KEY,
    SamplePool,
    check_samples,
    check_teacher,
)
from fedfusion.fusion.generative.spec import GenerativeSpec
from fedfusion.fusion.rounds import server_seed
from fedfusion.fusion.state import load_optimizer_state, optimizer_state, pack_tensors, unpack_tensors
from fedfusion.fusion.submodel.method import SliceWire, SubModelMethod
from fedfusion.models.build import full_state, model_from_state, tied_aliases
from fedfusion.models.slicing import extract, plan_slice, sub_config
from fedfusion.train.distill import TopTokensLoss
from fedfusion.train.loop import LM, make_optimizer, train_steps
from fedfusion.wire.specs import STATE_LOST, Caps, ModelSpec, RoleSpec, merge

MAX_WINDOWS = 4096  # the most training windows the server credits a client with (its samples and pool share)


class GenerativeMethod(FusionMethod):
    """Each tier trains its own small model (a static slice of the target at the tier's width); the target
    learns from the text those models write."""

    name, role, noun = "generative", "generative", "model"

    def __init__(self, config: PretrainedConfig, widths: dict[str, float], template: State,
                 generative: GenerativeConfig, seq_len: int, population: int, run_seed: int = 0,
                 axes: tuple[str, ...] | None = None, scale: bool = True, grow_round: int = 0) -> None:
        generative.check()  # a recipe's section is checked on load; one built in code (tests, benchmarks) here
        self.config, self.widths, self.generative = config, widths, generative
        self.grow_round = grow_round
        # rounds 1..grow_round: smallest-only training of a target silenced around the smallest slice
        self.grower = SubModelMethod(config, widths, template, policy="static", run_seed=run_seed, axes=axes,
                                     scale=scale, grow_round=grow_round) if grow_round else None
        self.seq_len, self.population, self.run_seed, self.axes, self.scale = seq_len, population, run_seed, axes, scale
        self.wire = SliceWire(config)
        self.plans = {tier: plan_slice(config, w, "static", axes=axes, scale=scale) for tier, w in widths.items()}
        # a tier's own model is the static slice at its width, priced both ways (samples are small next to it and
        # counted when they arrive)
        self.costs = {tier: state_size(self.wire(extract(template, config, plan)), widths[tier])
                      for tier, plan in self.plans.items()}
        self.devices: dict[int, dict[str, torch.Tensor]] = {}  # server: partition -> its own model, as last returned
        self.kept: set[int] = set()  # node: the partitions whose node keeps its model (a reply of theirs was folded)
        self.pool = SamplePool()
        self.examples: dict[int, int] = {}  # partition -> its training windows (caps its samples)
        self.initial: dict[str, torch.Tensor] | None = None  # the target before round 1: what device models start from
        self.server: tuple[PreTrainedModel, torch.optim.Optimizer] | None = None  # the target's model and its AdamW
        self.server_state: dict[str, Any] | None = None  # a resumed AdamW's state, loaded when the model is built

    def describe(self) -> str:
        g = self.generative
        top = f" top_k={g.top_k}" if g.top_k else ""
        grow = f" grow_round={self.grow_round}" if self.grow_round else ""
        return (f"generative: widths={self.widths} samples/window={g.sample_fraction} server_steps={g.server_steps}"
                f"{top} device_state={g.device_state}{grow}")

    def begin(self, target: State) -> State:
        """With ``grow_round``, the target silenced around the smallest slice (the small model every device trains)."""
        return self.grower.begin(target) if self.grower is not None else target

    def _growing(self, server_round: int) -> SubModelMethod | None:
        """The smallest-only method while ``server_round`` is a grow round, else None."""
        return self.grower if server_round <= self.grow_round else None

    @property
    def on_node(self) -> bool:
        """Whether devices keep their own models on their nodes (``device_state=node``)."""
        return self.generative.device_state == "node"

    def state_dict(self) -> dict[str, Any]:
        """The sample pool, the server's AdamW and (``device_state=server``) every device's model (safetensors,
        base64) for a resumed run. With ``node`` the devices' models are on the nodes and not saved: a resumed run's
        nodes are new to it (a new run's context.state), so every partition gets the initial slice again."""
        devices = {} if self.on_node else {"devices": {str(p): pack_tensors(s) for p, s in self.devices.items()}}
        return {"examples": self.examples, **devices,
                "pool": {str(p): pack_tensors(arrays) for p, arrays in self.pool.kept.items()},
                "initial": pack_tensors(self.initial) if self.initial is not None else None,
                "server": self._server_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.examples = {int(p): int(n) for p, n in state["examples"].items()}
        saved = {} if self.on_node else state.get("devices", {})  # a node-state checkpoint's devices start afresh
        self.devices = {int(p): unpack_tensors(s) for p, s in saved.items()}
        self.pool.kept = {int(p): unpack_tensors(s) for p, s in state["pool"].items()}
        self.initial = unpack_tensors(state["initial"]) if state["initial"] else None
        self.server, self.server_state = None, state.get("server")

    def tier_cost(self, tier: str) -> TierCost:
        return self.costs[tier]

    def payloads(self, server_round: int, target: State, clients: Sequence[Client]) -> list[Payload]:
        """Each client's own small model (none where its node keeps it) and the spec to train and sample it; in a
        grow round, the smallest slice to train as one federated model."""
        if (grower := self._growing(server_round)) is not None:
            return grower.payloads(server_round, target, clients)
        if self.initial is None:  # the first generative round's target: built, or grown from the small model
            self.initial = {k: v.clone() for k, v in target.items()}
        out = []
        for client in clients:
            width, plan = self.widths[client.tier], self.plans[client.tier]
            kept = self.on_node and client.partition in self.kept
            own = {} if kept else self.devices.get(client.partition) or extract(self.initial, self.config, plan)
            sent = self.wire(own)
            # the client's own count of training windows, capped by the server: a client cannot claim the pool
            windows = min(int(client.caps.get(Caps.key("examples"), 1)), MAX_WINDOWS)
            self.examples[client.partition] = windows
            g = self.generative
            spec = merge(RoleSpec(self.role), ModelSpec(sub_config(self.config, plan).to_dict()),
                         GenerativeSpec(width, math.ceil(g.sample_fraction * windows), g.temperature, g.top_k,
                                        g.device_state, kept))
            # the model it trains, sent or kept; a node-state reply carries no model to compare with what was sent
            out.append(Payload(client, sent, spec, width, params=self.costs[client.tier].params,
                               sent_norm=state_norm(sent), context={} if self.on_node else sent))
        return out

    def check(self, payload: Payload, reply: State, weight: float) -> Update:
        if self.grower is not None and RoleSpec.from_config(payload.spec).role != self.role:
            return self.grower.check(payload, reply, weight)  # a grow round's slice
        arrays = dict(reply)
        wanted = (SAMPLES_KEY, *TEACHER_KEYS) if self.generative.top_k else (SAMPLES_KEY,)
        missing = [key for key in wanted if key not in arrays]
        if missing:
            raise ValueError(f"reply has no {', '.join(map(repr, missing))} array")
        samples = {key: arrays.pop(key) for key in wanted}
        if self.on_node and arrays:
            raise ValueError(f"generative.device_state=node: a reply carries its samples only, not model arrays "
                             f"({', '.join(sorted(arrays)[:3])}, ...)")
        check_same_layout(arrays, payload.context, "model sent")
        norm = state_norm(arrays)
        check_samples(samples[SAMPLES_KEY], self.seq_len + 1, self.config.vocab_size, math.ceil(
            self.generative.sample_fraction * self.examples.get(payload.client.partition, 1)))
        if self.generative.top_k:
            check_teacher(samples[TOP_IDS_KEY], samples[TOP_LOGP_KEY], samples[SAMPLES_KEY],
                          min(self.generative.top_k, self.config.vocab_size), self.config.vocab_size)
        return Update(payload, weight, norm, (arrays, samples))

    def failed(self, client: Client, error: str) -> None:
        """A node that says it lost its kept model (:data:`~fedfusion.wire.specs.STATE_LOST`) gets the initial
        slice the next time its partition is sampled."""
        if STATE_LOST in error:
            self.kept.discard(client.partition)

    def fold(self, server_round: int, target: State, updates: Sequence[Update]) -> Fold:
        """Keep each reply's samples (and, ``device_state=server``, its model; ``node``: note that its node keeps
        one), then train the target on every client's latest samples. A grow round averages the small model's slices."""
        if (grower := self._growing(server_round)) is not None:
            return grower.fold(server_round, target, updates)
        for update in updates:
            partition, (arrays, samples) = update.payload.client.partition, update.data
            if self.on_node:
                self.kept.add(partition)
            else:
                self.devices[partition] = {k: v.float() if v.is_floating_point() else v for k, v in arrays.items()}
            kept = {"ids": samples[SAMPLES_KEY].long()}
            if self.generative.top_k:
                kept |= {TOP_IDS_KEY: samples[TOP_IDS_KEY].to(torch.int32), TOP_LOGP_KEY: samples[TOP_LOGP_KEY].half()}
            self.pool.add(partition, kept, cap=max(1, self.examples.get(partition, 1)))
        model, opt = self._server(target)
        g, pool = self.generative, self.pool.arrays()
        loss = TopTokensLoss(pool[TOP_IDS_KEY], pool[TOP_LOGP_KEY]) if g.top_k else LM
        out = train_steps(model, pool["ids"], g.server_steps, g.server_lr, g.server_batch,
                          server_seed(self.run_seed, server_round, self.population), loss=loss, opt=opt)
        new = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return Fold(new, 1.0, {"server_loss": out.loss}, out.cost())

    def _server_state(self) -> dict[str, Any] | None:
        """The server's AdamW as JSON-able values (None before the first fold)."""
        if self.server is None:
            return self.server_state
        groups, tensors = optimizer_state(self.server[1])
        return {**groups, "tensors": pack_tensors(tensors)}

    def _server(self, target: State) -> tuple[PreTrainedModel, torch.optim.Optimizer]:
        """The server's model holding ``target`` and its AdamW, kept across rounds (built, and a resumed state
        loaded, on first use)."""
        if self.server is None:
            model = model_from_state(self.config, target)
            opt = make_optimizer(model, "adamw", self.generative.server_lr, 0.0)
            if self.server_state is not None:
                load_optimizer_state(opt, self.server_state, unpack_tensors(self.server_state["tensors"]))
            self.server, self.server_state = (model, opt), None
        else:
            self.server[0].load_state_dict(full_state(target, tied_aliases(self.server[0])), strict=True)
        return self.server

    def evaluation(self, target: State, tier: str) -> tuple[State, dict[str, Any]]:
        return self.wire(target), merge(RoleSpec(SUBMODEL), ModelSpec(self.config.to_dict()))
