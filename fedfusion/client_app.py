"""The Flower ClientApp: capability query, training and evaluation of whatever the message specifies."""

from __future__ import annotations

import importlib
from functools import lru_cache
from types import ModuleType
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from fedfusion.clients.privacy import privacy_mod
from fedfusion.clients.secagg import query as secagg_query
from fedfusion.clients.secagg import secagg_mod
from fedfusion.config.methods import GENERATIVE
from fedfusion.devices.catalog import assign_tiers
from fedfusion.devices.hardware import capabilities, pick_accelerator
from fedfusion.run.quiet import silence_expected_noise
from fedfusion.wire.keys import FROZEN
from fedfusion.wire.quantize import client_reply, decode
from fedfusion.wire.specs import (
    ROLES,
    SECAGG_ACTION,
    STATE_LOST,
    UNITS_ACTION,
    UNITS_ERROR,
    UNITS_PAYLOAD,
    UNITS_RECORD,
    Caps,
    GenerativeSpec,
    PopulationSpec,
    RoleSpec,
    UnitsSpec,
    WireSpec,
)

silence_expected_noise()  # in every simulation actor: it imports this module to unpickle the app
app = ClientApp()


def _role(spec: ConfigRecord) -> ModuleType:
    """The module of the role the spec asks for (train(), evaluate(), num_examples()), imported on first use: the
    LoRA role pulls in peft and bitsandbytes (seconds per simulation actor)."""
    return importlib.import_module(ROLES[RoleSpec.from_config(spec).role])


def _partition(context: Context) -> int:
    return int(context.node_config["partition-id"])


def _accelerator(context: Context) -> str:
    """``--node-config 'accelerator="cpu"'`` pins it; otherwise cuda, mps or cpu, whichever torch can use."""
    preferred = context.node_config.get("accelerator")
    return pick_accelerator(str(preferred) if preferred is not None else None)


@lru_cache(maxsize=4)
def population_tiers(mix: tuple[tuple[str, float], ...], num_clients: int, seed: int) -> tuple[str, ...]:
    """Every virtual client's device tier for a population (:class:`PopulationSpec`), computed once per process: a
    QUERY round asks every node of the population, and each answer would otherwise redo the whole population's
    draw (10,000 queries x 10,000 tiers)."""
    return tuple(assign_tiers(dict(mix), num_clients, seed))


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Report this node's device tier, partition, data size and the host's measured capabilities.

    In deployment the tier comes from ``--node-config 'device="..."'``; in simulation, where a virtual
    node only knows its partition id, it is derived from the recipe's seeded population mix.
    """
    config = msg.content.config_records["config"]
    device = context.node_config.get("device")
    if device is None:
        p = PopulationSpec.from_config(config)
        device = population_tiers(tuple(p.mix.items()), p.num_clients, p.seed)[p.client(_partition(context))]
    examples = _role(config).num_examples(config, _partition(context))
    caps = ConfigRecord({**Caps(str(device), _partition(context), int(examples)).to_config(),
                         **capabilities(_accelerator(context))})
    return Message(RecordDict({"caps": caps}), reply_to=msg)


@app.query(SECAGG_ACTION)
def secagg(msg: Message, context: Context) -> Message:
    """A step of secure aggregation around a training round (:mod:`fedfusion.clients.secagg`)."""
    return secagg_query(msg, context)


# where a node keeps its uplink's error-feedback residual between rounds (Flower's context.state persists per node)
RESIDUAL = "wire-residual"
# where a node keeps its device's own generative model between rounds (generative.device_state=node)
DEVICE_MODEL = "generative-model"


def _keeps_model(spec: ConfigRecord) -> GenerativeSpec | None:
    """The message's generative spec when its node keeps its own model (``device_state=node``), else None."""
    if RoleSpec.from_config(spec).role != GENERATIVE:
        return None
    ask = GenerativeSpec.from_config(spec)
    return ask if ask.device_state == "node" else None


