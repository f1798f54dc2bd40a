"""The server's unit scheduler: plan a phase, send one message per device, verify, re-dispatch, assemble.

Workers are callables ``bytes -> bytes | None`` (``None``: no reply before the deadline; an exception: an error
reply, e.g. a device that lost its weight cache). In-process they are ``DeviceRuntime`` objects or one of the
emulated behaviours of ``fedfusion.units.workers``; on Flower they wrap a message round trip. The engine records
per phase what moved (measured serialised bytes per device) so the timeline (``fedfusion.units.timeline``) can
price the step under links, micro-batches and churn.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from fedfusion.units.devices import UnitDevice
from fedfusion.units.messages import DeviceRuntime, Gemm, Spec, decode_reply, encode_units, formula_bytes, spec
from fedfusion.units.plan import LAYOUTS, CostModel, GemmShape, PhasePlan, Tile, plan_phase, tile_loads
from fedfusion.units.verify import Freivalds, Strikes

Worker = Callable[[bytes], "bytes | None"]
# payload per device and its deadline in seconds -> reply per device (None: none by the deadline, b"": an error)
Transport = Callable[[dict[int, bytes], dict[int, float]], "dict[int, bytes | None]"]


def in_process(workers: list[Worker]) -> Transport:
    """A transport that calls each device's worker in turn (an exception is an error reply)."""

    def send(payloads: dict[int, bytes], deadlines: dict[int, float]) -> dict[int, bytes | None]:
        replies: dict[int, bytes | None] = {}
        for dev, payload in payloads.items():
            try:
                replies[dev] = workers[dev](payload)
            except Exception:
                replies[dev] = b""
        return replies

    return send


@dataclass
class PhaseRecord:
    """One phase as it ran: shapes, plan, measured and formula bytes per device, faults and server time."""

    chain: int
    shapes: list[GemmShape]
    specs: list[Spec]
    plan: PhasePlan
    down_bytes: dict[int, int] = field(default_factory=dict)
    up_bytes: dict[int, int] = field(default_factory=dict)
    flops: dict[int, float] = field(default_factory=dict)  # the FLOPs of the units sent to each device (re-sends too)
    formula_down: dict[int, int] = field(default_factory=dict)
    formula_up: dict[int, int] = field(default_factory=dict)
    redispatched: int = 0
    failed_devices: list[int] = field(default_factory=list)
    verify_s: float = 0.0  # CPU seconds of the server's checks
    verify_flops: float = 0.0  # their FLOPs (``verify.check_flops`` per product or tile checked)
    server_s: float = 0.0  # wall seconds of the server's side of the phase (plan, encode, decode, check, assemble)


