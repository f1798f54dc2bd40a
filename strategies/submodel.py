"""Sub-model fusion as a Flower Strategy: width-sliced clients, selective averaging into the target.

Round flow (``Strategy.start`` drives it):
1. ``configure_train``: a QUERY round for nodes not seen yet (their device tier), then a seeded sample
   of ``clients_per_round`` nodes, each sent a fresh Message with its own sub-model and an explicit spec.
2. ``aggregate_train``: every reply is checked (error, NaN/Inf, keys, shapes) and streamed into a
   :class:`~fedfusion.slicing.SelectiveAverager`; bad replies are rejected and logged, the rest fold in.
   Fewer than ``min_clients`` good replies leave the target unchanged (a void round).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from logging import INFO, WARNING

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from transformers import PretrainedConfig

from fedfusion.checkpoint import rng_state, set_rng_state
from fedfusion.energy import WorkCost, price_work, train_flops
from fedfusion.meters import read_measured
from fedfusion.models import config_aliases, full_state, wire_state
from fedfusion.ordered import ordered_fractions
from fedfusion.outer import OuterConfig, OuterOptimizer
from fedfusion.participation import Participation
from fedfusion.rounds import client_seed, fold, owned_starts, plan_round
from fedfusion.slicing import (
    SelectiveAverager,
    SlicePlan,
    extract,
    plan_slice,
    sub_config,
)
from fedfusion.wire import DROPPED


@dataclass
class ClientRound:
    """What one client did in one round (a clients.jsonl row)."""

    node: int
    device: str
    width: float
    assignment: dict[str, list[list[int]]] = field(default_factory=dict)
    status: str = "sent"  # sent -> ok | failed | rejected | timeout | cut (over-selection); or dropped (never sent)
    partition: int = -1
    examples: int = 0
    train_loss: float | None = None
    train_s: float | None = None
    bytes_down: int = 0
    bytes_up: int = 0
    params: int = 0  # parameters of the sub-model sent
    sent_norm: float = 0.0  # L2 norm of the sub-model sent, to judge the reply's
    tokens: int = 0  # tokens trained: planned when sent, as reported once the reply arrives
    error: str | None = None
    measured_j: float | None = None  # host energy the client measured while training (not the priced device)
    measured_source: str | None = None  # the meters read, e.g. "nvml+rapl" (fedfusion.meters)


@dataclass
class RoundLog:
    """The strategy's view of the last train round, read by the run recorder."""

    server_round: int = 0
    clients: dict[int, ClientRound] = field(default_factory=dict)
    coverage: float = 0.0
    aggregate_s: float = 0.0
    void: bool = False
    fed_eval: dict[str, float] = field(default_factory=dict)
    clock_s: float = 0.0  # simulated time when the round started


WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16}  # Flower's arrays are numpy: no bfloat16


def state_norm(state: dict[str, torch.Tensor]) -> float:
    """L2 norm of all tensors of a state together (NaN if any value is NaN)."""
    return float(torch.sqrt(sum((t.float().pow(2).sum() for t in state.values()), torch.tensor(0.0))))


def reply_metrics(metrics: MetricRecord, row: ClientRound) -> tuple[int, float, float, int]:
    """A reply's (num-examples, train_loss, train_s, train_tokens), read and checked before its update is
    used, so a reply with broken numbers is rejected whole instead of half folded in. A host energy
    reading the client measured (:func:`fedfusion.meters.read_measured`) goes into ``row.measured_j`` and
    ``row.measured_source`` whatever becomes of the update."""
    measured = read_measured(metrics)
    if measured is not None:
        row.measured_j, row.measured_source = measured
    n, loss, seconds = int(metrics["num-examples"]), float(metrics["train_loss"]), float(metrics["train_s"])
    tokens = int(metrics.get("train_tokens", row.tokens))
    if n <= 0:
        raise ValueError(f"num-examples is {n}")
    if not (math.isfinite(loss) and math.isfinite(seconds) and seconds >= 0 and tokens >= 0):
        raise ValueError(f"train metrics out of range: loss {loss}, seconds {seconds}, tokens {tokens}")
    return n, loss, seconds, tokens


def error_line(reason: str) -> str:
    """The exception line of an error reply (Ray wraps the client's traceback around it)."""
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "unknown error")[:500]


