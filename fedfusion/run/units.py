"""The exact (units) mode on Flower: the server trains the target centrally and every linear layer's
GEMMs run as tiles on the federation's nodes.

Instead of fusion rounds, :func:`run_units` builds the recipe's target, the pooled training text of the whole
population and one optimizer, routes the Llama's linear layers (``units.offload``: the MLP's, or all of them)
through a :class:`fedfusion.units.UnitEngine` whose devices are the simulation's nodes (their tiers from a QUERY
round, priced by :func:`fedfusion.units.from_catalog`) and whose transport is :class:`GridTransport`: per phase
round one ``train.units`` message per device through ``grid.push_messages``, a short ``pull_messages`` loop, each
device's deadline (the engine's, floored by ``units.deadline_floor_s``); a device past its deadline answers None
and the engine re-dispatches its tiles. Each step writes a ``metrics.jsonl`` row (loss, bytes down / up, the
step's virtual seconds under the devices' links from :func:`fedfusion.units.timeline.simulate`, wall seconds).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from logging import INFO
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.common.logger import log
from flwr.serverapp import Grid
from transformers import PreTrainedModel
from transformers.utils import logging as hf_logging

from fedfusion.config.methods import UNITS
from fedfusion.config.recipe import Recipe, nodes_per_client
from fedfusion.data.population import client_windows, data_spec, write_partition_sizes
from fedfusion.data.text import sample_batch
from fedfusion.devices.catalog import Device, load_catalog
from fedfusion.devices.energy import price_work
from fedfusion.fusion.state import load_optimizer_state, optimizer_state
from fedfusion.run.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from fedfusion.run.report import write_report
from fedfusion.run.run_dir import RunDir, read_jsonl
from fedfusion.run.targets import lm_target
from fedfusion.strategies.nodes import connected_nodes
from fedfusion.train.loop import lm_loss, make_optimizer
from fedfusion.units import Freivalds, PhaseRecord, UnitDevice, UnitEngine, from_catalog, install
from fedfusion.units.ledger import ServerStep, price_server, server_timeline
from fedfusion.units.phases import server_flops
from fedfusion.units.timeline import chains_from_trace, simulate
from fedfusion.wire.specs import (
    UNITS_ACTION,
    UNITS_ERROR,
    UNITS_PAYLOAD,
    UNITS_RECORD,
    Caps,
    ClientSpec,
    PopulationSpec,
    RoleSpec,
    UnitsSpec,
    merge,
)

TTL_SLACK_S = 30.0  # a message outlives its deadline by this much before Flower drops it undelivered
UNITS_MESSAGE = f"{MessageType.TRAIN}.{UNITS_ACTION}"


def _error_kind(reply: Message) -> bytes | None:
    """An error reply as the engine's transport seam reads it: the ClientApp failed (b"": its units go elsewhere,
    the device stays) or the message never reached a node (None: taken offline)."""
    error: Error = reply.error
    return b"" if error.code in (ErrorCode.CLIENT_APP_RAISED_EXCEPTION, ErrorCode.LOAD_CLIENT_APP_EXCEPTION) else None


@dataclass
class PhaseWait:
    """One transport round: how long it waited, the longest deadline it had, the devices that missed theirs."""

    waited_s: float
    deadline_s: float
    missed: list[int]


@dataclass
class GridTransport:
    """The engine's transport seam over a Flower Grid: ``(payloads, deadlines) -> replies`` per node index
    (``UnitEngine.slot``; the device index when each device runs one SuperNode).

    Pushes one ``train.units`` message per node (the bytes as one uint8 array), then pulls on its own short
    loop (``poll_s``; not ``send_and_receive``, which sleeps 0.1 s or 3 s between pulls) until every reply is in
    or each missing node's deadline has passed: that node's reply is None (a later reply is never pulled).
    ``stall`` injects a fault: node index -> (messages it answers first, seconds it then sleeps before replying).
    """

    grid: Grid
    node_ids: list[int]  # node index -> Flower node id
    floor_s: float = 2.0
    poll_s: float = 0.01
    stall: dict[int, tuple[int, float]] = field(default_factory=dict)
    sent: dict[int, int] = field(default_factory=dict)  # messages sent per node index
    waits: list[PhaseWait] = field(default_factory=list)  # one per call; calls overlap with micro-batches in flight
    supernodes: int = 1  # per device: ``PhaseWait.missed`` names devices (node index // supernodes)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def deadline(self, predicted_s: float) -> float:
        """A device's wall-clock deadline: the engine's, but never below the transport's own latency floor."""
        return max(self.floor_s, predicted_s)

    def message(self, slot: int, payload: bytes, deadline_s: float) -> Message:
        with self._lock:  # one call per micro-batch in flight
            count = self.sent.get(slot, 0)
            self.sent[slot] = count + 1
        after, stall_s = self.stall.get(slot, (0, 0.0))
        spec = UnitsSpec(stall_s if slot in self.stall and count >= after else 0.0)
        content = RecordDict({UNITS_RECORD: ArrayRecord({UNITS_PAYLOAD: Array(np.frombuffer(payload, np.uint8))}),
                              "config": ConfigRecord(spec.to_config())})
        return Message(content, dst_node_id=self.node_ids[slot], message_type=UNITS_MESSAGE,
                       ttl=deadline_s + TTL_SLACK_S)

    def __call__(self, payloads: dict[int, bytes], deadlines: dict[int, float]) -> dict[int, bytes | None]:
        walls = {slot: self.deadline(deadlines[slot]) for slot in payloads}
        messages = {slot: self.message(slot, payload, walls[slot]) for slot, payload in payloads.items()}
        start = time.monotonic()
        ids = list(self.grid.push_messages(list(messages.values())))
        if len(ids) != len(messages):
            raise RuntimeError(f"the Grid stored {len(ids)} of {len(messages)} units messages")
        slot_of = dict(zip(ids, messages))
        due = {mid: start + walls[slot_of[mid]] for mid in ids}
        replies: dict[int, bytes | None] = {slot: None for slot in payloads}
        pending = set(ids)
        while pending:
            for reply in self.grid.pull_messages(pending):
                mid = reply.metadata.reply_to_message_id
                if mid not in pending:
                    continue
                pending.discard(mid)
                slot = slot_of[mid]
                if reply.has_error():
                    replies[slot] = _error_kind(reply)
                elif UNITS_ERROR in reply.content:
                    replies[slot] = b""
                else:
                    replies[slot] = reply.content.array_records[UNITS_RECORD][UNITS_PAYLOAD].numpy().tobytes()
            now = time.monotonic()
            pending -= {mid for mid in pending if due[mid] <= now}  # past its deadline: None, dropped if it comes
            if pending:
                time.sleep(self.poll_s)
        missed = sorted({slot // self.supernodes for slot, reply in replies.items() if reply is None})
        self.waits.append(PhaseWait(time.monotonic() - start, max(walls.values()), missed))
        return replies


def wait_for_nodes(grid: Grid, expected: int, wait_s: float = 60.0) -> list[int]:
    """The federation's node ids once ``expected`` of them are connected (simulation registers them
    asynchronously); fewer after ``wait_s`` is an error that names both numbers."""
    nodes = connected_nodes(grid, expected, wait_s, poll_s=0.2)
    if len(nodes) < expected:
        raise RuntimeError(f"units mode: {len(nodes)} nodes connected, {expected} expected (population.num_clients "
                           f"x units.supernodes)")
    return nodes


def query_nodes(grid: Grid, recipe: Recipe, nodes: list[int], timeout_s: float = 120.0) -> dict[int, Caps]:
    """Every node's device tier and partition, from one QUERY round (the ClientApp's ``@app.query``)."""
    config = merge(ClientSpec(data_spec(recipe), recipe.train.seq_len, recipe.engine.threads_per_client),
                   PopulationSpec(dict(recipe.population.mix), recipe.population.num_clients, recipe.seed,
                                  recipe.units.supernodes),
                   RoleSpec(UNITS))
    messages = [Message(RecordDict({"config": ConfigRecord(config)}), dst_node_id=n, message_type=MessageType.QUERY)
                for n in nodes]
    ids = set(grid.push_messages(messages))
    caps: dict[int, Caps] = {}
    deadline = time.monotonic() + timeout_s
    while ids and time.monotonic() < deadline:
        for reply in grid.pull_messages(ids):
            ids.discard(reply.metadata.reply_to_message_id)
            if reply.has_error():
                raise RuntimeError(f"units mode: node {reply.metadata.src_node_id} failed its query: "
                                   f"{reply.error.reason}")
            caps[reply.metadata.src_node_id] = Caps.from_config(dict(reply.content.config_records["caps"]))
        if ids:
            time.sleep(0.05)
    if ids:
        raise RuntimeError(f"units mode: {len(ids)} of {len(nodes)} nodes did not answer the query in {timeout_s} s")
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
    spec = data_spec(recipe)
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
    opt.zero_grad(set_to_none=True)
    parts = batch.chunk(micro_batches)
    params = [p for p in model.parameters() if p.requires_grad]

    def run(micro: int) -> tuple[float, tuple[torch.Tensor | None, ...]]:
        on_micro(micro)
        loss, _ = lm_loss(model, parts[micro])
        value = loss.item()
        if not math.isfinite(value):
            raise FloatingPointError(f"units training loss became {value}")
        share = len(parts[micro]) / len(batch)
        return value * share, torch.autograd.grad(loss * share, params, allow_unused=True)

    with ThreadPoolExecutor(len(parts) if in_flight <= 0 else min(in_flight, len(parts))) as pool:
        done = list(pool.map(run, range(len(parts))))
    for i, p in enumerate(params):
        for _, grads in done:
            g = grads[i]
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
    opt.step()
    return sum(value for value, _ in done)


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


@dataclass
class Progress:
    """How far a units run got: its last completed step and the step of its last checkpoint (what a resume
    continues after)."""

    last: int | None = None
    saved: int | None = None


def run_units(grid: Grid, recipe: Recipe, run: RunDir, on_round: Callable[[dict[str, Any]], None],
              stop: Any = None, resume: bool = False) -> dict[str, Any]:
    """Train the recipe's target for ``units.steps`` steps with its linear layers computed on ``grid``'s nodes;
    with ``resume`` from the run's checkpoint (target, optimizer state, step: ``output.checkpoint_every``), so the
    loss curve goes on as the uninterrupted run's."""
    from fedfusion.strategies.stop import RunInterrupted

    started, progress = time.perf_counter(), Progress()
    try:
        return _run_units(grid, recipe, run, on_round, stop, started, progress, resume)
    except RunInterrupted as exc:
        if exc.failure is not None:  # what runs the clients died
            run.write_summary({"status": "failed", "error": exc.failure, "wall_s": time.perf_counter() - started})
            raise RuntimeError(exc.failure) from exc
        summary = {"status": "interrupted", "name": recipe.name, "rounds": recipe.units.steps,
                   "last_round": progress.last, "resume_after": progress.saved,
                   "wall_s": time.perf_counter() - started}
        run.write_summary(summary)
        return summary
    except BaseException as exc:
        run.write_summary({"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                           "wall_s": time.perf_counter() - started})
        raise


def _run_units(grid: Grid, recipe: Recipe, run: RunDir, on_round: Callable[[dict[str, Any]], None], stop: Any,
               started: float, progress: Progress, resume: bool) -> dict[str, Any]:
    u = recipe.units
    ckpt = load_checkpoint(run.path) if resume else None
    if stop is not None:  # Ctrl-C (or a dead engine) ends the run at the next Grid call
        from fedfusion.strategies.stop import StopGrid

        grid = StopGrid(grid, stop)
    target = lm_target(recipe)
    model = target.model
    write_partition_sizes(run.path, recipe)
    windows = training_windows(recipe)
    k = nodes_per_client(recipe)
    nodes = wait_for_nodes(grid, recipe.population.num_clients * k)
    caps = query_nodes(grid, recipe, nodes)
    order = nodes_in_order(caps, recipe.population.num_clients, k)
    firsts = order[::k]  # each device's node 0
    # a resumed run's nodes are new (their ids change with the federation): logged at the step it resumes after
    run.log_nodes([{"round": ckpt.round if ckpt else 0, "node": n, **caps[n].to_config()} for n in order])
    catalog = load_catalog(recipe.population.catalog)
    devices: list[UnitDevice] = [from_catalog(catalog[caps[n].device], name=str(n)) for n in firsts]
    # the stalled device's nodes each answer stall_after messages, then go silent
    stall = {u.stall_partition * k + node: (u.stall_after, u.stall_s) for node in range(k)} if u.stall_partition >= 0 else {}
    transport = GridTransport(grid, order, floor_s=u.deadline_floor_s, stall=stall, supernodes=k)
    engine = UnitEngine(devices, transport=transport, deadline_factor=u.deadline_factor,
                        verifier=Freivalds(seed=recipe.seed) if u.verify else None,
                        accumulate=u.micro_batches if u.accumulate else 1, supernodes=k)
    opt = make_optimizer(model, recipe.train.optimizer, recipe.train.lr, recipe.train.weight_decay)
    earlier_s = 0.0
    if ckpt is not None:
        model.load_state_dict(ckpt.target)
        load_optimizer_state(opt, ckpt.strategy, ckpt.tensors)
        run.cut_ledgers(ckpt.round)
        progress.last = progress.saved = ckpt.round
        earlier_s = ckpt.elapsed_s
    log(INFO, "units mode: %d devices (%s) of %d SuperNode(s) each, offload=%s, %d steps of %d micro-batch(es)",
        len(devices),
        ", ".join(f"{t}={sum(caps[n].device == t for n in firsts)}" for t in sorted({c.device for c in caps.values()})),
        k, u.offload, u.steps, u.micro_batches)

    def evaluate() -> dict[str, float]:
        scores = target.evaluate()  # on the server, every layer local (no units)
        model.train()
        return scores

    if ckpt is not None:  # the steps up to the checkpoint are in the ledger already
        rows = read_jsonl(run.path / "metrics.jsonl")
    else:
        rows = [{"round": 0, "step": 0, **evaluate(), "train_loss": None, "bytes_down": 0, "bytes_up": 0,
                 "virtual_s": 0.0, "wall_s": time.perf_counter() - started, "clients_ok": 0, "clients_failed": 0}]
        run.log_round(rows[0])
        on_round(rows[0])
    first = rows[0]
    handle = install(model, engine, u.offload)
    last = time.perf_counter()
    for step, batch in enumerate(step_batches(recipe, windows), start=1):
        if step <= (progress.saved or 0):  # drawn all the same: the batches after it are the uninterrupted run's
            continue
        traced, waits = len(engine.trace), len(transport.waits)
        offline_before = set(engine.offline)

        def on_micro(micro: int) -> None:
            engine.chain = micro

        loss = train_step(model, opt, batch, u.micro_batches, on_micro, u.in_flight)
        trace = engine.trace[traced:]
        gaps, server = server_step(recipe, model, target.params, batch, trace, catalog)
        timing = simulate(devices, chains_from_trace(trace), deadline_factor=u.deadline_factor,
                          server_gap_s=gaps[0], optimizer_s=gaps[1], in_flight=u.in_flight,
                          accumulate=u.accumulate, **u.runtime()) if trace else None
        used = {d for rec in trace for d in rec.down_bytes}
        scores: dict[str, float] = {}
        if step == u.steps or (u.eval_every and step % u.eval_every == 0):
            handle.remove()
            scores = evaluate()
            handle = install(model, engine, u.offload)
        now = time.perf_counter()
        step_waits = transport.waits[waits:]
        ledger = price_step(step, trace, firsts, caps, catalog, engine.offline - offline_before)
        run.log_clients(ledger)
        row = {
            "round": step, "step": step, "train_loss": loss, **scores,
            "phases": len(trace), "messages": sum(len(rec.down_bytes) for rec in trace),
            "bytes_down": sum(sum(rec.down_bytes.values()) for rec in trace),
            "bytes_up": sum(sum(rec.up_bytes.values()) for rec in trace),
            "virtual_s": timing.step_s if timing else 0.0,
            "redispatched": sum(rec.redispatched for rec in trace),
            "clients_ok": len(used - engine.offline), "clients_failed": len(engine.offline - offline_before),
            "offline": sorted(engine.offline), "server_fallback": engine.server_fallback,
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
            "wall_s": now - last, "elapsed_s": earlier_s + now - started,
        }
        last = now
        rows.append(row)
        run.log_round(row)
        progress.last = step
        if recipe.output.checkpoint_every and step % recipe.output.checkpoint_every == 0:
            groups, moments = optimizer_state(opt)
            save_checkpoint(run.path, Checkpoint(
                round=step, target={k: v.detach().clone() for k, v in model.state_dict().items()},
                elapsed_s=row["elapsed_s"], strategy=groups, tensors=moments))
            progress.saved = step
        on_round(row)
    handle.remove()
    if recipe.output.save_model:
        hf_logging.disable_progress_bar()
        target.save(run.model_dir, ArrayRecord(model.state_dict()))
    final = rows[-1]
    summary = {
        "status": "ok", "name": recipe.name, "mode": UNITS, "offload": u.offload, "steps": u.steps,
        "micro_batches": u.micro_batches,  # as the recipe check resolved a 0 (recipe.yaml holds it too)
        "target_params": target.params, "metric_names": target.metric_names, "devices": len(devices),
        "initial": {k: first[k] for k in ("eval_loss", "eval_ppl", "eval_acc")},
        "final": {k: final[k] for k in ("eval_loss", "eval_ppl", "eval_acc")},
        "train_loss": [r["train_loss"] for r in rows[1:]],
        "bytes_down": sum(r["bytes_down"] for r in rows), "bytes_up": sum(r["bytes_up"] for r in rows),
        "virtual_s": sum(r["virtual_s"] for r in rows), "offline": sorted(engine.offline),
        "energy_j": sum(r.get("energy_j", 0.0) for r in rows), "co2_g": sum(r.get("co2_g", 0.0) for r in rows),
        "server_device": u.server_device, "cloud_device": recipe.report.cloud,
        **{k: sum(r[k] for r in rows[1:]) for k in ("server_energy_j", "server_co2_g", "cloud_step_s", "cloud_energy_j",
                                                    "cloud_co2_g")},
        "server_fallback": engine.server_fallback, "wall_s": earlier_s + time.perf_counter() - started,
        "sample": target.sample(),
    }
    run.write_summary(summary)
    write_report(run.path)
    return summary
