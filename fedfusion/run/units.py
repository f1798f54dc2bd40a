"""The exact (units) mode on Flower, a central method: the server trains the target centrally and every linear
layer's GEMMs run as tiles on the federation's nodes.

Instead of fusion rounds, :class:`UnitsMethod` (a :class:`~fedfusion.run.central.CentralMethod`, run through the
one run lifecycle) builds the recipe's target, the pooled training text of the whole population and one optimizer,
routes the Llama's linear layers (``units.offload``: the MLP's, or all of them) through a
:class:`fedfusion.units.UnitEngine` whose devices are the simulation's nodes (their tiers from a QUERY round, priced
by :func:`fedfusion.units.from_catalog`) and whose transport is
:class:`~fedfusion.strategies.transport.GridTransport` (per phase one ``train.units`` message per device, each
device's deadline floored by ``units.deadline_floor_s``; a device past its deadline answers None and the engine
re-dispatches its tiles; with ``units.shape_links`` it delays each message and reply by the device's links,
:mod:`fedfusion.units.shaper`). Each step is a ``metrics.jsonl`` row (loss, bytes down / up, the step's virtual
seconds under the devices' links from :func:`fedfusion.units.timeline.simulate` beside its measured ``train_s``,
its priced work).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from logging import INFO
from typing import Any

import torch
from flwr.app import ArrayRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from transformers import PreTrainedModel

from fedfusion.config.methods import UNITS
from fedfusion.config.recipe import Recipe, nodes_per_client
from fedfusion.data.population import client_windows, data_spec, write_partition_sizes
from fedfusion.data.text import sample_batch
from fedfusion.devices.catalog import Device, population_catalog
from fedfusion.devices.energy import price_work
from fedfusion.fusion.state import load_optimizer_state, optimizer_state
from fedfusion.run.checkpoint import Checkpoint
from fedfusion.run.run_dir import RunDir
from fedfusion.run.targets import lm_target
from fedfusion.strategies.nodes import connected_nodes, query_messages
from fedfusion.strategies.transport import GridTransport
from fedfusion.strategies.wrapped import collect
from fedfusion.train.loop import finite_loss, gradient_step, lm_loss, make_optimizer
from fedfusion.units import Freivalds, PhaseRecord, UnitDevice, UnitEngine, from_catalog, install
from fedfusion.units.devices import server_from_catalog
from fedfusion.units.engine import Returns
from fedfusion.units.ledger import ServerStep, price_server, server_timeline
from fedfusion.units.phases import server_flops
from fedfusion.units.shaper import Shaper
from fedfusion.units.timeline import chains_from_trace, simulate
from fedfusion.wire.specs import Caps, ClientSpec, PopulationSpec, RoleSpec, merge


def wait_for_nodes(grid: Grid, expected: int, wait_s: float = 60.0) -> list[int]:
    """The federation's node ids once ``expected`` of them are connected (simulation registers them
    asynchronously); fewer after ``wait_s`` is an error that names both numbers."""
    nodes = connected_nodes(grid, expected, wait_s, poll_s=0.2)
    if len(nodes) < expected:
        raise RuntimeError(f"units mode: {len(nodes)} nodes connected, {expected} expected (population.num_clients "
                           f"x units.supernodes)")
    return nodes


def query_nodes(grid: Grid, recipe: Recipe, nodes: list[int], timeout_s: float = 120.0) -> dict[int, Caps]:
    """Every node's device tier and partition, from one QUERY round (the ClientApp's ``@app.query``); a node that
    fails it or does not answer in ``timeout_s`` is an error (the units mode needs every one)."""
    config = merge(ClientSpec(data_spec(recipe.data_source()), recipe.train.seq_len, recipe.engine.threads_per_client),
                   PopulationSpec(dict(recipe.population.mix), recipe.population.num_clients, recipe.seed,
                                  recipe.units.supernodes),
                   RoleSpec(UNITS))
    replies, unanswered = collect(grid, query_messages(nodes, config), timeout_s, pull_interval_s=0.05)
    caps: dict[int, Caps] = {}
    for reply in replies:
        if reply.has_error():
            raise RuntimeError(f"units mode: node {reply.metadata.src_node_id} failed its query: {reply.error.reason}")
        caps[reply.metadata.src_node_id] = Caps.from_config(dict(reply.content.config_records["caps"]))
    if unanswered:
        raise RuntimeError(f"units mode: {len(unanswered)} of {len(nodes)} nodes did not answer the query in "
                           f"{timeout_s} s")
    return caps


def nodes_in_order(caps: dict[int, Caps], clients: int, k: int) -> list[int]:
    """The node ids by node index (``UnitEngine.slot``), which is the partition id: device ``p // k``, its node
    ``p % k``; seeded, run after run. The partition ids must be exactly 0 .. clients x k - 1 and a device's k nodes
    must report one tier (hand-started SuperNodes can get either wrong): a ValueError names what is off."""
    order = sorted(caps, key=lambda n: caps[n].partition)
    got = [caps[n].partition for n in order]
    if got != list(range(clients * k)):
        raise ValueError(f"units mode: the nodes' partition-ids are {got}, expected 0..{clients * k - 1} "
                         f"(population.num_clients {clients} x units.supernodes {k}, one node each)")
    for dev in range(clients):
        tiers = {caps[n].device for n in order[dev * k:(dev + 1) * k]}
        if len(tiers) > 1:
            raise ValueError(f"units mode: the {k} nodes of device {dev} (partition-ids {dev * k}..{dev * k + k - 1}) "
                             f"report different tiers {sorted(tiers)}")
    return order


def training_windows(recipe: Recipe) -> torch.Tensor:
    """The pooled training text of the whole population as token windows (every client's train split, in
    partition order): in the units mode the server holds the data."""
    spec = data_spec(recipe.data_source())
    return torch.cat([client_windows(spec, p, recipe.train.seq_len, "train")
                      for p in range(recipe.population.num_clients)])


def step_batches(recipe: Recipe, windows: torch.Tensor) -> Iterator[torch.Tensor]:
    """Each step's batch of ``train.batch_size`` windows, drawn with a generator seeded by the recipe's seed."""
    gen = torch.Generator().manual_seed(recipe.seed)
    for _ in range(recipe.units.steps):
        yield sample_batch(windows, recipe.train.batch_size, gen)


def train_step(model: PreTrainedModel, opt: torch.optim.Optimizer, batch: torch.Tensor, micro_batches: int,
               on_micro: Callable[[int], None] = lambda micro: None, in_flight: int = 1) -> float:
    """One optimizer step on ``batch`` cut into ``micro_batches`` (the mean loss; gradients of the mean), ``in_flight``
    of them at once (0: all), each in a thread of its own (``on_micro`` runs in it first). Each micro-batch's
    gradients are summed in micro-batch order, as backward() would accumulate them one after the other, so the step
    is the same however many run at once, up to float rounding (with several in flight the updated weights at times
    differ in their last bits, the losses equal; the cause is not found yet). With the engine's ``accumulate`` a
    weight's gradient comes in one micro-batch's gradients only (the devices summed it in micro-batch order), the
    others have None for it."""
    parts = batch.chunk(micro_batches)
    params = [p for p in model.parameters() if p.requires_grad]

    def run(micro: int) -> tuple[float, tuple[torch.Tensor | None, ...]]:
        on_micro(micro)
        loss, _ = lm_loss(model, parts[micro])
        share = len(parts[micro]) / len(batch)
        return finite_loss(loss, "units training") * share, torch.autograd.grad(loss * share, params, allow_unused=True)

    with ThreadPoolExecutor(len(parts) if in_flight <= 0 else min(in_flight, len(parts))) as pool:
        done = list(pool.map(run, range(len(parts))))
    gradient_step(opt, params, [_summed(grads[i] for _, grads in done) for i in range(len(params))])
    return sum(value for value, _ in done)


def _summed(grads: Iterable[torch.Tensor | None]) -> torch.Tensor | None:
    """The micro-batches' gradients of one weight added in micro-batch order, as backward() would accumulate them
    (None where no micro-batch has one)."""
    total: torch.Tensor | None = None
    for g in grads:
        if g is not None:
            total = g if total is None else total.add_(g)
    return total


def price_step(step: int, trace: list[PhaseRecord], firsts: list[int], caps: dict[int, Caps],
               catalog: dict[str, Device], failed: set[int]) -> list[dict[str, Any]]:
    """One clients.jsonl row per device the step sent units to (``firsts``: each device's first node, its id the
    row's ``node``; the row's partition is the device index, its client: ``nodes_in_order`` makes them one): the FLOPs of those units
    (re-sends included), the bytes its nodes received and sent, priced on its catalog profile
    (:func:`~fedfusion.devices.energy.price_work`, as every ledger row); a device taken offline in the step
    (``failed``) did its work for nothing (``wasted``)."""
    rows = []
    for dev, node in enumerate(firsts):
        down = sum(rec.down_bytes.get(dev, 0) for rec in trace)
        if not down:
            continue
        flops = sum(rec.flops.get(dev, 0.0) for rec in trace)
        up = sum(rec.up_bytes.get(dev, 0) for rec in trace)
        cost = price_work(catalog[caps[node].device], flops, down, up)
        rows.append({"round": step, "node": node, "partition": dev, "device": caps[node].device,
                     "status": "failed" if dev in failed else "ok", "flops": flops, "bytes_down": down,
                     "bytes_up": up, **cost.ledger(dev in failed)})
    return rows


def server_step(recipe: Recipe, model: PreTrainedModel, params: int, batch: torch.Tensor,
                trace: list[PhaseRecord], catalog: dict[str, Device]) -> tuple[tuple[float, float], ServerStep]:
    """The step's server work (``fedfusion.units.ledger``): its own compute from the model's shape, the FLOPs of
    the checks it ran and the bytes it sent and received, priced on ``units.server_device``, with the same step on
    ``report.cloud``; and the timeline's ``(server_gap_s, optimizer_s)``."""
    c, u = model.config, recipe.units
    seq = batch.shape[1] - 1  # lm_loss: a window's first seq tokens go in
    own = server_flops(hidden=c.hidden_size, intermediate=c.intermediate_size, layers=c.num_hidden_layers,
                       heads=c.num_attention_heads, kv_heads=c.num_key_value_heads, vocab=c.vocab_size,
                       tokens=batch.shape[0] * seq, seq=seq, params=params, mode=u.offload,
                       optimizer=recipe.train.optimizer)
    verify = sum(rec.verify_flops for rec in trace)
    server = catalog[u.server_device]
    priced = price_server(server, catalog[recipe.report.cloud], own, verify,
                          sum(sum(rec.down_bytes.values()) for rec in trace),
                          sum(sum(rec.up_bytes.values()) for rec in trace),
                          float(sum(g.flops for rec in trace for g in rec.shapes)))
    return server_timeline(server, own, verify, len(trace)), priced


