"""One federation from a recipe: build the target and each tier's method, run the fusion strategy, evaluate
centrally, price every round; :func:`run_federation` runs it (or the recipe's central method) through the one run
lifecycle (:mod:`fedfusion.run.lifecycle`), which records the rounds and writes the run.

``fedfusion run`` calls :func:`run_federation` through Flower's simulation engine; ``flwr run .`` reaches the same
function through :data:`fedfusion.server_app.app`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid

from fedfusion.analysis.report import read_jsonl
from fedfusion.config.methods import LORA, SERVER_WORK, SUBMODEL, call, method
from fedfusion.config.recipe import Recipe, tier_methods, uses
from fedfusion.data.population import data_spec, facts_by_tier, lora_data_spec, tier_list, write_partition_sizes
from fedfusion.devices.availability import AvailabilityConfig, AvailabilityModel
from fedfusion.devices.catalog import Device, population_catalog
from fedfusion.devices.energy import price_work, train_flops
from fedfusion.fusion.base import ClientRound, FusionMethod, RoundReport
from fedfusion.fusion.lora.build import client_spec as lora_client_spec
from fedfusion.fusion.lora.config import LoRAConfig
from fedfusion.fusion.rounds import initial_state, round_lr
from fedfusion.fusion.submodel.method import SubModelMethod
from fedfusion.fusion.submodel.plan import expanded_tiers
from fedfusion.run.central import central_course
from fedfusion.run.checkpoint import Checkpoint
from fedfusion.run.lifecycle import Recorder, RoundCallback, run_course
from fedfusion.run.quiet import silence_expected_noise
from fedfusion.run.run_dir import RunDir
from fedfusion.run.targets import Target, lm_target, lora_target
from fedfusion.selection.participation import Participation, jain_index
from fedfusion.selection.selectors import make_selector
from fedfusion.strategies.fusion import FusionStrategy, Listener, RunState, StrategySettings
from fedfusion.strategies.nodes import connected_nodes
from fedfusion.strategies.quorum import QuorumGrid
from fedfusion.strategies.records import record_tensors
from fedfusion.strategies.secagg import SecureAggregation
from fedfusion.wire.specs import (
    ClientSpec,
    FaultSpec,
    PopulationSpec,
    PrivacySpec,
    RoleSpec,
    RoundSpec,
    TrainSpec,
    merge,
)

silence_expected_noise()  # the server's side of a run, whether started by `fedfusion run` or `flwr run`


def log_round(row: dict[str, Any]) -> None:
    """Default progress: one log line per round (per optimizer step in the units mode)."""
    if "step" in row:  # fedfusion.run.units: a central step, its linear layers on the nodes
        log(INFO, "step %d: train_loss=%s eval_loss=%s %.2f MB down %.2f MB up virtual %.2fs missed %d (%.1fs)",
            row["step"], row["train_loss"], row.get("eval_loss"), row["bytes_down"] / 1e6, row["bytes_up"] / 1e6,
            row["virtual_s"], len(row.get("missed", [])), row["wall_s"])
        return
    if "eval_loss" not in row:  # train.eval_every: central evaluation did not score this round
        log(INFO, "round %d: not scored (train.eval_every) clients ok=%d failed=%d cut=%d (%.1fs)",
            row["round"], row["clients_ok"], row["clients_failed"], row.get("clients_cut", 0), row["wall_s"])
        return
    log(INFO, "round %d: eval_loss=%.4f ppl=%.2f acc=%.3f clients ok=%d failed=%d cut=%d (%.1fs)",
        row["round"], row["eval_loss"], row["eval_ppl"], row["eval_acc"], row["clients_ok"],
        row["clients_failed"], row.get("clients_cut", 0), row["wall_s"])


def build_participation(recipe: Recipe) -> Participation:
    """The recipe's selector and (optional) availability model over its population."""
    catalog = population_catalog(recipe.population)
    avail = recipe.availability
    model = (AvailabilityModel.for_tiers(tier_list(recipe.population, recipe.seed), catalog, seed=recipe.seed,
                                         config=AvailabilityConfig(**avail.model)) if avail.enabled else None)
    selector = make_selector(recipe.selection.method, seed=recipe.seed, **recipe.selection.options)
    return Participation(selector, catalog, model, avail.start_clock_s, avail.round_interval_s, avail.deadline_s)


def build_methods(recipe: Recipe, target: Target) -> dict[str, FusionMethod]:
    """The fusion method of every device tier of the recipe's population (``fusion.method``, or per tier
    ``fusion.tiers`` for a mixed federation): one object per method, serving the tiers assigned to it."""
    assigned = tier_methods(recipe)
    tiers: dict[str, list[str]] = {}
    for tier, name in assigned.items():
        tiers.setdefault(name, []).append(tier)
    source = recipe.data_source()
    built = {name: call(method(name).build, recipe, source=source, target=target, tiers=mine)
             for name, mine in tiers.items()}
    # the tiers whose memory holds the frozen target in float32 (the plan's)
    expand = expanded_tiers(recipe.fusion, recipe.train, recipe.population, recipe.model, source)
    for each in built.values():
        if isinstance(each, SubModelMethod):
            each.expand = expand
    return {tier: built[name] for tier, name in assigned.items()}


