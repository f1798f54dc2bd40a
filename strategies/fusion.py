"""The one Flower strategy: drives any fusion method (:mod:`fedfusion.fusion`), or several at once, one per tier.

Round flow (``Strategy.start`` drives it):
1. ``configure_train``: the round's candidate pool (every connected node up to ``pool`` of them, else a random
   ``pool`` of them, more while too few are eligible), a QUERY round for the pool's nodes not seen yet (their
   device tier), then the participation draw over the pool (:mod:`fedfusion.selection.participation`); every sampled node
   gets a fresh Message with the payload the method of its tier makes for it, the common training spec and its
   seed (:func:`fedfusion.fusion.rounds.client_seed`).
2. ``aggregate_train``: replies in sample order (not arrival order, so float sums and reruns repeat exactly); an
   error reply is ``failed`` (and told to its method: a node may say it lost what the method keeps there); broken
   train metrics, a reply the method's check refuses, or an update norm over ``max_norm_ratio`` times the norm
   sent is ``rejected``; silent nodes ``timeout`` (or ``cut`` once an over-selection quorum closed the round).
   Fewer than ``min_clients`` good replies leave the target unchanged (a void round). Otherwise each method folds
   its own updates, in :data:`fedfusion.fusion.rounds.FOLD_ORDER` (:func:`fedfusion.fusion.rounds.fold_round`,
   which the in-process driver runs too).
3. After Flower's central evaluation (``evaluate_fn``) the round is over: a frozen
   :class:`~fedfusion.fusion.base.RoundReport` goes to every listener (the run recorder writes ledgers and the
   checkpoint from it).

The strategy holds only its :class:`StrategySettings`; what a run changes (the methods' and the participation
draw's state, the nodes learnt, the round in progress, the rounds done before a resume) is the :class:`RunState` it
is given, which a checkpoint saves and a resume restores as one thing.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from logging import INFO, WARNING
from typing import Any, cast

import numpy as np
import torch
from fedfusion.strategies.nodes import connected_nodes, query_messages
from fedfusion.strategies.records import RoundRecords, record_tensors
from fedfusion.strategies.secagg import SecureAggregation
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedfusion.devices.energy import WorkCost, price_work, train_flops
from fedfusion.devices.hardware import use_fastest_threads
from fedfusion.devices.meters import read_measured
from fedfusion.fusion.base import (
    Client,
    ClientRound,
    Fold,
    FusionMethod,
    Payload,
    RoundReport,
    SecureFold,
    Update,
    read_train_metrics,
)
from fedfusion.fusion.rounds import client_seed, client_steps, fold_order, fold_round, round_payloads
from fedfusion.fusion.state import rng_state, set_rng_state
from fedfusion.selection.participation import Participation, draw_size
from fedfusion.train.dp import ClientBudgets
from fedfusion.wire.keys import NUM_EXAMPLES
from fedfusion.wire.secagg import SUPPORT_KEY, decode, pack_support, unflatten, unpack_support
from fedfusion.wire.specs import DROPPED, Caps, ClientSpec, PrivacySpec, RoundSpec, SpecError, TrainSpec

Listener = Callable[[RoundReport], None]


def scored_round(server_round: int, last: int, eval_every: int) -> bool:
    """Whether central evaluation scores round ``server_round`` of a run whose last round is ``last``
    (``train.eval_every``): round 0 (the target before training) and the last round always; between them the
    rounds that ``eval_every`` divides (0: none of them)."""
    return server_round in (0, last) or (eval_every > 0 and server_round % eval_every == 0)


def error_line(reason: str) -> str:
    """The exception line of an error reply (Ray wraps the client's traceback around it)."""
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "unknown error")[:500]


@dataclass
class _Round:
    """The round in progress (:attr:`RunState.round`); frozen into a RoundReport at its end."""

    number: int = 0
    target: dict[str, Any] = field(default_factory=dict)  # the target this round started from
    rows: dict[int, ClientRound] = field(default_factory=dict)  # node -> row, in sample order
    payloads: dict[int, Payload] = field(default_factory=dict)
    coverage: float = 0.0
    void: bool = False
    aggregate_s: float = 0.0
    clock_s: float = 0.0
    fed_eval: dict[str, float] = field(default_factory=dict)
    server_cost: dict[str, float] = field(default_factory=lambda: {"flops": 0.0, "seconds": 0.0, "tokens": 0.0})
    # secure aggregation: the shapes of the tensors a masked vector is cut from (flattened in this order; the method's
    # padded change), each node's masked vector, and the coordinates of that flat vector they carry (the round's support)
    secure_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    masked: dict[int, np.ndarray] = field(default_factory=dict)
    support: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # the flat coordinates they carry
    grid: Grid | None = None  # the round's grid, for secure aggregation's unmask step