@dataclass
class UnitEngine:
    """Routes GEMMs through sub-matrix units on ``devices``; exact up to the summation order of k-splits."""

    devices: list[UnitDevice]
    workers: list[Worker] | None = None
    verifier: Freivalds | None = field(default_factory=lambda: Freivalds(seed=0))
    strikes: Strikes = field(default_factory=Strikes)
    layouts: tuple[str, ...] = LAYOUTS
    max_groups: int | None = None
    record: bool = True
    offline: set[int] = field(default_factory=set)
    trace: list[PhaseRecord] = field(default_factory=list)
    server_fallback: int = 0  # tiles the server computed itself because no device was left
    cache_weights: bool = True  # leave out weight blocks a device already holds (same version)
    held: dict[int, set[str]] = field(default_factory=dict)  # wire keys of the weight blocks each device holds
    transport: Transport | None = None  # how messages travel (default: in process, through ``workers``)
    deadline_factor: float = 3.0  # a device's deadline: this multiple of its message's predicted time
    _models: dict[int, CostModel] = field(default_factory=dict)
    # several micro-batches in flight: one thread each, its own chain; the lock guards everything but the transport
    _local: threading.local = field(default_factory=threading.local, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _phase_ids: itertools.count = field(default_factory=itertools.count, repr=False)

    @property
    def chain(self) -> int:
        """The micro-batch the calling thread's next phases belong to (set by the training loop, per thread)."""
        return int(getattr(self._local, "chain", 0))

    @chain.setter
    def chain(self, value: int) -> None:
        self._local.chain = value

    def __post_init__(self) -> None:
        if self.workers is None:
            self.workers = [DeviceRuntime() for _ in self.devices]
        if len(self.workers) != len(self.devices):
            raise ValueError("one worker per device")
        if self.transport is None:
            self.transport = in_process(self.workers)

    def cost_model(self, elem_bytes: int) -> CostModel:
        if elem_bytes not in self._models:
            self._models[elem_bytes] = CostModel(self.devices, elem_bytes)
        return self._models[elem_bytes]

    def live(self) -> list[int]:
        """Devices that may get units: online and not blocked."""
        return [d for d in range(len(self.devices)) if d not in self.offline and not self.strikes.blocked(d)]

    def phase(self, gemms: list[Gemm]) -> list[torch.Tensor]:
        """Compute every GEMM of one phase through units and return the verified products.

        Round after round: send each device one message with its pending units; a device that does not answer
        goes offline and its units move on; when every unit is in, each GEMM is assembled and checked once
        (Freivalds on the whole product); a GEMM that fails has its tiles checked one by one, the culprits'
        devices get a strike and their tiles are re-dispatched to another device (first valid result wins).
        """
        with self._lock:  # released only while the transport waits for the devices
            start, worker_s = time.perf_counter(), 0.0
            elem = gemms[0].a.base.element_size()
            cm = self.cost_model(elem)
            shapes = [g.shape for g in gemms]
            if not self.live():  # every device offline or blocked: the server computes the phase itself
                self.server_fallback += len(gemms)
                return [g.a.logical() @ g.b.logical() for g in gemms]
            plan = plan_phase(cm, self.live(), shapes, self.layouts, self.max_groups)
            rec = PhaseRecord(self.chain, shapes, [spec(g) for g in gemms], plan)
            phase_id = next(self._phase_ids)
            tiles = list(plan.tiles)
            results: dict[int, torch.Tensor] = {}
            pending = set(range(len(tiles)))
            tried: dict[int, set[int]] = {uid: set() for uid in pending}
            first = True
            while True:
                while pending:
                    for uid in [u for u in pending if tiles[u].device < 0]:  # no device left: the server does it
                        a, b = gemms[tiles[uid].gemm].blocks(tiles[uid])
                        results[uid] = a @ b
                        self.server_fallback += 1
                        pending.discard(uid)
                    if not pending:
                        break
                    worker_s += self._dispatch(gemms, tiles, pending, tried, results, rec, elem, first, phase_id)
                    first = False
                    for uid in pending:
                        tiles[uid] = self._reassign(cm, tiles[uid], tried[uid], plan.tiles)
                        rec.redispatched += 1
                outs = self._assemble(gemms, tiles, results)
                if self.verifier is None:
                    break
                v0 = time.thread_time()  # CPU seconds of the check (wall time on shared cores is noise)
                for gi, (g, c) in enumerate(zip(gemms, outs)):
                    rec.verify_flops += self.verifier.flops(g.a.logical(), g.b.logical())
                    if self.verifier.check(g.a.logical(), g.b.logical(), c):
                        continue
                    mine = [(u, g.blocks(t)) for u, t in enumerate(tiles) if t.gemm == gi]
                    rec.verify_flops += sum(self.verifier.flops(*ab) for _, ab in mine)
                    culprits = [u for u, ab in mine if not self.verifier.check(*ab, results[u])]
                    for uid in culprits:
                        self.strikes.strike(tiles[uid].device)
                        rec.failed_devices.append(tiles[uid].device)
                        del results[uid]
                        pending.add(uid)
                    if not culprits:  # wrong as a whole, no tile caught alone: the server computes this GEMM
                        outs[gi] = g.a.logical() @ g.b.logical()
                        self.server_fallback += 1
                rec.verify_s += time.thread_time() - v0
                if not pending:
                    break
                for uid in pending:
                    tiles[uid] = self._reassign(cm, tiles[uid], tried[uid], plan.tiles)
                    rec.redispatched += 1
            rec.server_s = time.perf_counter() - start - worker_s
            if self.record:
                self.trace.append(rec)
            return outs

    def _dispatch(self, gemms: list[Gemm], tiles: list[Tile], pending: set[int], tried: dict[int, set[int]],
                  results: dict[int, torch.Tensor], rec: PhaseRecord, elem: int, first: bool, phase_id: int) -> float:
        """One message per device with its pending units; collect well-formed replies. Returns the seconds the
        transport took (the lock released meanwhile, so other micro-batches' phases go on)."""
        by_dev: dict[int, list[int]] = {}
        for uid in sorted(pending):
            by_dev.setdefault(tiles[uid].device, []).append(uid)
        payloads: dict[int, bytes] = {}
        deadlines: dict[int, float] = {}
        cm = self.cost_model(elem)
        for dev, uids in by_dev.items():
            units = [(uid, gemms[tiles[uid].gemm], tiles[uid]) for uid in uids]
            held = self.held.setdefault(dev, set()) if self.cache_weights else None
            if first:
                versions = {op.key: op.version for g in gemms for op in (g.a, g.b)}
                rec.formula_down[dev], rec.formula_up[dev] = formula_bytes(
                    [u[2] for u in units], rec.specs, elem, None if held is None else set(held), versions)
            payloads[dev] = encode_units(phase_id, units, held)
            rec.down_bytes[dev] = rec.down_bytes.get(dev, 0) + len(payloads[dev])
            down, flops, up = tile_loads([u[2] for u in units], len(self.devices))
            rec.flops[dev] = rec.flops.get(dev, 0.0) + float(flops[dev])
            deadlines[dev] = self.deadline_factor * float(cm.time(down, flops, up)[dev])
            for uid in uids:
                tried[uid].add(dev)
        t0 = time.perf_counter()
        self._lock.release()
        try:
            replies = self.transport(payloads, deadlines)  # type: ignore[misc]
        finally:
            self._lock.acquire()
        worker_s = time.perf_counter() - t0
        for dev, uids in by_dev.items():
            reply = replies.get(dev)
            if reply is None:
                self.offline.add(dev)
                rec.failed_devices.append(dev)
                continue
            if not reply:  # an error reply: the device lost its cache (or failed); its units go elsewhere
                self.held.pop(dev, None)
                continue
            rec.up_bytes[dev] = rec.up_bytes.get(dev, 0) + len(reply)
            got = decode_reply(reply)
            for uid in uids:
                t, c = tiles[uid], got.get(uid)
                if c is not None and c.shape == (t.i1 - t.i0, t.j1 - t.j0) and c.dtype == gemms[t.gemm].a.base.dtype:
                    results[uid] = c
                    pending.discard(uid)
                else:
                    self.strikes.strike(dev)
                    rec.failed_devices.append(dev)
        return worker_s

    def _reassign(self, cm: CostModel, tile: Tile, tried: set[int], tiles: list[Tile]) -> Tile:
        """The same tile on the live device, not yet tried for it, with the earliest predicted finish (-1: none)."""
        cand = [d for d in self.live() if d not in tried]
        if not cand:
            return Tile(tile.gemm, -1, tile.i0, tile.i1, tile.j0, tile.j1, tile.k0, tile.k1)
        down, flops, up = tile_loads(tiles, len(self.devices))
        idx = np.array(cand)
        finish = cm.time(down[idx] + tile.a_elems + tile.b_elems, flops[idx] + tile.flops, up[idx] + tile.c_elems, idx)
        dev = int(idx[int(np.argmin(finish))])
        return Tile(tile.gemm, dev, tile.i0, tile.i1, tile.j0, tile.j1, tile.k0, tile.k1)

    @staticmethod
    def _assemble(gemms: list[Gemm], tiles: list[Tile], results: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """Each GEMM's product from its tiles; k-split partials are summed in order of their inner range."""
        outs = []
        for gi, g in enumerate(gemms):
            s = g.shape
            c = torch.zeros((s.m, s.n), dtype=g.a.base.dtype)
            for uid in sorted((u for u, t in enumerate(tiles) if t.gemm == gi), key=lambda u: tiles[u].k0):
                t = tiles[uid]
                c[t.i0:t.i1, t.j0:t.j1] += results[uid].to(c.dtype)
            outs.append(c)
        return outs