def build_strategy(recipe: Recipe, target: Target, listeners: Sequence[Listener] = ()) -> FusionStrategy:
    """The fusion strategy of the recipe's settings, with the specs its messages carry, given a new run's state over
    the recipe's methods and participation draw."""
    lora = recipe.fusion.method == LORA
    source = recipe.data_source()
    client = ClientSpec(lora_data_spec(source) if lora else data_spec(source), recipe.train.seq_len,
                        recipe.engine.threads_per_client)
    population = PopulationSpec(dict(recipe.population.mix), recipe.population.num_clients, recipe.seed)
    # the role that counts a node's examples: LoRA clients count instruction pairs of the base's tokens
    query = merge(client, population, RoleSpec(LORA if lora else SUBMODEL),
                  *([lora_client_spec(recipe.section(LoRAConfig))] if lora else []))
    settings = StrategySettings(
        clients_per_round=recipe.selection.clients_per_round,
        min_clients=recipe.selection.min_clients,
        query_config=query,
        train_config={
            **merge(client, TrainSpec.from_recipe(recipe.train), FaultSpec.from_recipe(recipe.faults),
                    PrivacySpec.from_recipe(recipe.privacy)),
            RoundSpec.key("seed"): recipe.seed,  # the run's seed; each message carries its client's own
        },
        weighting=recipe.fusion.weighting,
        evaluate_clients=recipe.selection.evaluate_clients,
        seed=recipe.seed,
        max_norm_ratio=recipe.fusion.max_norm_ratio,
        overselect=recipe.selection.overselect,
        query_timeout_s=recipe.selection.timeout_s,
        pool=recipe.selection.pool,
        client_lr=partial(round_lr, recipe.train.lr, recipe.train.lr_schedule, recipe.train.lr_final,
                          rounds=recipe.rounds),
        server_threads=recipe.engine.server_threads,
        eval_every=recipe.train.eval_every,
        max_epochs=recipe.train.max_epochs,
    )
    return FusionStrategy(
        settings, RunState.begin(build_methods(recipe, target), build_participation(recipe), settings),
        listeners=listeners,
        secure=SecureAggregation(recipe.fusion.weighting, recipe.selection.timeout_s)
        if recipe.privacy.secure_aggregation else None,
    )


def privacy_spec(recipe: Recipe) -> dict[str, Any]:
    """The spec entries the client's privacy mod reads (:class:`fedfusion.wire.specs.PrivacySpec`)."""
    return PrivacySpec.from_recipe(recipe.privacy).to_config()


def price_client(row: ClientRound, catalog: dict[str, Device]) -> dict[str, float]:
    """Energy ledger fields of one client round, priced from counted work on its device profile.

    A client that failed or timed out is charged its planned work and download; a rejected one its
    work both ways; a cut one (over-selection closed the round without it) its work, its download and an
    upload the size of that download (its reply is still sent; Flower cannot cancel it): that energy was
    spent and bought nothing (``wasted``). A real device's own training time (``device_s``) is priced as measured,
    in place of its FLOPs at the catalog's speed.
    """
    ok = row.status == "ok"
    up = row.bytes_up if row.status in ("ok", "rejected") else row.bytes_down if row.status == "cut" else 0
    return price_work(catalog[row.device], train_flops(row.params, row.tokens), row.bytes_down, up,
                      compute_s=row.device_s).ledger(not ok)


def ledger_row(server_round: int, row: ClientRound, catalog: dict[str, Device]) -> dict[str, Any]:
    """One clients.jsonl row: what the client did (its measured joules included, where it had a meter) and
    its priced energy (:func:`price_client`)."""
    return {"round": server_round, **row.to_dict(), **price_client(row, catalog)}


class CentralEvaluation:
    """Flower's ``evaluate_fn``: the target scored on the server (round 0: before training)."""

    def __init__(self, target: Target) -> None:
        self.target = target

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        start = time.perf_counter()
        if server_round > 0:
            self.target.load(arrays)
        metrics: dict[str, int | float | list[int] | list[float]] = dict(self.target.evaluate())
        metrics["eval_s"] = time.perf_counter() - start  # part of the round's wall time (benchmarks/overhead.py)
        return MetricRecord(metrics)