def private_budgets(train_config: Mapping[str, Any]) -> ClientBudgets | None:
    """The clients' DP-SGD budgets of a run whose common spec asks for ``privacy.mode=dp_sgd``, else None."""
    spec = PrivacySpec.from_config_if_any(train_config)
    if spec is None or spec.mode != "dp_sgd":
        return None
    return ClientBudgets(spec.noise_multiplier, spec.delta, spec.epsilon, {})


@dataclass(frozen=True)
class StrategySettings:
    """What the fusion strategy is told once and never changes: each knob with its one default, checked here.

    ``pool`` bounds the nodes a round considers: a population of at most ``pool`` nodes is queried whole in round 1
    and every draw is over all of it; a larger one is drawn from a seeded random ``pool`` of its nodes each round
    (for a random selector the same as a draw over all of them), and only those are queried, each once: the server
    learns a node's partition and tier only from its answer (Flower gives a server no view of a node's config, and
    a deployed device reports its own tier), and in Flower's simulation engine the QUERY of every node costs
    nodes x pending messages per sweep, so 10,000 of them outlast any round deadline.

    ``client_lr`` gives the clients' lr of a round (``train.lr_schedule``: a decay over rounds); every message of
    the round carries it in place of ``train_config``'s, times its payload's ``lr_scale`` (a narrow window's faster
    rate, ``fusion.window_lr_power``).

    ``max_epochs`` (``train.max_epochs``) caps a client's local steps at that many passes over the examples its
    capability reply counted (:func:`fedfusion.fusion.rounds.client_steps`): its message carries its own
    ``local_steps`` and its ledger row the tokens of those steps. 0: every client takes ``train_config``'s. Each
    tier's planned cost (what the participation draw predicts) stays that of ``train_config``'s steps, the most a
    client takes.

    ``eval_every`` (``train.eval_every``): central evaluation (``start``'s ``evaluate_fn``) scores round 0, the last
    round and every ``eval_every``-th round between (0: none between, :func:`scored_round`); an unscored round's
    report has no target metrics.

    ``server_threads`` fixes the torch threads of the server's own work; 0 measures each round whether all of
    them beat one (:func:`fedfusion.devices.hardware.use_fastest_threads`)."""

    clients_per_round: int
    min_clients: int = 1
    query_config: Mapping[str, Any] = field(default_factory=dict)  # the QUERY messages' spec
    train_config: Mapping[str, Any] = field(default_factory=dict)  # the spec every train message carries
    weighting: str = "uniform"  # uniform | examples: a reply's weight in the fold
    evaluate_clients: int = 0  # nodes a federated evaluation round asks (0: none)
    seed: int = 0  # the run's seed (train_config's RoundSpec seed where it has one)
    max_norm_ratio: float = 10.0  # a reply whose update norm is over this many times the norm sent is rejected
    overselect: float = 0.0  # draw this fraction more; the round closes at clients_per_round replies (QuorumGrid)
    wait_nodes_s: float = 60.0
    query_timeout_s: float = 600.0
    pool: int = 1000
    client_lr: Callable[[int], float] | None = None  # the clients' lr in a round (a schedule); None: train_config's
    server_threads: int = 0
    eval_every: int = 1
    max_epochs: float = 0.0

    def __post_init__(self) -> None:
        if self.weighting not in ("uniform", "examples"):
            raise ValueError(f"weighting must be uniform or examples, got {self.weighting!r}")
        if self.overselect < 0:
            raise ValueError(f"overselect must be >= 0, got {self.overselect}")
        if self.pool < self.per_round_draw:
            raise ValueError(f"pool must hold at least the {self.per_round_draw} clients a round draws, got {self.pool}")
        if self.server_threads < 0:
            raise ValueError(f"server_threads must be >= 0, got {self.server_threads}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        if self.max_epochs < 0:
            raise ValueError(f"max_epochs must be >= 0, got {self.max_epochs}")
        object.__setattr__(self, "query_config", dict(self.query_config))
        object.__setattr__(self, "train_config", dict(self.train_config))

    @property
    def per_round_draw(self) -> int:
        """Clients a round draws (``clients_per_round``, and over-selection's extra ones)."""
        return draw_size(self.clients_per_round, self.overselect)

    @property
    def run_seed(self) -> int:
        """The run's seed, as the train messages carry it: what client seeds and the pools' draws follow."""
        return int(self.train_config.get(RoundSpec.key("seed"), self.seed))


@dataclass
class RunState:
    """Everything the fusion strategy changes as a run goes on, in one object: its tiers' methods and the
    participation draw (each with its own state), the seeded rng of the evaluation samples, the clients' DP-SGD
    budgets, the nodes it has learnt, the round in progress and the rounds done before a resume. A checkpoint keeps
    :meth:`state_dict` and a resume restores it with :meth:`load_state_dict`: the resumed run samples and folds as
    the uninterrupted one would. What it learns of nodes is not kept: node ids change when a federation restarts, so
    the strategy queries them again."""

    methods: dict[str, FusionMethod]  # device tier -> the method its clients train with (one may serve several)
    participation: Participation
    rng: random.Random
    budgets: ClientBudgets | None = None  # dp_sgd: each client's epsilon, accounted here
    rounds_done: int = 0  # rounds done before a resume: Flower counts from 1 again, the run does not
    total_rounds: int = 0  # the run's rounds, resumed ones included (set by start)
    caps: dict[int, dict[str, Any]] = field(default_factory=dict)  # node -> its capability reply
    unusable: set[int] = field(default_factory=set)  # nodes that answered with a tier no method trains: never asked again
    exhausted: set[int] = field(default_factory=set)  # dp_sgd: partitions left out for their budget (logged once)
    costs: dict[str, WorkCost] = field(default_factory=dict)  # each tier's planned work, priced once per run
    round: _Round = field(default_factory=_Round)
    # host seconds per trained token of each tier's clients in the last round it trained: what orders a round's
    # messages longest first (not kept by a checkpoint: the order changes no result)
    rates: dict[str, float] = field(default_factory=dict)
    threads_used: int = 0  # the torch threads of the last round's server work (0: none yet)

    def __post_init__(self) -> None:
        if not self.methods:
            raise ValueError("no fusion method: map at least one device tier to a method")
        self.fold_order = fold_order(self.methods)  # each method once, in fold order

    @classmethod
    def begin(cls, methods: Mapping[str, FusionMethod], participation: Participation,
              settings: StrategySettings) -> RunState:
        """A new run's state: nothing learnt yet, the rng seeded with the run's seed, DP-SGD budgets where the train
        spec asks for them."""
        return cls(dict(methods), participation, random.Random(settings.seed), private_budgets(settings.train_config))

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep for a resumed run to sample and fold as the uninterrupted one would."""
        return {"rng": rng_state(self.rng), "participation": self.participation.state_dict(),
                "methods": {m.name: m.state_dict() for m in self.fold_order},
                "dp_history": {} if self.budgets is None else dict(self.budgets.history)}

    def load_state_dict(self, state: dict[str, Any], rounds_done: int) -> None:
        """Continue from a checkpoint taken after ``rounds_done`` rounds."""
        set_rng_state(self.rng, state["rng"])
        self.participation.load_state_dict(state["participation"])
        for method in self.fold_order:
            method.load_state_dict(state.get("methods", {}).get(method.name, {}))
        if self.budgets is not None:
            self.budgets.history = {int(p): [tuple(e) for e in h] for p, h in state.get("dp_history", {}).items()}
        self.rounds_done = rounds_done


class FusionStrategy(Strategy):
    """Node discovery, participation, seeds, reply checks, quorum cuts and the void-round rule, written once for
    every fusion method. It holds its :class:`StrategySettings` and is given the :class:`RunState` it changes; a node
    whose tier has no method is not sampled. ``listeners`` get each round's :class:`RoundReport`; ``secure`` runs
    secure aggregation around every round."""

    def __init__(self, settings: StrategySettings, run: RunState, listeners: Iterable[Listener] = (),
                 secure: SecureAggregation | None = None) -> None:
        if secure is not None and (len(run.fold_order) != 1 or not isinstance(run.fold_order[0], SecureFold)):
            raise ValueError("secure aggregation folds one sum of target-shaped changes: every tier must train "
                             f"one method that can (submodel or lora), got {[m.name for m in run.fold_order]}")
        self.settings, self.run = settings, run
        self.listeners = list(listeners)
        # secure aggregation: the server folds one unmasked sum, so it never checks one client's update
        self.secure = secure

    @property
    def max_norm_ratio(self) -> float:
        """The update norm check's ratio (:class:`StrategySettings`); 0, no check, under secure aggregation (the
        server sees one unmasked sum) or local DP (noise on every coordinate: a reply's norm says nothing of abuse)."""
        local_dp = self.settings.train_config.get(PrivacySpec.key("mode")) == "local"
        return 0.0 if local_dp or self.secure is not None else self.settings.max_norm_ratio

    def summary(self) -> None:
        """Log the strategy's settings."""
        tiers = {tier: m.name for tier, m in self.run.methods.items()}
        log(INFO, "FusionStrategy: tiers=%s clients/round=%d", tiers, self.settings.clients_per_round)
        for method in self.run.fold_order:
            log(INFO, "  %s", method.describe())

    # -- the loop: Flower's own, with a report after each round's central evaluation ----------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Flower's ``Strategy.start``; ``evaluate_fn`` is central evaluation only, called on the rounds
        :func:`scored_round` picks, and once a round is over (scored or not) its :class:`RoundReport` goes to every
        listener."""
        last = self.run.rounds_done + num_rounds  # the run's last round, whatever part of it this start runs
        self.run.total_rounds = last

        def evaluate_and_report(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            if server_round == 0 and self.run.rounds_done:
                return None  # a resumed run: the checkpointed target was scored when it was saved
            if server_round == 0:
                self.set_threads()
            scored = scored_round(server_round + self.run.rounds_done, last, self.settings.eval_every)
            metrics = evaluate_fn(server_round, arrays) if evaluate_fn is not None and scored else None
            report = self.report(server_round, arrays, dict(metrics.items()) if metrics is not None else {})
            for listener in self.listeners:
                listener(report)
            if arrays is not initial_arrays:  # Flower's loop keeps its argument for the whole run, never to read it
                initial_arrays.clear()        # again once a round has replaced it: a whole target's bytes let go
            return metrics

        return super().start(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config,
                             evaluate_and_report)

    def report(self, server_round: int, arrays: ArrayRecord, metrics: Mapping[str, Any]) -> RoundReport:
        """The frozen account of round ``server_round`` (0: the target before training)."""
        nodes = {n: dict(c) for n, c in self.run.caps.items()}
        if server_round == 0:
            return RoundReport(round=0, metrics=metrics, nodes=nodes, arrays=arrays)
        r = self.run.round
        fed_eval = {k: v for m in self.run.fold_order for k, v in m.metrics().items()} | r.fed_eval
        return RoundReport(round=r.number, metrics=metrics, clients=tuple(r.rows.values()), coverage=r.coverage,
                           void=r.void, aggregate_s=r.aggregate_s, clock_s=r.clock_s, fed_eval=fed_eval,
                           server_cost=dict(r.server_cost), nodes=nodes, arrays=arrays)

    # -- capability discovery and sampling ------------------------------------------------------
    def _wait_for_nodes(self, grid: Grid) -> list[int]:
        s = self.settings
        nodes = connected_nodes(grid, s.clients_per_round, s.wait_nodes_s)
        if len(nodes) < s.min_clients:
            raise RuntimeError(
                f"only {len(nodes)} nodes connected after {s.wait_nodes_s:.0f}s; need selection.min_clients={s.min_clients}"
            )
        return nodes

    def query_nodes(self, grid: Grid, nodes: list[int]) -> None:
        """QUERY every node of ``nodes`` not seen yet for its capabilities (device tier, partition, data size); a
        node that did not answer is asked again when a later round's pool holds it."""
        new = [n for n in nodes if n not in self.run.caps and n not in self.run.unusable]
        if not new:
            return
        # The first message to a node may start its process (a Ray actor importing torch): allow the
        # round deadline, not the short registration wait.
        for reply in grid.send_and_receive(query_messages(new, self.settings.query_config),
                                         timeout=self.settings.query_timeout_s):
            node = reply.metadata.src_node_id
            if reply.has_error():
                log(WARNING, "node %s: capability query failed: %s", node, reply.error.reason)
                continue
            caps = dict(reply.content["caps"])
            try:
                known = Caps.from_config(caps)
            except SpecError as e:
                log(WARNING, "node %s: capability reply refused: %s", node, e)
                continue
            if known.device not in self.run.methods:
                log(WARNING, "node %s: device %r has no fusion method in the recipe; it is not sampled",
                    node, known.device)
                self.run.unusable.add(node)
                continue
            self.run.caps[node] = caps
            self.run.participation.examples[known.partition] = known.examples

    def partition_of(self, node: int) -> int:
        """The node's data partition (what seeds and ``owned`` windows follow)."""
        return int(self.run.caps[node][Caps.key("partition")])

    def device_of(self, node: int) -> str:
        """The node's device tier, as its capability reply said."""
        return str(self.run.caps[node][Caps.key("device")])

    def tokens(self, steps: int | None = None) -> int:
        """Tokens a client trains in a round: ``steps`` (default ``train_config``'s local steps) x batch x sequence
        length."""
        c = self.settings.train_config
        steps = int(c.get(TrainSpec.key("local_steps"), 0)) if steps is None else steps
        return steps * int(c.get(TrainSpec.key("batch_size"), 0)) * int(c.get(ClientSpec.key("seq_len"), 0))

    def within_budget(self, by_partition: dict[int, int]) -> dict[int, int]:
        """``by_partition`` less the clients whose next round of DP-SGD would spend more than the run's epsilon
        (each logged when it is left out); all of them without dp_sgd."""
        if self.run.budgets is None:
            return by_partition
        keep = {}
        for p, node in by_partition.items():
            after = self.run.budgets.after(p, *self.private_work(node))
            if after <= self.run.budgets.epsilon:
                keep[p] = node
            elif p not in self.run.exhausted:
                self.run.exhausted.add(p)
                log(WARNING, "partition %d stops training: another round would bring its epsilon to %.3g, over "
                    "privacy.epsilon=%g (spent %.3g)", p, after, self.run.budgets.epsilon, self.run.budgets.spent(p))
        return keep

    def private_work(self, node: int) -> tuple[int, int, int]:
        """(its examples, batch size, local steps) of ``node``'s round: what DP-SGD's accounting charges it."""
        c = self.settings.train_config
        steps = self.local_steps(node) or int(c[TrainSpec.key("local_steps")])
        return int(self.run.caps[node][Caps.key("examples")]), int(c[TrainSpec.key("batch_size")]), steps

    def local_steps(self, node: int) -> int | None:
        """The local steps ``node`` takes this round under ``max_epochs`` (:func:`client_steps`, from the examples
        its capability reply counted); None when no cap applies (``max_epochs`` 0): ``train_config``'s."""
        if not self.settings.max_epochs:
            return None
        c = self.settings.train_config
        return client_steps(int(c[TrainSpec.key("local_steps")]), int(c[TrainSpec.key("batch_size")]),
                            self.settings.max_epochs, int(self.run.caps[node][Caps.key("examples")]))

    def tier_costs(self) -> dict[str, WorkCost]:
        """Each tier's planned work priced on its device, from what its method says the work is (once per run)."""
        if not self.run.costs:
            for tier, method in self.run.methods.items():
                cost = method.tier_cost(tier)
                self.run.costs[tier] = price_work(self.run.participation.catalog[tier], train_flops(cost.params, self.tokens()),
                                              cost.nbytes, cost.bytes_up)
        return self.run.costs

    def candidates(self, grid: Grid, nodes: list[int], server_round: int) -> dict[int, int]:
        """The round's pool of known, usable nodes by partition (partition -> node), its new nodes queried: every
        connected node when there are at most ``pool``, else a seeded random ``pool`` of them, and a further batch of
        ``pool`` while fewer than the round's draw are eligible to train and connected nodes remain."""
        if len(nodes) <= self.settings.pool:
            batches = [nodes]
        else:
            shuffled = random.Random(f"pool:{self.settings.run_seed}:{server_round}").sample(nodes, len(nodes))
            batches = [sorted(shuffled[i:i + self.settings.pool]) for i in range(0, len(shuffled), self.settings.pool)]
        pool: dict[int, int] = {}
        for batch in batches:
            self.query_nodes(grid, batch)
            # Clients are known by partition, not node id (random per run), so a seed reproduces the same draw
            # (of a population within ``pool``: a larger one's pool is drawn over the run's node ids).
            pool.update({self.partition_of(n): n for n in batch if n in self.run.caps})
            if len(batches) > 1 and self.run.participation.eligible(server_round, pool) >= self.settings.per_round_draw:
                break
        return pool

    def sample(self, grid: Grid, server_round: int) -> list[int]:
        """The participation draw over the round's pool: the nodes to train (dropouts are logged, not sent)."""
        nodes = self._wait_for_nodes(grid)
        if self.run.budgets is not None and not self.run.budgets.rounds:  # auto noise: each client's expected rounds
            self.run.budgets.rounds = max(1, math.ceil(self.run.total_rounds * self.settings.per_round_draw / max(len(nodes), 1)))
        by_partition = self.within_budget(self.candidates(grid, nodes, server_round))
        if not by_partition:
            log(WARNING, "no node has answered the capability query; this round trains nobody")
        draw = self.run.participation.draw(server_round, {p: self.device_of(n) for p, n in by_partition.items()},
                                       self.settings.per_round_draw, self.tier_costs())
        self.run.round.clock_s = draw.clock_s
        for p in draw.dropped:
            node, device = by_partition[p], self.device_of(by_partition[p])
            method = self.run.methods[device]
            cost = method.tier_cost(device)
            self.run.round.rows[node] = ClientRound(
                node=node, device=device, width=cost.width, method=method.name, partition=p, status="dropped",
                params=cost.params, bytes_down=cost.nbytes, tokens=self.tokens(self.local_steps(node)),
                error="left its availability window or missed the virtual deadline before finishing")
        return [by_partition[p] for p in draw.train]

    # -- train --------------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One fresh Message per sampled node: the payload its tier's method makes and the common spec."""
        server_round += self.run.rounds_done
        target = record_tensors(arrays)  # over Flower's bytes, no copy: read only
        self.run.round = _Round(number=server_round, target=target)
        nodes = self.sample(grid, server_round)
        left = self.secure.setup(grid, nodes, server_round) if self.secure is not None else {}
        self.run.round.grid = grid
        population = {self.partition_of(n): self.device_of(n) for n in self.run.caps}
        clients = {n: Client(self.partition_of(n), self.device_of(n),
                             client_seed(self.settings.run_seed, server_round, self.partition_of(n)), self.run.caps[n])
                   for n in nodes}
        self.run.round.payloads = dict(zip(nodes, round_payloads(self.run.methods, server_round, target,
                                                                 [clients[n] for n in nodes], population)))
        support = self.secure_support(target, [p for n, p in self.run.round.payloads.items() if n not in left])
        # the round's lr (a schedule's, else the spec's), times what each payload scales it by
        lr = self.settings.train_config.get(TrainSpec.key("lr")) if self.settings.client_lr is None \
            else self.settings.client_lr(server_round)
        # a tensor several payloads hold (the frozen target, quantised once) is serialised once, its bytes shared;
        # the builder takes the arrays, so the payloads keep only what check() reads and no payload (a window, or
        # the whole model of a pretrained target's oracle arm) is held beside its message for the whole round
        records = RoundRecords({n: p.arrays for n, p in self.run.round.payloads.items()})
        self.run.round.payloads = {n: replace(p, arrays={}) for n, p in self.run.round.payloads.items()}
        messages = []
        for node in nodes:
            payload = self.run.round.payloads[node]
            secure: dict[str, Any] = {}
            extra: dict[str, torch.Tensor] = {}
            if self.secure is not None and node not in left:
                method = cast(SecureFold, self.run.methods[payload.client.tier])
                secure, sealed = self.secure.train_parts(node)
                extra = {**method.secure_layout(payload), **sealed, SUPPORT_KEY: support}
            record = records.record(node, extra)
            steps = self.local_steps(node)
            capped = {} if steps is None else {TrainSpec.key("local_steps"): steps}
            noise: dict[str, float] = {}
            if self.run.budgets is not None and not self.run.budgets.noise_multiplier:  # auto: this client's own noise
                noise[PrivacySpec.key("noise_multiplier")] = self.run.budgets.sigma(*self.private_work(node))
            scaled = {} if lr is None else {TrainSpec.key("lr"): lr * payload.lr_scale}
            spec = ConfigRecord({**config, **self.settings.train_config, **scaled, **capped, **noise, **payload.spec, **secure,
                                 **RoundSpec(server_round, payload.client.seed).to_config()})
            self.run.round.rows[node] = ClientRound(
                node=node, device=payload.client.tier, width=payload.width, method=self.run.methods[payload.client.tier].name,
                assignment=payload.assignment, partition=self.partition_of(node),
                bytes_down=record.count_bytes(), params=payload.params, sent_norm=payload.sent_norm,
                tokens=self.tokens(steps), extra=payload.row)
            if node in left:  # secure aggregation's key steps failed for it: it cannot train this round
                self.run.round.rows[node] = replace(self.run.round.rows[node], status="failed", bytes_down=0, error=left[node])
                log(WARNING, "round %d node %d: client failed: %s", server_round, node, left[node])
                continue
            messages.append(Message(RecordDict({"arrays": record, "config": spec}), dst_node_id=node,
                                    message_type=MessageType.TRAIN))
        return sorted(messages, key=lambda m: self.predicted_s(m.metadata.dst_node_id), reverse=True)

    def predicted_s(self, node: int) -> float:
        """How long ``node``'s training this round should take on the host: its tokens at its tier's last measured
        rate (the mean rate of the tiers measured for a tier not yet, 1 before any). A simulation engine with fewer
        slots than clients is sent the round longest first (:class:`~fedfusion.strategies.paced.PacedGrid`), which
        packs them onto its slots more tightly than node order; the replies are folded in sample order whatever
        the order they come in."""
        row = self.run.round.rows[node]
        rates = self.run.rates
        return row.tokens * rates.get(row.device, sum(rates.values()) / len(rates) if rates else 1.0)

    def replies_in_order(self, replies: Iterable[Message]) -> Iterator[tuple[Message, ClientRound]]:
        """This round's replies in sample order, each node once; error replies are recorded as ``failed`` (or
        ``dropped``), told to the node's method (:meth:`~fedfusion.fusion.base.FusionMethod.failed`) and not yielded."""
        rows = self.run.round.rows
        position = {node: i for i, node in enumerate(rows)}
        for reply in sorted(replies, key=lambda m: position.get(m.metadata.src_node_id, len(position))):
            row = rows.get(reply.metadata.src_node_id)
            if row is None or row.status != "sent":  # not sent this round, or a second reply from the node
                continue
            if reply.has_error():
                error = error_line(reply.error.reason or "")
                status = "dropped" if DROPPED in error else "failed"  # a gateway's phone missed its deadline
                rows[row.node] = replace(row, status=status, error=error)
                log(WARNING, "round %d node %d (partition %d): client %s: %s", self.run.round.number, row.node,
                    row.partition, status, error)
                self.run.methods[row.device].failed(self.run.round.payloads[row.node].client, error)
                continue
            yield reply, row

    def accept(self, reply: Message, row: ClientRound) -> Update:
        """The method's checked update from ``reply``, or an exception saying why it cannot be used. The row
        learns the reply's upload and any host energy the client measured, whatever becomes of the update."""
        metrics = reply.content["metrics"]
        measured = read_measured(metrics)
        if measured is not None:
            row = self.run.round.rows[row.node] = replace(row, measured_j=measured[0], measured_source=measured[1])
        record = cast(ArrayRecord, reply.content["arrays"])  # anything else fails here and is rejected
        self.run.round.rows[row.node] = replace(row, bytes_up=record.count_bytes())
        train = read_train_metrics(metrics, row.tokens)
        payload = self.run.round.payloads[row.node]
        method = self.run.methods[row.device]
        weight = float(train.examples) if self.settings.weighting == "examples" else 1.0
        if self.secure is not None:  # a masked vector: who trained what at which weight is all the server reads
            self.run.round.masked[row.node] = self.secure.read(record, self.run.round.support.size)
            update = Update(payload, weight, 0.0, None)
        else:
            # each Array is let go once it is a tensor: the reply's bytes and its tensors are not both held whole
            update = method.check(payload, record.to_torch_state_dict(keep_input=False), weight)
        if self.max_norm_ratio and payload.sent_norm and update.norm > self.max_norm_ratio * payload.sent_norm:
            raise ValueError(f"update norm {update.norm:.3g} is over {self.max_norm_ratio:g}x the norm of the "
                             f"{method.noun} sent ({payload.sent_norm:.3g})")
        ok = replace(self.run.round.rows[row.node], status="ok", examples=train.examples, train_loss=train.loss,
                     train_s=train.seconds, device_s=train.device_s, tokens=train.tokens)
        if self.run.budgets is not None:  # the round this client trained, accounted (Opacus' RDP accountant)
            spent = self.run.budgets.spend(row.partition, *self.private_work(row.node))
            sigma = self.run.budgets.history[row.partition][-1][0]
            ok = replace(ok, extra={**ok.extra, "epsilon": spent, "delta": self.run.budgets.delta, "noise_multiplier": sigma})
        self.run.round.rows[row.node] = ok
        return update

    def close_round(self) -> None:
        """Clients still silent timed out, or, when over-selection's quorum of replies closed the round early,
        were cut; the participation draw learns how every client did, and :meth:`predicted_s` each tier's rate."""
        rows = self.run.round.rows
        answered = sum(row.status in ("ok", "rejected") for row in rows.values())
        cut = self.settings.overselect > 0 and answered >= self.settings.clients_per_round
        for node, row in rows.items():
            if row.status == "sent" and cut:
                rows[node] = replace(row, status="cut",
                                     error=f"the round closed once {answered} updates had arrived (over-selection)")
            elif row.status == "sent":
                rows[node] = replace(row, status="timeout", error="no reply before the round deadline")
        self.run.participation.settle(self.run.round.number, {r.partition: (r.status, r.examples, r.train_loss)
                                                      for r in rows.values()})
        spent: dict[str, tuple[float, int]] = {}  # tier -> (its clients' training seconds, their tokens)
        for r in rows.values():
            if r.status == "ok" and r.train_s and r.tokens:
                seconds, tokens = spent.get(r.device, (0.0, 0))
                spent[r.device] = (seconds + r.train_s, tokens + r.tokens)
        self.run.rates.update({tier: seconds / tokens for tier, (seconds, tokens) in spent.items()})

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check every reply; fold the good ones, each method its own (:func:`fedfusion.fusion.rounds.fold_round`)."""
        start = time.perf_counter()
        updates: list[Update] = []
        for reply, row in self.replies_in_order(replies):
            try:
                updates.append(self.accept(reply, row))
            except Exception as exc:  # an untrusted reply can be malformed in any way; it must not stop the run
                row = self.run.round.rows[row.node]
                self.run.round.rows[row.node] = replace(row, status="rejected", error=str(exc)[:500])
                log(WARNING, "round %d node %d: update rejected: %s", self.run.round.number, row.node, str(exc)[:500])
        self.close_round()
        ok = len(updates)
        self.run.round.void = ok < self.settings.min_clients or ok == 0
        if self.run.round.void:
            log(WARNING, "round %d: %d good replies < selection.min_clients=%d; target unchanged",
                self.run.round.number, ok, self.settings.min_clients)
            self.run.round.aggregate_s = time.perf_counter() - start
            return None, MetricRecord({"clients_ok": ok})
        self.set_threads()
        if self.secure is not None:
            folded = self.fold_secure(updates)
            if folded is None:
                self.run.round.void = True
                self.run.round.aggregate_s = time.perf_counter() - start
                return None, MetricRecord({"clients_ok": 0})
        else:
            folded = fold_round(self.run.methods, self.run.round.number, self.run.round.target, updates)
        self.run.round.coverage, self.run.round.server_cost = folded.coverage, dict(folded.server_cost)
        self.run.round.aggregate_s = time.perf_counter() - start
        good = [r for r in self.run.round.rows.values() if r.status == "ok"]
        return ArrayRecord(folded.target), MetricRecord({
            "train_loss": sum(r.train_loss or 0.0 for r in good) / ok,
            NUM_EXAMPLES: sum(r.examples for r in good), "clients_ok": ok, "coverage": folded.coverage,
            **folded.stats,
            "server_flops": self.run.round.server_cost["flops"], "server_s": self.run.round.server_cost["seconds"],
        })

    def secure_support(self, target: dict[str, torch.Tensor], payloads: list[Payload]) -> torch.Tensor:
        """Secure aggregation: the target tensors of this round's vectors (in their order) and the coordinates of
        them that ``payloads`` train, as the runs every message carries; nothing without secure aggregation."""
        if self.secure is None:
            return torch.zeros(0, dtype=torch.int64)
        method = cast(SecureFold, self.run.fold_order[0])
        held = method.secure_support(target, payloads)
        self.run.round.secure_shapes = {name: tuple(h.shape) for name, h in held.items()}
        runs = pack_support(torch.cat([h.flatten() for h in held.values()]))
        self.run.round.support = unpack_support(runs)
        return runs

    def fold_secure(self, updates: list[Update]) -> Fold | None:
        """Secure aggregation's fold: the masked replies' sum unmasked (the unmask step on the grid) and folded by
        the one method; None when it cannot be unmasked (too few shares came back)."""
        assert self.secure is not None and self.run.round.grid is not None
        total = self.secure.unmask(self.run.round.grid, dict(self.run.round.masked))
        for node, nbytes in self.secure.keys.nbytes.items():  # the extra steps' bytes, each way, per client
            if node in self.run.round.rows:
                row = self.run.round.rows[node]
                self.run.round.rows[node] = replace(row, extra={**row.extra, "secagg_bytes": nbytes})
        if total is None:
            return None
        shapes = list(self.run.round.secure_shapes.values())
        flat = np.zeros(sum(math.prod(shape) for shape in shapes))
        flat[self.run.round.support] = decode(total)
        sums = unflatten(flat, list(self.run.round.secure_shapes), shapes)
        method = cast(SecureFold, self.run.fold_order[0])
        folded = method.fold_sum(self.run.round.number, self.run.round.target, updates, sums)
        cost = {"flops": 0.0, "seconds": 0.0, "tokens": 0.0, **folded.server_cost, "secagg_s": self.secure.keys.seconds}
        return replace(folded, server_cost=cost)

    def set_threads(self) -> None:
        """The torch threads for this round's server work (fold, then central evaluation): ``server_threads``,
        or (0) the fastest of all or one on a short probe, logged when that changes."""
        threads = self.settings.server_threads
        if threads:
            torch.set_num_threads(threads)
        else:
            threads = use_fastest_threads()
        if threads != self.run.threads_used:
            log(INFO, "round %d: the server computes on %d torch thread%s%s", self.run.round.number, threads,
                "s" * (threads > 1), "" if self.settings.server_threads or threads > 1 else
                " (more measured no faster: a core is busy)")
        self.run.threads_used = threads

    # -- federated evaluation (optional; the server also evaluates centrally) -------------------
    def evaluation_nodes(self) -> list[int]:
        """A seeded sample of ``evaluate_clients`` known nodes, sorted; not the nodes over-selection just cut
        (a deployed node still busy with that training would hold the evaluation round up)."""
        cut = {n for n, row in self.run.round.rows.items() if row.status == "cut"}
        known = sorted(n for n in self.run.caps if n not in cut)
        return sorted(self.run.rng.sample(known, min(self.settings.evaluate_clients, len(known))))

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Send the target, as its tier's method has it scored, to ``evaluate_clients`` known nodes."""
        if self.settings.evaluate_clients <= 0:
            return []
        server_round += self.run.rounds_done
        target = record_tensors(arrays)  # over Flower's bytes, no copy: read only
        records: dict[str, ArrayRecord] = {}  # one record per method, shared by its nodes
        messages = []
        for node in self.evaluation_nodes():
            tier = self.device_of(node)
            method = self.run.methods[tier]
            state, spec = method.evaluation(target, tier)
            if method.name not in records:
                records[method.name] = ArrayRecord(state)
            messages.append(Message(
                RecordDict({"arrays": records[method.name], "config": ConfigRecord(
                    {**config, **self.settings.train_config, **spec, **RoundSpec(server_round, self.settings.run_seed).to_config()})}),
                dst_node_id=node, message_type=MessageType.EVALUATE))
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Example-weighted mean of the clients' held-out loss and accuracy."""
        good = [r.content.metric_records["metrics"] for r in replies if not r.has_error()]
        examples = [_number(m, NUM_EXAMPLES) for m in good]
        total = sum(examples)
        if not total:
            return None
        self.run.round.fed_eval = {f"fed_{k}": sum(_number(m, k) * n for m, n in zip(good, examples)) / total
                               for k in ("eval_loss", "eval_acc")}
        return MetricRecord({k: v for k, v in self.run.round.fed_eval.items()})


def _number(record: MetricRecord, key: str) -> float:
    """One scalar of a reply's metrics (a list where a number belongs raises, naming the key)."""
    value = record[key]
    if not isinstance(value, int | float):
        raise ValueError(f"metric {key!r} is not a number: {value!r}")
    return float(value)
