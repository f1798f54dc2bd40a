"""Typed message specs: everything the server tells a client, as frozen dataclasses, and the one place that turns
them into ConfigRecord entries and back.

A message's config is the union of a few specs (:func:`merge`): the common :class:`ClientSpec`,
:class:`RoundSpec`, :class:`TrainSpec`, :class:`FaultSpec` and :class:`PrivacySpec`, then the ones of the
payload's role (:class:`RoleSpec` with :class:`ModelSpec` and :class:`SliceSpec`, :class:`FamilySpec`, the LoRA
specs, or a method's own, declared in its folder's ``spec`` module and named by its registry entry:
:func:`spec_types`). The server writes ``spec.to_config()`` and every client role reads ``Spec.from_config(config)``;
a field's key is derived from its name (``local_steps`` -> ``local-steps``, after
the class's ``prefix``) unless the field names its own (:data:`KEY`, for a key another library reads), so
renaming a field renames its key on both sides. Reading refuses a missing key or a value of the wrong type, naming
the key; each spec checks its values against the constants of the module that owns them.

A new spec is one more frozen dataclass deriving from :class:`Spec`: fields with plain types (str, int, float,
bool) travel as they are, others through a codec (``field(metadata=JSON)`` or ``CSV``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import Field, asdict, dataclass, field, fields
from typing import Any, ClassVar, Self, get_type_hints

from fedfusion.config.choices import OPTIMIZERS, POLICIES, PRIVACY_MODES, UPLINK
from fedfusion.config.methods import METHODS, ROLES, UNITS, hook
from fedfusion.config.sections import FaultConfig, PrivacyConfig, TrainConfig

# how an error reply says that a phone behind a device gateway missed its deadline: the strategy records a dropout
DROPPED = "device dropped:"
# how an error reply says that a node has lost the state a method keeps on it (a restarted node's empty
# context.state: generative.device_state=node); the strategy hands such a failure to the method, which resends it
STATE_LOST = "device state lost:"
# ROLES: what a message's spec asks a client to be (RoleSpec.role), and the module of fedfusion.clients that plays
# it (train(), evaluate(), num_examples()); the client app imports it on first use. Each method's registry entry
# names its roles (fedfusion.config.methods).

KEY = "wire-key"  # field metadata: the field's key, where another library fixes it
# the key Flower's DP mods read the clipping norm from (flwr.supercore.differential_privacy.KEY_CLIPPING_NORM):
# restated so that the Flower-free fusion methods, which write specs, import no Flower; a test holds them equal
KEY_CLIPPING_NORM = "clipping_norm"
CODEC = "wire-codec"  # field metadata: (encode, decode) between the field's value and the str that travels


class SpecError(ValueError):
    """A received spec lacks a key or carries a value of the wrong type or out of range."""


def _json_decode(text: str) -> Any:
    value = json.loads(text)
    return tuple(value) if isinstance(value, list) else value


def _csv_decode(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


# field metadata of a field that travels as JSON text (a JSON list comes back as a tuple), or of a tuple of names
# that travels as one comma-separated string: ``x: T = field(metadata=JSON)``
JSON: dict[str, Any] = {CODEC: (json.dumps, _json_decode)}
CSV: dict[str, Any] = {CODEC: (",".join, _csv_decode)}


def _plain(kind: type, key: str, value: Any) -> Any:
    """``value`` as a plain field of type ``kind`` (an int is taken for a float; a bool is never an int)."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind in (int, float) and isinstance(value, bool) or not isinstance(value, kind):
        raise SpecError(f"message spec {key!r}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


@dataclass(frozen=True)
class Spec:
    """Base of every message spec: a frozen dataclass whose fields are ConfigRecord entries."""

    prefix: ClassVar[str] = ""

    @classmethod
    def key(cls, name: str) -> str:
        """The ConfigRecord key of field ``name``."""
        for f in fields(cls):
            if f.name == name:
                return str(f.metadata.get(KEY, cls.prefix + name.replace("_", "-")))
        raise AttributeError(f"{cls.__name__} has no field {name!r}")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every key this spec writes."""
        return tuple(cls.key(f.name) for f in fields(cls))

    def to_config(self) -> dict[str, Any]:
        """The spec's ConfigRecord entries."""
        hints = get_type_hints(type(self))
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if CODEC in f.metadata:
                value = f.metadata[CODEC][0](value)
            elif hints[f.name] is float:
                value = float(value)
            out[self.key(f.name)] = value
        return out

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Self:
        """The spec ``config`` carries; SpecError naming the key when one is missing or of the wrong type."""
        hints = get_type_hints(cls)
        values = {}
        for f in fields(cls):
            key = cls.key(f.name)
            if key not in config:
                raise SpecError(f"message spec lacks {key!r} ({cls.__name__}.{f.name}): server and client disagree")
            values[f.name] = _read(f, hints[f.name], key, config[key])
        return cls(**values)

    @classmethod
    def from_config_if_any(cls, config: Mapping[str, Any]) -> Self | None:
        """The spec, or None when ``config`` carries none of its keys (a spec that only some messages carry)."""
        return cls.from_config(config) if any(key in config for key in cls.keys()) else None


def _read(f: Field, hint: Any, key: str, raw: Any) -> Any:
    if CODEC not in f.metadata:
        return _plain(hint, key, raw)
    if not isinstance(raw, str):
        raise SpecError(f"message spec {key!r}: expected text, got {type(raw).__name__} {raw!r}")
    try:
        return f.metadata[CODEC][1](raw)
    except ValueError as e:
        raise SpecError(f"message spec {key!r}: cannot decode {raw[:80]!r}: {e}") from e


def check_choice(spec: Spec, name: str, allowed: tuple | Mapping) -> None:
    """SpecError naming the key unless ``spec``'s field ``name`` is one of ``allowed`` (a spec's ``__post_init__``)."""
    value = getattr(spec, name)
    if value not in allowed:
        raise SpecError(f"message spec {spec.key(name)!r}: {value!r} is not one of {', '.join(map(str, allowed))}")


def merge(*specs: Spec) -> dict[str, Any]:
    """The entries of several specs as one config; two specs writing the same key is a bug, refused."""
    out: dict[str, Any] = {}
    for spec in specs:
        entries = spec.to_config()
        if clash := set(entries) & set(out):
            raise ValueError(f"{type(spec).__name__} writes keys another spec wrote: {sorted(clash)}")
        out.update(entries)
    return out


# -- every message ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClientSpec(Spec):
    """Which data a client uses and how: the population's data spec (:mod:`fedfusion.data.population`), the window
    length, and the torch threads it trains with. Every message carries it, the capability query included."""

    data_spec: str
    seq_len: int
    threads: int


@dataclass(frozen=True)
class RoundSpec(Spec):
    """The round a message belongs to and the seed of its client's work (:func:`fedfusion.fusion.rounds.client_seed`)."""

    server_round: int
    seed: int


@dataclass(frozen=True)
class RoleSpec(Spec):
    """Which client role (:data:`ROLES`) trains, evaluates or counts the examples for this message."""

    role: str

    def __post_init__(self) -> None:
        check_choice(self, "role", ROLES)


# -- local training ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainSpec(Spec):
    """The recipe's local training settings (``train.*`` but ``seq_len``, which :class:`ClientSpec` carries)."""

    local_steps: int
    lr: float
    batch_size: int
    weight_decay: float
    optimizer: str
    checkpoint: bool = False  # activation checkpointing (torch clients: :func:`fedfusion.train.loop.train_steps`)

    def __post_init__(self) -> None:
        check_choice(self, "optimizer", OPTIMIZERS)

    @classmethod
    def from_recipe(cls, train: TrainConfig) -> TrainSpec:
        """The spec of the recipe's ``train`` section (a renamed recipe field fails here, not on a client)."""
        return cls(**{f.name: getattr(train, f.name) for f in fields(cls)})

    def steps_kwargs(self, seed: int) -> dict[str, Any]:
        """Keyword arguments of :func:`fedfusion.train.loop.train_steps` (and of the device runtime's loop)."""
        return dict(steps=self.local_steps, lr=self.lr, batch_size=self.batch_size, weight_decay=self.weight_decay,
                    optimizer=self.optimizer, seed=seed)


def read_train(config: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of :func:`fedfusion.train.loop.train_steps` from a message's train and round specs."""
    return TrainSpec.from_config(config).steps_kwargs(RoundSpec.from_config(config).seed)


@dataclass(frozen=True)
class FaultSpec(Spec):
    """The recipe's injected faults (``faults.*``). A message without any fault key injects none; one with only
    some of them is refused."""

    prefix = "fault-"
    crash_prob: float = 0.0
    straggler_prob: float = 0.0
    straggler_delay_s: float = 0.0
    corrupt_prob: float = 0.0

    @classmethod
    def from_recipe(cls, faults: FaultConfig) -> FaultSpec:
        return cls(**asdict(faults))

    @classmethod
    def read(cls, config: Mapping[str, Any]) -> FaultSpec:
        """The faults a message asks for (none when it carries no fault key)."""
        return cls.from_config_if_any(config) or cls()


@dataclass(frozen=True)
class PrivacySpec(Spec):
    """Client-side differential privacy (``privacy.*``, read by :mod:`fedfusion.clients.privacy`); the clipping
    norm travels under the key Flower's own DP mods read."""

    prefix = "dp-"
    mode: str
    clipping_norm: float = field(metadata={KEY: KEY_CLIPPING_NORM})
    epsilon: float
    delta: float
    noise_multiplier: float = 1.0  # dp_sgd

    def __post_init__(self) -> None:
        check_choice(self, "mode", PRIVACY_MODES)

    @classmethod
    def from_recipe(cls, privacy: PrivacyConfig) -> PrivacySpec:
        return cls(privacy.mode, privacy.clipping_norm, privacy.epsilon, privacy.delta, privacy.noise_multiplier)


@dataclass(frozen=True)
class SecAggSpec(Spec):
    """One step of secure aggregation (:mod:`fedfusion.wire.secagg`; ``privacy.secure_aggregation``): ``stage`` is
    ``keys``, ``shares``, ``train`` or ``unmask``; ``nodes`` the round's node ids (as text) in the order that
    numbers them (a client's position is its number); ``peers`` the positions a stage works with (shares: those
    that sent keys; train: those whose shares went out, the pairs that mask; unmask: those whose masked vector the
    server holds) and ``dropped`` (unmask) those whose mask key the server may rebuild; ``weighting`` says whether
    the update is weighted by its examples before it is masked."""

    prefix = "secagg-"
    stage: str
    round: int
    nodes: tuple[str, ...] = field(metadata=JSON)
    threshold: int
    peers: tuple[int, ...] = field(default=(), metadata=JSON)
    dropped: tuple[int, ...] = field(default=(), metadata=JSON)
    weighting: str = "uniform"

    def __post_init__(self) -> None:
        check_choice(self, "stage", SECAGG_STAGES)

    def position(self, node: int) -> int:
        """``node``'s number in this round; SpecError if the round does not hold it."""
        if str(node) not in self.nodes:
            raise SpecError(f"secure aggregation: node {node} is not one of round {self.round}'s nodes")
        return self.nodes.index(str(node))


SECAGG_ACTION = "secagg"  # message type "query.secagg": the ClientApp's @app.query("secagg")
SECAGG_STAGES = ("keys", "shares", "train", "unmask")


# -- what each role trains -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec(Spec):
    """The Hugging Face config (``PretrainedConfig.to_dict()``) of the model a client rebuilds from the arrays."""

    model_config: dict[str, Any] = field(metadata=JSON)

    def __post_init__(self) -> None:
        if not isinstance(self.model_config, dict) or not self.model_config.get("model_type"):
            raise SpecError(f"message spec {self.key('model_config')!r}: not a model config with a model_type")


@dataclass(frozen=True)
class SliceSpec(Spec):
    """A width slice (role submodel): its width, the slicing policy and the axes sliced (None: the family's all)."""

    width: float
    policy: str
    axes: tuple[str, ...] | None = field(metadata=JSON)

    def __post_init__(self) -> None:
        check_choice(self, "policy", POLICIES)


@dataclass(frozen=True)
class WindowSpec(Spec):
    """A full-forward window (role window): the target units it trains (``SlicePlan.assignment()`` runs),
    whether the tensors on no sliced axis (embeddings, norms) are part of it, and ``rank``: 0 trains the units'
    exact values; r >= 1 trains a rank-r update of every matrix the message does not carry exactly
    (:mod:`fedfusion.models.low_rank`); ``core``: the small model's units inside the window, trained in its own
    forward pass (``fusion.core_forward: small``; empty: none); ``expand``: the device's memory holds the frozen
    target in float32, so it makes it so once for the round instead of in every pass (the same values, faster)."""

    units: dict[str, list[list[int]]] = field(metadata=JSON)
    shared: bool
    rank: int = 0
    core: dict[str, list[list[int]]] = field(default_factory=dict, metadata=JSON)
    expand: bool = False


@dataclass(frozen=True)
class OrderedSpec(Spec):
    """FjORD's nested widths (sent only with policy ``ordered``): the fractions each step samples, and whether the
    widest teaches the narrower ones."""

    prefix = "ordered-"
    fractions: tuple[float, ...] = field(metadata=JSON)
    distill: bool


# -- how a client replies -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WireSpec(Spec):
    """The uplink's format (:data:`fedfusion.wire.quantize.UPLINK`) and whether a quantised uplink keeps its rounding
    error for the next reply (error feedback). The downlink's format travels in the arrays themselves."""

    prefix = "wire-"
    up: str = "float32"
    error_feedback: bool = False

    def __post_init__(self) -> None:
        check_choice(self, "up", UPLINK)

    @classmethod
    def read(cls, config: Mapping[str, Any]) -> WireSpec:
        """The uplink a message asks for (float32 when it carries no wire key)."""
        return cls.from_config_if_any(config) or cls()


# -- the capability query ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PopulationSpec(Spec):
    """The recipe's seeded population (sent in the capability query): a simulated node draws its tier from it; with
    ``supernodes`` > 1 per client (the units mode) node ``partition-id`` p is client ``p // supernodes``."""

    prefix = "population-"
    mix: dict[str, float] = field(metadata=JSON)
    num_clients: int
    seed: int
    supernodes: int = 1

    def client(self, partition: int) -> int:
        """The client (device) whose node has ``partition-id`` ``partition``."""
        return partition // self.supernodes


@dataclass(frozen=True)
class Caps(Spec):
    """What a node reports in its capability-query reply (besides the host facts of
    :func:`fedfusion.devices.hardware.capabilities`): its device tier, data partition and number of training examples."""

    device: str
    partition: int
    examples: int


@dataclass(frozen=True)
class UnitsSpec(Spec):
    """A units-mode message (``train.units``): the payload is one uint8 array, ``UNITS_PAYLOAD`` of the ArrayRecord
    ``UNITS_RECORD`` (fedfusion.units.messages' wire format); ``stall_s`` > 0 is an injected fault: the node sleeps
    that long before it answers (a device gone silent mid-phase)."""

    prefix = "units-"
    stall_s: float = 0.0


UNITS_ACTION = "units"  # message type "train.units": the ClientApp's @app.train("units")
UNITS_RECORD = "units"  # the ArrayRecord (and reply ArrayRecord) that carries the bytes
UNITS_PAYLOAD = "payload"  # its one array: the message's bytes as uint8
UNITS_ERROR = "units-error"  # a reply's ConfigRecord when the node could not compute (lost weight cache): the server resends
# the message types of their own (train.<action>) -> the role (ROLES) whose ``answer(msg, context)`` replies to them
ACTIONS = {UNITS_ACTION: UNITS}

# the specs of this module; spec_types() adds the methods' own
SPEC_TYPES: tuple[type[Spec], ...] = (ClientSpec, RoundSpec, RoleSpec, TrainSpec, FaultSpec, PrivacySpec, ModelSpec,
                                      SliceSpec, WindowSpec, OrderedSpec, WireSpec, PopulationSpec, Caps, UnitsSpec)


def spec_types() -> tuple[type[Spec], ...]:
    """Every message spec: this module's and the ones the methods declare in their folders (each registry entry's
    ``specs``, imported now)."""
    return SPEC_TYPES + tuple(hook(path) for m in METHODS for path in m.specs)
