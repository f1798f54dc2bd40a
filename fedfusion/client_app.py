"""The Flower ClientApp: capability query, training and evaluation of whatever the message specifies."""

from __future__ import annotations

import importlib
import json
from functools import lru_cache
from types import ModuleType

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedfusion.clients.privacy import privacy_mod
from fedfusion.devices import assign_tiers
from fedfusion.hardware import capabilities, pick_accelerator
from fedfusion.quantize import client_reply, decode
from fedfusion.quiet import silence_expected_noise
from fedfusion.wire import read_wire

silence_expected_noise()  # in every simulation actor: it imports this module to unpickle the app
app = ClientApp()

# What a message's spec asks this client to be (spec["role"]): each module has train() and evaluate().
# Imported on first use: the LoRA role pulls in peft and bitsandbytes (seconds per simulation actor).
ROLES = {"submodel": "fedfusion.clients.submodel", "smallmodel": "fedfusion.clients.smallmodel",
         "lora": "fedfusion.clients.lora", "generative": "fedfusion.clients.generative"}


def _role(spec: ConfigRecord) -> ModuleType:  # the role module: train(), evaluate(), num_examples()
    role = str(spec.get("role", "submodel"))
    if role not in ROLES:
        raise ValueError(f"message spec role {role!r} is unknown; this client knows {', '.join(ROLES)}")
    return importlib.import_module(ROLES[role])


def _partition(context: Context) -> int:
    return int(context.node_config["partition-id"])


def _accelerator(context: Context) -> str:
    """``--node-config 'accelerator="cpu"'`` pins it; otherwise cuda, mps or cpu, whichever torch can use."""
    preferred = context.node_config.get("accelerator")
    return pick_accelerator(str(preferred) if preferred is not None else None)


@lru_cache(maxsize=4)
def population_tiers(population: str) -> tuple[str, ...]:
    """Every virtual client's device tier for a population spec (``mix``, ``num_clients``, ``seed``), computed once
    per process: a QUERY round asks every node of the population, and each answer would otherwise redo the
    whole population's draw (10,000 queries x 10,000 tiers)."""
    spec = json.loads(population)
    return tuple(assign_tiers(spec["mix"], spec["num_clients"], spec["seed"]))


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Report this node's device tier, partition, data size and the host's measured capabilities.

    In deployment the tier comes from ``--node-config 'device="..."'``; in simulation, where a virtual
    node only knows its partition id, it is derived from the recipe's seeded population mix.
    """
    config = msg.content["config"]
    device = context.node_config.get("device")
    if device is None:
        device = population_tiers(str(config["population"]))[_partition(context)]
    examples = _role(config).num_examples(config, _partition(context))
    caps = ConfigRecord({"device": str(device), "partition": _partition(context), "examples": int(examples),
                         **capabilities(_accelerator(context))})
    return Message(RecordDict({"caps": caps}), reply_to=msg)


# where a node keeps its uplink's error-feedback residual between rounds (Flower's context.state persists per node)
RESIDUAL = "wire-residual"


@app.train(mods=[privacy_mod])
def train(msg: Message, context: Context) -> Message:
    """Train the received model as its spec says and reply with the new weights (or, with a quantised uplink,
    their change, error feedback kept in ``context.state``) and metrics."""
    spec = msg.content["config"]
    arrays = msg.content["arrays"].to_torch_state_dict()
    received = decode(arrays)  # a quantised downlink, as float32 (roles copy it into their models)
    if "gateway" in context.node_config:  # this node serves phones: one of them trains (fedfusion.clients.device)
        from fedfusion.clients.device import relay

        state, metrics = relay(received, spec, _partition(context), context.node_config)
    else:
        state, metrics = _role(spec).train(received, spec, _partition(context), _accelerator(context))
    up, feedback = read_wire(spec)
    residual = None
    if feedback and up != "float32":
        kept = context.state.get(RESIDUAL)
        residual = kept.to_torch_state_dict() if isinstance(kept, ArrayRecord) else {}
    reply, left = client_reply(state, arrays, up, residual, received)
    if residual is not None:
        context.state[RESIDUAL] = ArrayRecord(left)
    content = RecordDict({"arrays": ArrayRecord(reply), "metrics": MetricRecord(metrics)})
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Score the received model on this node's held-out text."""
    spec = msg.content["config"]
    metrics = _role(spec).evaluate(decode(msg.content["arrays"].to_torch_state_dict()), spec, _partition(context),
                                   _accelerator(context))
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