def _worst_rel(trace: list[PhaseRecord], way: str) -> float:
    """The largest |measured - formula| / formula over the devices and phases of ``trace`` that ran without a
    re-dispatch (a re-dispatched unit travels twice; the formula prices one message per device)."""
    worst = 0.0
    for rec in trace:
        if rec.redispatched:
            continue
        measured, formula = getattr(rec, f"{way}_bytes"), getattr(rec, f"formula_{way}")
        for dev, expected in formula.items():
            if expected and dev in measured:
                worst = max(worst, abs(measured[dev] - expected) / expected)
    return worst


class UnitsMethod:
    """The units mode as a :class:`~fedfusion.run.central.CentralMethod`: the server trains the recipe's target on
    the pooled training text for ``units.steps`` optimizer steps, its linear layers (``units.offload``) computed as
    GEMM tiles on the federation's nodes through a :class:`~fedfusion.units.UnitEngine` over a
    :class:`~fedfusion.strategies.transport.GridTransport`; a step's row adds up what it moved, its virtual seconds
    under the devices' links and its priced work (the devices' and the server's)."""

    def __init__(self, recipe: Recipe, run: RunDir) -> None:
        self.recipe, self.run, self.u = recipe, run, recipe.units
        self.target = lm_target(recipe)
        self.model = self.target.model
        write_partition_sizes(run.path, recipe.data_source(), recipe.fusion.method)
        self.windows = training_windows(recipe)
        self.catalog = population_catalog(recipe.population)
        self.opt = make_optimizer(self.model, recipe.train.optimizer, recipe.train.lr, recipe.train.weight_decay)
        self.handle: Any = None  # the target's linear layers routed through the engine (install), while training
        self.returns = Returns(self.u.rejoin_after)  # devices taken offline get units again (units.rejoin_after)

    @property
    def steps(self) -> int:
        return self.u.steps

    def connect(self, grid: Grid, after: int) -> None:
        """Wait for the population's nodes, query their tiers, order them by partition and build the engine over
        them (a resumed run's nodes are new: their ids change with the federation; logged at the step it resumes
        after)."""
        recipe, u = self.recipe, self.u
        k = nodes_per_client(recipe)
        caps = query_nodes(grid, recipe, wait_for_nodes(grid, recipe.population.num_clients * k))
        order = nodes_in_order(caps, recipe.population.num_clients, k)
        self.caps, self.firsts = caps, order[::k]  # each device's node 0
        self.run.log_nodes([{"round": after, "node": n, **caps[n].to_config()} for n in order])
        self.devices: list[UnitDevice] = [from_catalog(self.catalog[caps[n].device], name=str(n),
                                                       link_scale=u.link_scale) for n in self.firsts]
        # the stalled device's nodes each answer stall_after messages, then go silent (for stall_messages of them)
        stall = ({u.stall_partition * k + node: (u.stall_after, u.stall_s, u.stall_messages) for node in range(k)}
                 if u.stall_partition >= 0 else {})
        self.server = server_from_catalog(self.catalog[u.server_device])  # its links: the timeline's and the shaper's
        self.transport = GridTransport(grid, order, floor_s=u.deadline_floor_s, stall=stall, supernodes=k,
                                       shaper=Shaper(self.devices, self.server) if u.shape_links else None)
        self.engine = UnitEngine(self.devices, transport=self.transport, deadline_factor=u.deadline_factor,
                                 verifier=Freivalds(seed=recipe.seed) if u.verify else None,
                                 accumulate=u.micro_batches if u.accumulate else 1, supernodes=k)
        tiers = ", ".join(f"{t}={sum(caps[n].device == t for n in self.firsts)}"
                          for t in sorted({c.device for c in caps.values()}))
        log(INFO, "units mode: %d devices (%s) of %d SuperNode(s) each, offload=%s, %d steps of %d micro-batch(es)%s",
            len(self.devices), tiers, k, u.offload, u.steps, u.micro_batches,
            f", links shaped (catalog rates x {u.link_scale:g})" if u.shape_links else "")

    def restore(self, ckpt: Checkpoint) -> None:
        """The target and the optimizer's state (its groups and moments) as the checkpoint holds them."""
        self.model.load_state_dict(ckpt.target)
        load_optimizer_state(self.opt, ckpt.strategy, ckpt.tensors)

    def batches(self) -> Iterator[torch.Tensor]:
        return step_batches(self.recipe, self.windows)

    def evaluate(self) -> dict[str, float]:
        """The target scored on the server, every layer local (no units), then back to training."""
        if self.handle is not None:
            self.handle.remove()
        scores = self.target.evaluate()
        self.model.train()
        if self.handle is not None:
            self.handle = install(self.model, self.engine, self.u.offload)
        return scores

    def first_row(self) -> dict[str, Any]:
        return {"round": 0, "step": 0, **self.evaluate(), "train_loss": None, "bytes_down": 0, "bytes_up": 0,
                "virtual_s": 0.0, "clients_ok": 0, "clients_failed": 0}

    def step(self, step: int, batch: torch.Tensor) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """One optimizer step through :func:`train_step`, then its server work, timeline and ledger."""
        u, engine = self.u, self.engine
        if self.handle is None:
            self.handle = install(self.model, engine, u.offload)
        traced, waits = len(engine.trace), len(self.transport.waits)
        rejoined = self.rejoin(step)
        offline_before = set(engine.offline)

        def on_micro(micro: int) -> None:
            engine.chain = micro

        started = time.perf_counter()
        loss = train_step(self.model, self.opt, batch, u.micro_batches, on_micro, u.in_flight)
        train_s = time.perf_counter() - started
        trace = engine.trace[traced:]
        gaps, server = server_step(self.recipe, self.model, self.target.params, batch, trace, self.catalog)
        timing = simulate(self.devices, chains_from_trace(trace), deadline_factor=u.deadline_factor,
                          server_gap_s=gaps[0], optimizer_s=gaps[1], in_flight=u.in_flight,
                          accumulate=u.accumulate, server=self.server, **u.runtime()) if trace else None
        used = {d for rec in trace for d in rec.down_bytes}
        self.returns.end(engine, step)
        scores = self.evaluate() if step == u.steps or (u.eval_every and step % u.eval_every == 0) else {}
        step_waits = self.transport.waits[waits:]
        ledger = price_step(step, trace, self.firsts, self.caps, self.catalog, engine.offline - offline_before)
        row = {
            "round": step, "step": step, "train_loss": loss, **scores,
            "phases": len(trace), "messages": sum(len(rec.down_bytes) for rec in trace),
            "bytes_down": sum(sum(rec.down_bytes.values()) for rec in trace),
            "bytes_up": sum(sum(rec.up_bytes.values()) for rec in trace),
            "virtual_s": timing.step_s if timing else 0.0,
            # the step measured: its micro-batches through the transport, the server's own compute, the optimizer
            "train_s": train_s,
            # what no schedule of the step's messages beats under the timeline (the server's links included)
            "virtual_bound_s": timing.lower_bound_s if timing else 0.0,
            "server_link_utilisation": timing.server_link_utilisation if timing else 0.0,
            "redispatched": sum(rec.redispatched for rec in trace),
            "clients_ok": len(used - engine.offline), "clients_failed": len(engine.offline - offline_before),
            "offline": sorted(engine.offline), "rejoined": rejoined, "server_fallback": engine.server_fallback,
            "verify_s": sum(rec.verify_s for rec in trace),
            # the devices' work (clients.jsonl) and the server's own (fedfusion.units.ledger), as fusion rounds add them
            **server.row(),
            "energy_j": sum(r["energy_j"] for r in ledger) + server.energy_j,
            "co2_g": sum(r["co2_g"] for r in ledger) + server.co2_g,
            # measured bytes per device per phase against the closed form (messages.formula_bytes), worst case
            "formula_rel_down": _worst_rel(trace, "down"), "formula_rel_up": _worst_rel(trace, "up"),
            "missed": [{"waited_s": w.waited_s, "deadline_s": w.deadline_s, "devices": w.missed}
                       for w in step_waits if w.missed],
            "transport_s": sum(w.waited_s for w in step_waits),
        }
        return row, ledger

    def rejoin(self, step: int) -> list[int]:
        """The devices offline for their wait or more (``units.rejoin_after`` steps, doubled per failed return:
        :class:`~fedfusion.units.engine.Returns`), given units again from ``step`` on (their weight blocks sent
        anew); none when ``rejoin_after`` is 0."""
        back = self.returns.start(self.engine, step)
        for device, since in back.items():
            log(INFO, "units mode: device %d (node %d) gets units again at step %d, offline since step %d", device,
                self.firsts[device], step, since)
        return list(back)

    def checkpoint(self, step: int, elapsed_s: float) -> Checkpoint:
        """The target, the optimizer's groups (state.json) and moments (tensors.safetensors) after ``step``."""
        groups, moments = optimizer_state(self.opt)
        return Checkpoint(round=step, target={k: v.detach().clone() for k, v in self.model.state_dict().items()},
                          elapsed_s=elapsed_s, strategy=groups, tensors=moments)

    def finish(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def arrays(self) -> ArrayRecord:
        return ArrayRecord(self.model.state_dict())

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The mode, its steps and devices, the loss curve and the server's work beside the cloud's."""
        u = self.u
        return {
            "mode": UNITS, "offload": u.offload, "steps": u.steps,
            "micro_batches": u.micro_batches,  # as the recipe check resolved a 0 (recipe.yaml holds it too)
            "devices": len(self.devices), "train_loss": [r["train_loss"] for r in rows[1:]],
            "offline": sorted(self.engine.offline), "server_device": u.server_device,
            "cloud_device": self.recipe.report.cloud,
            **{k: sum(r[k] for r in rows[1:]) for k in ("server_energy_j", "server_co2_g", "cloud_step_s",
                                                        "cloud_energy_j", "cloud_co2_g")},
            "server_fallback": self.engine.server_fallback,
        }