class RoundLedger:
    """A listener of the strategy's round reports: the round's metrics row (its prices, the server's work) and its
    clients' ledger rows, recorded through the run's :class:`~fedfusion.run.lifecycle.Recorder` with the checkpoint
    the round may be due (``state`` gives the strategy's run state for it)."""

    def __init__(self, recorder: Recorder, state: Callable[[], dict[str, Any]], arrays: ArrayRecord,
                 catalog: dict[str, Device], server_device: Device | None = None) -> None:
        self.recorder, self.state, self.catalog, self.server_device = recorder, state, catalog, server_device
        self.arrays = arrays  # the target after the last round seen (before round 1: what it starts from)
        self.nodes_logged: set[int] = set()  # nodes whose capabilities are in nodes.jsonl

    def __call__(self, report: RoundReport) -> None:
        server_round, clients = report.round, report.clients
        if server_round > 0:
            self.arrays = report.arrays
        ok = [c for c in clients if c.status == "ok"]
        ledger = [ledger_row(server_round, c, self.catalog) for c in clients]
        server = {"virtual_s": 0.0, "energy_j": 0.0, "co2_g": 0.0}
        if server_round > 0 and self.server_device is not None and report.server_cost["flops"]:
            cost = price_work(self.server_device, report.server_cost["flops"], 0, 0)
            server = {"virtual_s": cost.virtual_s, "energy_j": cost.wall_j, "co2_g": cost.co2_g}
        wall_s, elapsed_s = self.recorder.clock()
        first = server_round == 0
        row = {
            "round": server_round, **report.metrics,
            "train_loss": sum(c.train_loss or 0.0 for c in ok) / len(ok) if ok else None,
            "coverage": None if first else report.coverage,
            "bytes_down": sum(c.bytes_down for c in clients),
            "bytes_up": sum(c.bytes_up for c in clients),
            "clients_ok": len(ok), "clients_cut": sum(c.status == "cut" for c in clients),
            "clients_failed": sum(c.status not in ("ok", "cut") for c in clients),
            "dropouts": sum(c.status == "dropped" for c in clients),
            "clock_s": None if first else report.clock_s,
            "void": report.void,
            "aggregate_s": report.aggregate_s,
            "wall_s": wall_s, "elapsed_s": elapsed_s,
            # simulated time advances by the slowest client the round waited for (not the ones over-selection
            # cut), then the server's own work; energy and carbon add up over all of them
            "virtual_s": max((c["virtual_s"] for c in ledger if c["status"] != "cut"), default=0.0) + server["virtual_s"],
            "energy_j": sum(c["energy_j"] for c in ledger) + server["energy_j"],
            "wasted_j": sum(c["energy_j"] for c in ledger if c["wasted"]),
            "co2_g": sum(c["co2_g"] for c in ledger) + server["co2_g"],
            "server_flops": report.server_cost["flops"],
            "server_s": report.server_cost["seconds"],
            "server_energy_j": server["energy_j"], "server_co2_g": server["co2_g"],
            # secure aggregation: the server's wall seconds in its extra steps (round trips to the clients, unmasking)
            **{k: v for k, v in report.server_cost.items() if k == "secagg_s"},
            **report.fed_eval,
        }
        new_nodes = {n: c for n, c in report.nodes.items() if n not in self.nodes_logged}
        self.recorder.run.log_nodes([{"round": server_round, "node": n, **dict(c)} for n, c in new_nodes.items()])
        self.nodes_logged |= set(new_nodes)
        self.recorder.record(row, ledger, lambda: Checkpoint(
            round=server_round, target=record_tensors(report.arrays), elapsed_s=elapsed_s,
            strategy=self.state()))


