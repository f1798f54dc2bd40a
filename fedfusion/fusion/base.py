
"""The fusion-method protocol: what a method must say, without Flower.

A method deals in dicts of tensors and plain spec dicts; the round engine
(:class:`fedfusion.strategies.fusion.FusionStrategy`, or the in-process driver :mod:`fedfusion.fusion.inprocess`) does
discovery, sampling, seeds, reply ordering, quorum cuts and the void-round rule once for every method, and
asks the method assigned to a client's tier for that client's payload, the check of its reply and the fold.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from fedfusion.wire.finite import all_finite
from fedfusion.wire.keys import DEVICE_STEP_S, NUM_EXAMPLES

State = dict[str, torch.Tensor]


class BuildTarget(Protocol):
    """What a method's builder (its registry entry's ``build``) reads of the server's target
    (:class:`fedfusion.run.targets.Target`)."""

    @property
    def model(self) -> Any: ...

    @property
    def initial(self) -> Callable[[], State]: ...  # the state round 1 starts from, a fresh copy each call

    @property
    def params(self) -> int: ...


@dataclass(frozen=True)
class Client:
    """One sampled client as a method sees it: its data partition (what seeds and windows follow), device tier,
    this round's seed and the capabilities it reported."""

    partition: int
    tier: str
    seed: int
    caps: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Payload:
    """What one client is sent in one round, and what the ledger records about it.

    ``arrays`` and ``spec`` go into the message (the engine adds the common training spec, the round, the seed
    and the round's lr times ``lr_scale``); ``params`` is what the ledger prices (6 FLOPs per parameter per
    token); ``sent_norm`` is the scale a reply's norm is judged against (0: no norm check); ``context`` is the
    method's own note for :meth:`check`.
    """

    client: Client
    arrays: State
    spec: dict[str, Any]
    width: float
    params: int
    sent_norm: float = 0.0
    assignment: dict[str, Any] = field(default_factory=dict)
    row: dict[str, Any] = field(default_factory=dict)  # method-specific ledger fields (e.g. LoRA's rank)
    context: Any = None
    lr_scale: float = 1.0  # the client trains at the round's lr times this (a narrow window's faster rate)


@dataclass(frozen=True)
class Update:
    """An accepted reply: its payload, fold weight, norm and the method's checked data."""

    payload: Payload
    weight: float
    norm: float
    data: Any


@dataclass(frozen=True)
class Fold:
    """What a method's fold made of a round's accepted updates."""

    target: State
    coverage: float  # fraction of the target the round's updates moved
    stats: dict[str, float] = field(default_factory=dict)  # the round's aggregate metrics (distillation losses ...)
    server_cost: dict[str, float] = field(default_factory=dict)  # flops, seconds, tokens of the server's own work


@dataclass(frozen=True)
class TierCost:
    """What one tier's round of work is: parameters trained (priced), bytes sent down (and up, where a quantised
    uplink makes them differ), and the fraction of the target's width it holds (1 for methods whose clients run a
    whole model: LoRA, a family model)."""

    params: int
    nbytes: int
    width: float = 1.0
    nbytes_up: int | None = None  # None: as many as go down

    @property
    def bytes_up(self) -> int:
        """Bytes of one reply."""
        return self.nbytes if self.nbytes_up is None else self.nbytes_up


@runtime_checkable
class SecureFold(Protocol):
    """A method whose round can fold from one sum of its clients' weighted changes, padded to the target's shape,
    instead of each client's update: what secure aggregation gives the server (:mod:`fedfusion.wire.secagg`)."""

    def secure_layout(self, payload: Payload) -> State:
        """The arrays that tell ``payload``'s client where its trained arrays sit in the target."""
        ...

    def secure_names(self, target: State) -> list[str]:
        """The target tensors a padded change holds, in its order."""
        ...

    def secure_support(self, target: State, payloads: Sequence[Payload]) -> dict[str, torch.Tensor]:
        """Per target tensor, the coordinates some payload of ``payloads`` trains (bool)."""
        ...

    def fold_sum(self, server_round: int, target: State, updates: Sequence[Update], total: State) -> Fold:
        """The round folded from ``updates`` (who trained what, at which weight; no data) and ``total``."""
        ...


class FusionMethod(ABC):
    """One way to turn what devices can train into an update of the target (see the module docstring)."""

    name: str = ""  # the recipe's fusion.method, written into every ledger row
    role: str = ""  # the client role that trains its payloads (fedfusion.wire.specs.ROLES)
    noun: str = "model"  # what a payload is called in rejection messages

    @abstractmethod
    def tier_cost(self, tier: str) -> TierCost:
        """What one client of ``tier`` trains and moves in a round (for planning, pricing and selection)."""

    @abstractmethod
    def payloads(self, server_round: int, target: State, clients: Sequence[Client]) -> list[Payload]:
        """The payload of each of this round's ``clients`` (in sample order). One call per round, not per client:
        staggered slices lay every sampled client's window after the previous one's."""

    @abstractmethod
    def check(self, payload: Payload, reply: State, weight: float) -> Update:
        """Accept a reply to ``payload`` as an :class:`Update`, or raise ValueError saying what is wrong with it
        (keys, shapes, NaN/Inf, ...). Nothing of the method's state may change here."""

    @abstractmethod
    def fold(self, server_round: int, target: State, updates: Sequence[Update]) -> Fold:
        """The round's accepted updates (at least one, in sample order) folded into ``target``."""

    def failed(self, client: Client, error: str) -> None:
        """Called when ``client``'s node replied an error (``error``: its exception line) instead of an update; most
        methods keep nothing on a node that such an error could tell them of."""
        return None

    def begin(self, target: State) -> State:
        """The target a fresh run starts from (not a resumed one): the built target, or a method's own start
        (e.g. a grow-then-fuse run's silenced target)."""
        return target

    def observe(self, population: Mapping[int, str]) -> None:
        """Called before :meth:`payloads` with the tier of every partition known so far (partition -> tier);
        most methods need nothing of it."""
        return None

    def evaluation(self, target: State, tier: str) -> tuple[State, dict[str, Any]]:
        """The arrays and spec a ``tier`` client scores the target with (federated evaluation)."""
        raise NotImplementedError(f"fusion method {self.name!r} has no federated evaluation")

    def metrics(self) -> dict[str, float]:
        """Extra per-round metrics of the method's own models (written into the round's metrics row)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep beyond the target (JSON-able)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output (a method whose state is all in the target has none)."""
        return None

    def describe(self) -> str:
        """One line of settings for the run log."""
        return self.name


