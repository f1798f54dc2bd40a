"""The Flower ClientApp: capability query, training and evaluation of whatever the message specifies."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from functools import lru_cache
from types import ModuleType

from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from fedfusion.clients.node import NodeState, Residual, StateLost
from fedfusion.clients.privacy import privacy_mod
from fedfusion.clients.secagg import query as secagg_query
from fedfusion.clients.secagg import secagg_mod
from fedfusion.devices.catalog import assign_tiers
from fedfusion.devices.hardware import capabilities, pick_accelerator
from fedfusion.run.quiet import silence_expected_noise
from fedfusion.wire.keys import FROZEN
from fedfusion.wire.quantize import client_reply, decode
from fedfusion.wire.specs import ACTIONS, ROLES, SECAGG_ACTION, Caps, PopulationSpec, RoleSpec, WireSpec

silence_expected_noise()  # in every simulation actor: it imports this module to unpickle the app
if "flwr.server.superlink.fleet.vce.vce_api" in sys.modules:  # a simulation process: `flwr run` loads this app
    from fedfusion.strategies.sweep import install  # before its engine starts (a deployed node never has the engine)

    install()  # the engine asks only the nodes with a message waiting (strategies/sweep.py)
app = ClientApp()


def _role(spec: ConfigRecord) -> ModuleType:
    """The module of the role the spec asks for (``train()``, ``evaluate()``, ``num_examples()`` and its ``Node``
    state), imported on first use: a role may pull in peft and bitsandbytes (seconds per simulation actor)."""
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


@app.train(mods=[secagg_mod, privacy_mod])
def train(msg: Message, context: Context) -> Message:
    """Train the received model as its spec's role says, with the role's node state (``context.state``,
    :mod:`fedfusion.clients.node`), and reply with the new weights (or, with a quantised uplink, their change, error
    feedback kept in ``context.state``) and metrics. A role that finds its node lacks state the message asks for
    (:class:`~fedfusion.clients.node.StateLost`: the node restarted) gets an error reply that says so, and the
    server sends that state again."""
    spec = msg.content.config_records["config"]
    arrays = msg.content.array_records["arrays"].to_torch_state_dict()
    received = decode(arrays, keep=FROZEN)  # as float32 (roles copy it in), a frozen target as narrow as it came
    if "gateway" in context.node_config:  # this node serves phones: one of them trains (fedfusion.clients.device)
        from fedfusion.clients.device import relay

        state, metrics = relay(received, spec, _partition(context), context.node_config)
    else:
        role = _role(spec)
        node: NodeState = role.Node.load(context.state)
        try:
            state, metrics = role.train(received, spec, _partition(context), _accelerator(context), node)
        except StateLost as lost:
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, str(lost)), reply_to=msg)
        node.save(context.state)
    wire = WireSpec.read(spec)
    residual = Residual.load(context.state) if wire.error_feedback and wire.up != "float32" else None
    reply, left = client_reply(state, arrays, wire.up, None if residual is None else residual.left, received)
    if residual is not None:
        Residual(left).save(context.state)
    content = RecordDict({"arrays": ArrayRecord(reply), "metrics": MetricRecord(metrics)})
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Score the received model on this node's held-out text."""
    spec = msg.content.config_records["config"]
    metrics = _role(spec).evaluate(decode(msg.content.array_records["arrays"].to_torch_state_dict()), spec,
                                   _partition(context), _accelerator(context))
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


def _answer(action: str) -> Callable[[Message, Context], Message]:
    """The handler of message type ``train.<action>``: the ``answer`` of the role :data:`ACTIONS` names for it (it
    keeps its own node state), imported on first use."""

    def answer(msg: Message, context: Context) -> Message:
        return importlib.import_module(ROLES[ACTIONS[action]]).answer(msg, context)

    return answer


for _action in ACTIONS:  # after the plain train handler: a caller that takes the first "train.*" gets that one
    app.train(_action)(_answer(_action))