@app.train(mods=[secagg_mod, privacy_mod])
def train(msg: Message, context: Context) -> Message:
    """Train the received model as its spec says and reply with the new weights (or, with a quantised uplink,
    their change, error feedback kept in ``context.state``) and metrics. A generative node that keeps its own model
    (``device_state=node``) trains the one in ``context.state`` when the message carries none, keeps the trained
    one there and replies its samples only; a message asking for a kept model this node lacks (it restarted) gets
    a :data:`~fedfusion.wire.specs.STATE_LOST` error, and the server sends the initial model again."""
    spec = msg.content.config_records["config"]
    arrays = msg.content.array_records["arrays"].to_torch_state_dict()
    received = decode(arrays, keep=FROZEN)  # as float32 (roles copy it in), a frozen target as narrow as it came
    if "gateway" in context.node_config:  # this node serves phones: one of them trains (fedfusion.clients.device)
        from fedfusion.clients.device import relay

        state, metrics = relay(received, spec, _partition(context), context.node_config)
    else:
        keeps = _keeps_model(spec)
        if keeps is not None and keeps.kept:
            own = context.state.get(DEVICE_MODEL)
            if not isinstance(own, ArrayRecord):
                reason = (f"{STATE_LOST} partition {_partition(context)} was asked to train its kept generative "
                          "model, but this node holds none (restarted?)")
                return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=msg)
            received = own.to_torch_state_dict()
        state, metrics = _role(spec).train(received, spec, _partition(context), _accelerator(context))
        if keeps is not None:
            from fedfusion.models.samples import split_reply

            model, state = split_reply(state)
            context.state[DEVICE_MODEL] = ArrayRecord(model)
    wire = WireSpec.read(spec)
    residual = None
    if wire.error_feedback and wire.up != "float32":
        kept = context.state.get(RESIDUAL)
        residual = kept.to_torch_state_dict() if isinstance(kept, ArrayRecord) else {}
    reply, left = client_reply(state, arrays, wire.up, residual, received)
    if residual is not None:
        context.state[RESIDUAL] = ArrayRecord(left)
    content = RecordDict({"arrays": ArrayRecord(reply), "metrics": MetricRecord(metrics)})
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Score the received model on this node's held-out text."""
    spec = msg.content.config_records["config"]
    metrics = _role(spec).evaluate(decode(msg.content.array_records["arrays"].to_torch_state_dict()), spec,
                                   _partition(context), _accelerator(context))
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


# where a node keeps the units mode's weight blocks and running sums between messages: Flower's context.state (it
# persists per node in simulation, whichever actor runs the message, and across a deployed SuperNode's per-message
# processes)
UNITS_CACHE = "units-cache"
UNITS_SUMS = "units-sums"


def _tensors(record: Any) -> dict[str, torch.Tensor]:
    """A node's ``context.state`` ArrayRecord as tensors (nothing when the node has none yet)."""
    return {k: torch.from_numpy(a.numpy()) for k, a in record.items()} if isinstance(record, ArrayRecord) else {}


@app.train(UNITS_ACTION)
def units(msg: Message, context: Context) -> Message:
    """The exact mode (``train.units``): compute the GEMM tiles of the payload's bytes with the node's weight cache
    and running sums (``context.state``) and reply the result bytes; a message that needs a weight block the cache
    lacks, or a sum the node lost, gets a ``units-error`` reply (the node's state cleared) and the server sends
    the weights again and recomputes the sums."""
    from fedfusion.clients import units as role
    from fedfusion.units.accumulate import RunningSums

    config = msg.content.config_records.get("config")
    spec = UnitsSpec.from_config_if_any(config) if config is not None else None
    payload = msg.content.array_records[UNITS_RECORD][UNITS_PAYLOAD].numpy().tobytes()
    cache = _tensors(context.state.get(UNITS_CACHE))
    sums = RunningSums.from_arrays(_tensors(context.state.get(UNITS_SUMS)))
    reply = role.compute(payload, cache, sums, spec.stall_s if spec else 0.0)
    if reply is None:
        context.state[UNITS_CACHE] = ArrayRecord()
        context.state[UNITS_SUMS] = ArrayRecord()
        return Message(RecordDict({UNITS_ERROR: ConfigRecord({"reason": "weight block or running sum not on this "
                                                                        "node"})}), reply_to=msg)
    context.state[UNITS_CACHE] = ArrayRecord({k: Array(v.numpy()) for k, v in cache.items()})
    context.state[UNITS_SUMS] = ArrayRecord({k: Array(v.numpy()) for k, v in sums.to_arrays().items()})
    return Message(RecordDict({UNITS_RECORD: ArrayRecord({UNITS_PAYLOAD: Array(np.frombuffer(reply, np.uint8))})}),
                   reply_to=msg)