def facts_summary(recipe: Recipe, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What the target recalls of all clients' facts, against the largest share any one client owns, and how many
    facts each device tier's clients hold (``probes_by_tier``: the report's and compare's per-tier scores)."""
    facts, groups = facts_by_tier(recipe.data, recipe.population, recipe.seed)
    probes = facts.probes
    owned = Counter(p.client for p in probes)
    scored = [r for r in rows if r.get("probe_acc") is not None]  # train.eval_every: the rounds scored
    return {"probe_acc": scored[-1]["probe_acc"], "best_probe_acc": max(r["probe_acc"] for r in scored),
            "largest_client_share": max(owned.values()) / len(probes), "clients": len(owned), "probes": len(probes),
            "probes_by_tier": {tier: len(idx) for tier, idx in groups.items()}}


def participation_fairness(run: RunDir, num_clients: int) -> float:
    """Jain's index of how many rounds each client of the population trained in (never picked: 0)."""
    counts = [0] * num_clients
    for row in read_jsonl(run.path / "clients.jsonl"):
        if row["status"] == "ok" and 0 <= row["partition"] < num_clients:
            counts[row["partition"]] += 1
    return jain_index(counts)


class Federation:
    """The federated methods' course (:class:`~fedfusion.run.lifecycle.Course`): the recipe's target and the fusion
    strategy over its tiers' methods, whose rounds :class:`RoundLedger` records."""

    def __init__(self, recipe: Recipe, run: RunDir) -> None:
        self.recipe, self.run = recipe, run
        self.target = lora_target(recipe)[0] if recipe.fusion.method == LORA else lm_target(recipe)
        self.catalog = population_catalog(recipe.population)
        self.server_device = next((self.catalog[getattr(recipe, m.server_device).server_device]
                                   for m in map(method, SERVER_WORK) if uses(recipe, m.name)), None)
        self.strategy = build_strategy(recipe, self.target)
        # the population's data is built by now: plan and report show it
        write_partition_sizes(run.path, recipe.data_source(), recipe.fusion.method)
        self.ledger: RoundLedger | None = None

    @property
    def rounds(self) -> int:
        return self.recipe.rounds

    def train(self, grid: Grid, recorder: Recorder, resumed: Checkpoint | None) -> None:
        """Flower's strategy loop over the rounds left, from the checkpoint's target and strategy state."""
        run = self.strategy.run
        if resumed is None:
            initial = ArrayRecord(initial_state(run.methods, self.target.initial()))
        else:
            initial = ArrayRecord(resumed.target)
            self.target.load(initial)
            run.load_state_dict(resumed.strategy, resumed.round)
        self.ledger = RoundLedger(recorder, run.state_dict, initial, self.catalog, self.server_device)
        self.strategy.listeners.append(self.ledger)
        if self.recipe.selection.overselect > 0:
            # over the paced grid's own push and pull: a quorum's batch goes out whole (paced, the longest clients
            # would fill the quorum and the shortest never be sent)
            grid = QuorumGrid(grid, quorum=self.recipe.selection.clients_per_round)
        self.strategy.start(
            grid=grid, initial_arrays=initial, num_rounds=self.recipe.rounds - (resumed.round if resumed else 0),
            timeout=self.recipe.selection.timeout_s, evaluate_fn=CentralEvaluation(self.target),
        )

    def arrays(self) -> ArrayRecord:
        """The target after the last round."""
        return self.ledger.arrays if self.ledger is not None else ArrayRecord(self.target.initial())

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The rounds, the clients' outcomes and how evenly the population took part (and, for facts, what the target
        recalls)."""
        summary = {
            "rounds": self.recipe.rounds,
            **{k: sum(r.get(k, 0) for r in rows) for k in ("clients_ok", "clients_failed", "clients_cut", "wasted_j",
                                                          "dropouts")},
            "participation_jain": participation_fairness(self.run, self.recipe.population.num_clients),
        }
        if self.recipe.data.source == "facts":
            summary["facts"] = facts_summary(self.recipe, rows)
        return summary


def run_federation(grid: Grid, recipe: Recipe, run: RunDir, on_round: RoundCallback = log_round,
                   resume: bool = False, stop: threading.Event | None = None) -> dict[str, Any]:
    """Train the recipe's target over the nodes of ``grid``; writes every output into ``run``.

    The federated methods run as a :class:`Federation`, a central method (``fusion.method=units``) as its registry
    entry's :class:`~fedfusion.run.central.CentralMethod`; both through one lifecycle
    (:func:`~fedfusion.run.lifecycle.run_course`): with ``resume`` the run continues from the checkpoint in ``run``
    (see :mod:`fedfusion.run.checkpoint`), its ``wall_s`` adding up every part; setting ``stop`` ends the run at the
    next Grid call with ``status: interrupted``, the last completed round and the round a resume continues after.
    """
    build = central_course if method(recipe.fusion.method).central else Federation
    return run_course(grid, recipe, run, partial(build, recipe, run), on_round, resume, stop)


def check_federation(grid: Grid, clients: int, per_client: int = 1, wait_s: float = 30.0, poll_s: float = 1.0) -> int:
    """``flwr run .``: the federation's SuperNodes are the recipe's population, ``per_client`` per partition
    (:func:`~fedfusion.config.recipe.nodes_per_client`). Waits up to ``wait_s`` for them to connect; fewer (e.g. a
    local federation's default ``num-supernodes``) or more is a ValueError that names both numbers and the fix,
    raised before anything is written."""
    expected = clients * per_client
    nodes = len(connected_nodes(grid, expected, wait_s, poll_s))
    if nodes != expected:
        each = ("every client is one SuperNode" if per_client == 1
                else f"every client is {per_client} SuperNodes (units.supernodes)")
        fix = (f" (or set the override population.num_clients={nodes // per_client})"
               if nodes >= per_client and nodes % per_client == 0 else "")
        raise ValueError(
            f"the federation has {nodes} SuperNodes but population.num_clients is {clients}: {each}, so run with "
            f"--federation-config \"num-supernodes={expected}\"{fix}")
    return nodes