class SubModelFusion(Strategy):
    """Width-sliced partial training (HeteroFL static / FedRolex rolling) on a Llama-family target.

    With ``stagger`` (rolling only) the sampled clients' windows are laid end to end around the axis in
    sample (partition) order, so a round covers min(1, sum of widths) of every layer instead of the widest window.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        widths: dict[str, float],
        policy: str,
        stride: float,
        stagger: bool,
        clients_per_round: int,
        min_clients: int,
        participation: Participation,
        query_config: dict[str, str | int | float],
        train_config: dict[str, str | int | float],
        weighting: str = "uniform",
        aggregate: str = "mean",
        trim: float = 0.2,
        evaluate_clients: int = 0,
        seed: int = 0,
        wait_nodes_s: float = 60.0,
        query_timeout_s: float = 600.0,
        max_norm_ratio: float = 10.0,
        axes: tuple[str, ...] | None = None,
        scale: bool = True,
        ordered_ladder: tuple[float, ...] | None = None,
        ordered_distill: bool = False,
        overselect: float = 0.0,
        wire_dtype: str = "float32",
        outer: OuterConfig | None = None,
    ) -> None:
        self.config = config
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype {wire_dtype!r}: use one of {', '.join(WIRE_DTYPES)}")
        if overselect < 0:
            raise ValueError(f"overselect must be >= 0, got {overselect}")
        # the float dtype sub-models are sent in (float16 halves the downlink); replies and the target stay float32
        self.wire_dtype = WIRE_DTYPES[wire_dtype]
        self.aliases = config_aliases(config) if config is not None else {}  # tied keys messages leave out
        self.widths = widths
        self.policy = policy
        self.stride = stride
        self.stagger = stagger
        self.clients_per_round = clients_per_round
        # over-selection: sample this many more, and the round closes at clients_per_round replies (QuorumGrid)
        self.overselect = overselect
        self.participation = participation
        self.costs: dict[str, WorkCost] = {}
        self.sizes: dict[str, tuple[int, int]] = {}  # tier -> (sub-model parameters, bytes)
        self.min_clients = min_clients
        self.query_config = query_config
        self.train_config = train_config
        self.weighting = weighting
        self.aggregate, self.trim = aggregate, trim
        self.evaluate_clients = evaluate_clients
        self.rng = random.Random(seed)
        self.wait_nodes_s = wait_nodes_s
        self.query_timeout_s = query_timeout_s
        # local DP adds noise to every coordinate of a reply, so its norm says nothing about abuse: no norm check
        self.max_norm_ratio = 0.0 if str(train_config.get("dp-mode", "none")) == "local" else max_norm_ratio
        self.axes, self.scale = axes, scale
        self.ordered_ladder = ordered_ladder or tuple(sorted(set(widths.values())))
        self.ordered_distill = ordered_distill
        # a damped server step on each round's fold (fedfusion.outer); None: plain selective averaging
        self.outer = OuterOptimizer(outer) if outer is not None and outer.method != "none" else None
        self.caps: dict[int, dict] = {}
        self.plans: dict[int, SlicePlan] = {}
        self.target: dict[str, torch.Tensor] = {}
        self.last = RoundLog()
        self.round_offset = 0  # rounds done before a resume: Flower counts from 1 again, the run does not
        # the server's own counted work in the last round beyond folding updates in (distillation fills it)
        self.server_cost = {"flops": 0.0, "seconds": 0.0, "tokens": 0.0}

    def state_dict(self) -> dict:
        """What a checkpoint must keep for a resumed run to sample as the uninterrupted one would."""
        state = {"rng": rng_state(self.rng), "participation": self.participation.state_dict()}
        if self.outer is not None:
            state["outer"] = self.outer.state_dict()
        return state

    def load_state_dict(self, state: dict, rounds_done: int) -> None:
        """Continue from a checkpoint taken after ``rounds_done`` rounds."""
        set_rng_state(self.rng, state["rng"])
        self.participation.load_state_dict(state["participation"])
        if self.outer is not None:
            if "outer" not in state:
                raise ValueError("the checkpoint holds no outer-optimizer state but fusion.outer is set: resuming "
                                 "would restart its momentum; resume with the recipe the run was started with")
            self.outer.load_state_dict(state["outer"])
        self.round_offset = rounds_done

    def summary(self) -> None:
        """Log the strategy's settings."""
        log(INFO, "SubModelFusion: policy=%s stride=%s stagger=%s widths=%s clients/round=%d",
            self.policy, self.stride, self.stagger, self.widths, self.clients_per_round)

    # -- capability discovery and sampling ------------------------------------------------------
    def _wait_for_nodes(self, grid: Grid) -> list[int]:
        deadline = time.monotonic() + self.wait_nodes_s
        nodes = list(grid.get_node_ids())
        while len(nodes) < self.clients_per_round and time.monotonic() < deadline:
            time.sleep(0.5)
            nodes = list(grid.get_node_ids())
        if len(nodes) < self.min_clients:
            raise RuntimeError(
                f"only {len(nodes)} nodes connected after {self.wait_nodes_s:.0f}s; need selection.min_clients={self.min_clients}"
            )
        return sorted(nodes)

    def query_nodes(self, grid: Grid, nodes: list[int]) -> None:
        """QUERY every node not seen yet for its capabilities (device tier, partition, data size)."""
        new = [n for n in nodes if n not in self.caps]
        if not new:
            return
        msgs = [
            Message(RecordDict({"config": ConfigRecord(dict(self.query_config))}), dst_node_id=n,
                    message_type=MessageType.QUERY)
            for n in new
        ]
        # The first message to a node may start its process (a Ray actor importing torch): allow the
        # round deadline, not the short registration wait.
        for reply in grid.send_and_receive(msgs, timeout=self.query_timeout_s):
            node = reply.metadata.src_node_id
            if reply.has_error():
                log(WARNING, "node %s: capability query failed: %s", node, reply.error.reason)
                continue
            caps = dict(reply.content["caps"])
            if caps.get("device") not in self.widths:
                log(WARNING, "node %s: device %r has no width in fusion.widths; it is not sampled",
                    node, caps.get("device"))
                continue
            self.caps[node] = caps
            if "examples" in caps:
                self.participation.examples[int(caps.get("partition", node))] = int(caps["examples"])

    def partition_of(self, node: int) -> int:
        """The node's data partition (what seeds and ``owned`` windows follow); a node that reported none
        stands in with its id."""
        return int(self.caps[node].get("partition", node % 1009))

    def client_seed(self, server_round: int, node: int) -> int:
        """Seed of ``node``'s work in ``server_round`` (:func:`fedfusion.rounds.client_seed`)."""
        return client_seed(int(self.train_config.get("seed", 0)), server_round, self.partition_of(node))

    def wire(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` as a message carries it: tied aliases left out, floats in ``wire_dtype``."""
        return {k: v.to(self.wire_dtype) if v.is_floating_point() else v
                for k, v in wire_state(state, self.aliases).items()}

    def from_wire(self, reply: dict[str, torch.Tensor], plan: SlicePlan) -> dict[str, torch.Tensor]:
        """A reply as the averager takes it: tied aliases restored; with a float16 downlink, the reply's change
        from the float16 values sent is added to the exact float32 slice, so rounding the download loses
        no part of the update."""
        reply = full_state(reply, self.aliases)  # aliases are rebuilt from what they alias
        if self.wire_dtype == torch.float32:
            return reply
        exact = extract(self.target, self.config, plan)
        sent = {k: v.to(self.wire_dtype).float() for k, v in exact.items()}
        return {k: exact[k] + (v.float() - sent[k]) if k in exact and v.shape == exact[k].shape else v
                for k, v in reply.items()}

    def tier_costs(self) -> dict[str, WorkCost]:
        """This round's planned work priced per device tier: its sub-model's training FLOPs and transfers."""
        if not self.costs:  # sub-model sizes depend only on the width, so they are priced once per run
            for tier, width in self.widths.items():
                plan = plan_slice(self.config, width, "static", axes=self.axes, scale=self.scale)
                sub = self.wire(extract(self.target, self.config, plan))
                params, nbytes = sum(t.numel() for t in sub.values()), sum(t.nbytes for t in sub.values())
                self.sizes[tier] = (params, nbytes)
                self.costs[tier] = price_work(self.participation.catalog[tier],
                                              train_flops(params, self._tokens()), nbytes, nbytes)
        return self.costs

    def _tokens(self) -> int:
        c = self.train_config
        return int(c.get("local-steps", 0)) * int(c.get("batch-size", 0)) * int(c.get("seq-len", 0))

    def sample(self, grid: Grid, server_round: int) -> list[int]:
        """The participation draw over known, usable nodes: the nodes to train (dropouts are logged, not sent)."""
        nodes = self._wait_for_nodes(grid)
        self.query_nodes(grid, nodes)
        # Clients are known by partition, not node id (random per run), so a seed reproduces the same draw.
        by_partition = {int(self.caps[n].get("partition", n)): n for n in nodes if n in self.caps}
        if not by_partition:
            log(WARNING, "no node has answered the capability query; this round trains nobody")
        k = self.clients_per_round + math.ceil(round(self.clients_per_round * self.overselect, 9))
        draw = self.participation.draw(server_round, {p: self.caps[n]["device"] for p, n in by_partition.items()},
                                       k, self.tier_costs())
        self.last.clock_s = draw.clock_s
        for p in draw.dropped:
            node, device = by_partition[p], self.caps[by_partition[p]]["device"]
            params, nbytes = self.sizes[device]
            self.last.clients[node] = ClientRound(
                node=node, device=device, width=self.widths[device], partition=p, status="dropped",
                params=params, bytes_down=nbytes, tokens=self._tokens(),
                error="left its availability window or missed the virtual deadline before finishing")
        return [by_partition[p] for p in draw.train]

    # -- train --------------------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One fresh Message per sampled node: its sub-model and the spec to rebuild and train it."""
        server_round += self.round_offset
        target = self.target = arrays.to_torch_state_dict()
        self.last = RoundLog(server_round=server_round)
        self.plans = {}
        messages = []
        nodes = self.sample(grid, server_round)
        widths = [self.widths[self.caps[node]["device"]] for node in nodes]
        owned = (owned_starts({self.partition_of(n): self.widths[c["device"]] for n, c in self.caps.items()})
                 if self.policy == "owned" else None)
        plans = plan_round(self.config, [(self.partition_of(n), w) for n, w in zip(nodes, widths)], self.policy,
                           server_round, int(self.train_config.get("seed", 0)), self.stride, self.stagger,
                           self.axes, self.scale, owned)
        for node, width, plan in zip(nodes, widths, plans):
            device = self.caps[node]["device"]
            seed = self.client_seed(server_round, node)
            sub_state = self.wire(extract(target, self.config, plan))
            sub = ArrayRecord(sub_state)
            spec = ConfigRecord({
                **config, **self.train_config,
                "role": "submodel", "server-round": server_round, "width": width, "policy": self.policy,
                "model-config": json.dumps(sub_config(self.config, plan).to_dict()), "seed": seed,
                "axes": json.dumps(list(self.axes) if self.axes else None),
            })
            if self.policy == "ordered":
                spec["ordered-fractions"] = json.dumps(ordered_fractions(width, self.ordered_ladder))
                spec["ordered-distill"] = self.ordered_distill
            self.plans[node] = plan
            self.last.clients[node] = ClientRound(
                node=node, device=device, width=width, partition=int(self.caps[node].get("partition", -1)),
                assignment=plan.assignment(),
                bytes_down=sub.count_bytes(), params=sum(t.numel() for t in sub_state.values()),
                sent_norm=state_norm(sub_state), tokens=self._tokens(),
            )
            messages.append(Message(RecordDict({"arrays": sub, "config": spec}), dst_node_id=node,
                                    message_type=MessageType.TRAIN))
        return messages

    # -- reply bookkeeping shared by every fusion strategy -------------------------------------
    def replies_in_order(self, server_round: int, replies: Iterable[Message]) -> Iterator[tuple[Message, ClientRound]]:
        """This round's replies in sample order (not arrival order, so float sums and reruns repeat exactly),
        each node once; error replies are recorded as ``failed`` and not yielded."""
        position = {node: i for i, node in enumerate(self.last.clients)}
        for reply in sorted(replies, key=lambda m: position.get(m.metadata.src_node_id, len(position))):
            row = self.last.clients.get(reply.metadata.src_node_id)
            if row is None or row.status != "sent":  # not sent this round, or a second reply from the node
                continue
            if reply.has_error():
                row.error = error_line(reply.error.reason)
                row.status = "dropped" if DROPPED in row.error else "failed"  # a gateway's phone missed its deadline
                log(WARNING, "round %d node %d: client %s: %s", server_round, row.node, row.status, row.error)
                continue
            yield reply, row

    @staticmethod
    def reject(server_round: int, row: ClientRound, exc: Exception) -> None:
        """Record and log a reply whose update cannot be used."""
        row.status, row.error = "rejected", str(exc)[:500]
        log(WARNING, "round %d node %d: update rejected: %s", server_round, row.node, row.error)

    def close_round(self, server_round: int) -> None:
        """Clients still silent timed out, or, when over-selection's quorum of replies closed the round
        early, were cut; the participation draw learns how every client did."""
        answered = sum(row.status in ("ok", "rejected") for row in self.last.clients.values())
        cut = self.overselect > 0 and answered >= self.clients_per_round
        for row in self.last.clients.values():
            if row.status == "sent" and cut:
                row.status, row.error = "cut", f"the round closed once {answered} updates had arrived (over-selection)"
            elif row.status == "sent":
                row.status, row.error = "timeout", "no reply before the round deadline"
        self.participation.settle(server_round, {r.partition: (r.status, r.examples, r.train_loss)
                                                 for r in self.last.clients.values()})

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Selective averaging of the good replies; bad ones are rejected, logged and recorded."""
        server_round += self.round_offset
        start = time.perf_counter()
        averager: SelectiveAverager | None = None
        losses, examples = [], 0
        for reply, row in self.replies_in_order(server_round, replies):
            node = row.node
            try:
                sub = wire_state(reply.content["arrays"].to_torch_state_dict(), self.aliases)  # a stray alias is dropped
                metrics = reply.content["metrics"]
                n, loss, seconds, tokens = reply_metrics(metrics, row)
                row.bytes_up = reply.content["arrays"].count_bytes()
                if self.max_norm_ratio and state_norm(sub) > self.max_norm_ratio * row.sent_norm:
                    raise ValueError(f"update norm {state_norm(sub):.3g} is over {self.max_norm_ratio:g}x the "
                                     f"norm of the sub-model sent ({row.sent_norm:.3g})")
                if averager is None:
                    averager = SelectiveAverager(self.target, self.config, self.aggregate, self.trim)
                averager.add(self.from_wire(sub, self.plans[node]), self.plans[node],
                             weight=float(n) if self.weighting == "examples" else 1.0)
            except Exception as exc:  # an untrusted reply can be malformed in any way; it must not stop the run
                self.reject(server_round, row, exc)
                continue
            row.status, row.examples, row.train_loss, row.train_s, row.tokens = "ok", n, loss, seconds, tokens
            losses.append(row.train_loss)
            examples += n
        self.close_round(server_round)
        ok = len(losses)
        self.last.void = ok < self.min_clients
        if self.last.void or averager is None:
            log(WARNING, "round %d: %d good replies < selection.min_clients=%d; target unchanged",
                server_round, ok, self.min_clients)
            self.last.aggregate_s = time.perf_counter() - start
            return None, MetricRecord({"clients_ok": ok})
        self.last.coverage = averager.coverage()
        new = ArrayRecord(fold(averager, self.outer))
        self.last.aggregate_s = time.perf_counter() - start
        return new, MetricRecord({
            "train_loss": sum(losses) / ok, "num-examples": examples, "clients_ok": ok,
            "coverage": self.last.coverage,
        })

    # -- federated evaluation (optional; the server also evaluates centrally) -------------------
    def evaluation_nodes(self) -> list[int]:
        """A seeded sample of ``evaluate_clients`` known nodes, sorted; not the nodes over-selection just cut
        (a deployed node still busy with that training would hold the evaluation round up)."""
        cut = {n for n, row in self.last.clients.items() if row.status == "cut"}
        known = sorted(n for n in self.caps if n not in cut)
        return sorted(self.rng.sample(known, min(self.evaluate_clients, len(known))))

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the whole target to ``evaluate_clients`` known nodes, to score it on their held-out text."""
        if self.evaluate_clients <= 0:
            return []
        server_round += self.round_offset
        nodes = self.evaluation_nodes()
        spec = {**config, **self.train_config, "role": "submodel", "server-round": server_round,
                "model-config": json.dumps(self.config.to_dict())}
        plain = not self.aliases and self.wire_dtype == torch.float32  # the target as Flower carries it
        sent = arrays if plain else ArrayRecord(self.wire(arrays.to_torch_state_dict()))
        return [
            Message(RecordDict({"arrays": sent, "config": ConfigRecord(dict(spec))}), dst_node_id=n,
                    message_type=MessageType.EVALUATE)
            for n in nodes
        ]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Example-weighted mean of the clients' held-out loss and accuracy."""
        good = [r.content["metrics"] for r in replies if not r.has_error()]
        total = sum(int(m["num-examples"]) for m in good)
        if not total:
            return None
        self.last.fed_eval = {
            f"fed_{k}": sum(float(m[k]) * int(m["num-examples"]) for m in good) / total
            for k in ("eval_loss", "eval_acc")
        }
        return MetricRecord(self.last.fed_eval)