@dataclass(frozen=True)
class ClientRound:
    """What one client did in one round (a clients.jsonl row)."""

    node: int
    device: str
    width: float
    method: str = ""
    assignment: dict[str, Any] = field(default_factory=dict)
    status: str = "sent"  # sent -> ok | failed | rejected | timeout | cut (over-selection); or dropped (never sent)
    partition: int = -1
    examples: int = 0
    train_loss: float | None = None
    train_s: float | None = None
    device_s: float | None = None  # training seconds the priced device measured itself (a real phone): priced as is
    bytes_down: int = 0
    bytes_up: int = 0
    params: int = 0  # parameters priced for the work sent
    sent_norm: float = 0.0  # the scale of what was sent, to judge the reply's norm
    tokens: int = 0  # tokens trained: planned when sent, as reported once the reply arrives
    error: str | None = None
    measured_j: float | None = None  # host energy the client measured while training (not the priced device)
    measured_source: str | None = None  # the meters read, e.g. "nvml+rapl" (fedfusion.devices.meters)
    extra: dict[str, Any] = field(default_factory=dict)  # the method's own fields (Payload.row)

    def to_dict(self) -> dict[str, Any]:
        """The ledger row: the common fields, then the method's own."""
        row = asdict(self)
        return {**{k: v for k, v in row.items() if k != "extra"}, **row["extra"]}


@dataclass(frozen=True)
class RoundReport:
    """Everything one round produced, handed to the run's listeners once the round is over (frozen).

    Round 0 is the target before training: no clients, ``metrics`` its central evaluation.
    """

    round: int
    metrics: Mapping[str, Any]  # the target's central evaluation (empty when the run does not evaluate)
    clients: tuple[ClientRound, ...] = ()
    coverage: float = 0.0
    void: bool = False
    aggregate_s: float = 0.0
    clock_s: float = 0.0  # simulated time when the round started
    fed_eval: Mapping[str, float] = field(default_factory=dict)  # federated evaluation + the methods' own metrics
    server_cost: Mapping[str, float] = field(default_factory=lambda: {"flops": 0.0, "seconds": 0.0, "tokens": 0.0})
    nodes: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)  # every node's capabilities known so far
    arrays: Any = None  # the target as the engine carries it after this round


def state_norm(state: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of all tensors of a state together (NaN if any value is NaN); each tensor's norm by one reduction in
    float32, with no squared copy (the server takes one of every reply)."""
    norms = [torch.linalg.vector_norm(t if t.is_floating_point() else t.float(), dtype=torch.float32)
             for t in state.values()]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def state_size(state: Mapping[str, torch.Tensor], width: float = 1.0) -> TierCost:
    """Parameters and bytes of a state as it travels, as a tier's cost."""
    return TierCost(sum(t.numel() for t in state.values()), sum(t.nbytes for t in state.values()), width)


def check_same_layout(update: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise ValueError unless ``update`` has exactly ``reference``'s keys and shapes and finite values."""
    if set(update) != set(reference):
        missing, extra = set(reference) - set(update), set(update) - set(reference)
        raise ValueError(f"update keys differ from the {what}: missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]}")
    for name, value in update.items():
        if value.shape != reference[name].shape:
            raise ValueError(f"{name}: shape {tuple(value.shape)} does not match the {what}'s {tuple(reference[name].shape)}")
        if not all_finite(value):
            raise ValueError(f"{name}: update holds NaN or Inf")


@dataclass(frozen=True)
class TrainMetrics:
    """A reply's training numbers, checked."""

    examples: int
    loss: float
    seconds: float
    tokens: int
    device_s: float | None = None  # ``seconds`` when the priced device itself measured them (a real phone), else None


def read_train_metrics(metrics: Mapping[str, Any], planned_tokens: int) -> TrainMetrics:
    """A reply's (num-examples, train_loss, train_s, train_tokens), read and checked before its update is used, so
    a reply with broken numbers is rejected whole instead of half folded in; a missing key raises KeyError. A reply
    that carries :data:`~fedfusion.wire.keys.DEVICE_STEP_S` came from a real device: its ``train_s`` is that
    device's own time (``device_s``)."""
    n, loss, seconds = int(metrics[NUM_EXAMPLES]), float(metrics["train_loss"]), float(metrics["train_s"])
    tokens = int(metrics.get("train_tokens", planned_tokens))
    if n <= 0:
        raise ValueError(f"num-examples is {n}")
    if not (math.isfinite(loss) and math.isfinite(seconds) and seconds >= 0 and tokens >= 0):
        raise ValueError(f"train metrics out of range: loss {loss}, seconds {seconds}, tokens {tokens}")
    step = metrics.get(DEVICE_STEP_S)
    if step is not None and not (math.isfinite(float(step)) and float(step) >= 0):
        raise ValueError(f"{DEVICE_STEP_S} is {step}: a device's step time must be a finite number >= 0")
    return TrainMetrics(n, loss, seconds, tokens, seconds if step is not None else None)
