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
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from fedfusion.units.accumulate import StepSum
from fedfusion.units.devices import UnitDevice
from fedfusion.units.messages import (
    DeviceRuntime,
    Gemm,
    Operand,
    Spec,
    SumRef,
    decode_kept,
    decode_reply,
    encode_units,
    formula_bytes,
    is_weight,
    spec,
)
from fedfusion.units.plan import LAYOUTS, CostModel, GemmShape, PhasePlan, Tile, plan_phase, tile_loads
from fedfusion.units.verify import Freivalds, Strikes

Worker = Callable[[bytes], "bytes | None"]
# payload per node (``UnitEngine.slot``: the device with one SuperNode each) and its deadline in seconds -> reply per
# node (None: none by the deadline, b"": an error)
Transport = Callable[[dict[int, bytes], dict[int, float]], "dict[int, bytes | None]"]


def in_process(workers: list[Worker]) -> Transport:
    """A transport that calls each node's worker in turn (an exception is an error reply). A worker takes one
    message at a time, as a SuperNode does: micro-batches in flight queue for it (a ``DeviceRuntime``'s cache and
    sums are not safe for two messages at once; measured: error replies and re-sends in 3 of 20 steps without it).
    The queue is not in order of issue: a message that counts on a block sent in another micro-batch's message may
    go first, get an error reply and be re-sent with the block (exact all the same, as on Flower)."""
    locks = [threading.Lock() for _ in workers]

    def send(payloads: dict[int, bytes], deadlines: dict[int, float]) -> dict[int, bytes | None]:
        replies: dict[int, bytes | None] = {}
        for dev, payload in payloads.items():
            try:
                with locks[dev]:
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
class Returns:
    """When devices taken offline get units again: after ``after`` steps offline (0: never), doubled each time a
    device goes offline again in the step it came back in (exponential backoff: a device that is gone for good costs
    a deadline at steps ``after``, ``3 after``, ``7 after``, ... rather than every ``after``; one step it finishes
    online resets its wait). The caller marks each step's start (:meth:`start`: the due devices rejoin) and end
    (:meth:`end`: who went offline in it)."""

    after: int
    since: dict[int, int] = field(default_factory=dict)  # device -> the step it went offline in
    misses: dict[int, int] = field(default_factory=dict)  # device -> times in a row it went offline on its return
    back: set[int] = field(default_factory=set)  # the devices that rejoined at this step's start

    def wait(self, device: int) -> int:
        """Steps ``device`` stays offline this time: ``after`` times 2 per return it failed in a row."""
        return self.after * 2 ** self.misses.get(device, 0)

    def start(self, engine: UnitEngine, step: int) -> dict[int, int]:
        """Rejoin the devices offline for their wait or more (``UnitEngine.rejoin``); device -> step it left."""
        due = {d: s for d, s in sorted(self.since.items()) if self.after and step - s >= self.wait(d)}
        for device in due:
            engine.rejoin(device)
            del self.since[device]
        self.back = set(due)
        return due

    def end(self, engine: UnitEngine, step: int) -> None:
        """Note the devices the step took offline; a returned device that went offline again waits twice as long
        next time, one that finished the step online starts afresh."""
        for device in self.back:
            if device in engine.offline:
                self.misses[device] = self.misses.get(device, 0) + 1
            else:
                self.misses.pop(device, None)
        self.back = set()
        self.since.update({d: step for d in engine.offline if d not in self.since})


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
    held: dict[int, set[str]] = field(default_factory=dict)  # wire keys of the weight blocks each node holds
    transport: Transport | None = None  # how messages travel (default: in process, through ``workers``)
    # SuperNodes per device: micro-batch c's messages go to the device's node c mod k, each node with its own weight
    # cache and running sums; nodes are numbered ``slot(device, node)`` (workers, payloads and replies by slot)
    supernodes: int = 1
    deadline_factor: float = 3.0  # a device's deadline: this multiple of its message's predicted time
    # micro-batches per step whose weight gradients the devices sum before uploading (``accumulate``); 1: off
    accumulate: int = 1
    # this step's sums by (weight and version, node): each node sums its own micro-batches
    _sums: dict[tuple[str, int], StepSum] = field(default_factory=dict, repr=False)
    _settled: threading.Condition = field(init=False, repr=False)
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
        if self.supernodes < 1:
            raise ValueError(f"supernodes must be >= 1, got {self.supernodes}")
        if self.workers is None:
            self.workers = [DeviceRuntime() for _ in range(len(self.devices) * self.supernodes)]
        if len(self.workers) != len(self.devices) * self.supernodes:
            raise ValueError("one worker per device and SuperNode")
        if self.transport is None:
            self.transport = in_process(self.workers)
        self._settled = threading.Condition(self._lock)  # a micro-batch's products of a sum kept (or lost)

    def cost_model(self, elem_bytes: int) -> CostModel:
        if elem_bytes not in self._models:
            self._models[elem_bytes] = CostModel(self.devices, elem_bytes)
        return self._models[elem_bytes]

    def slot(self, device: int, node: int) -> int:
        """The index of ``device``'s SuperNode ``node`` (the order of the nodes' partition ids)."""
        return device * self.supernodes + node

    @property
    def node(self) -> int:
        """The SuperNode of each device that the calling thread's micro-batch uses."""
        return self.chain % self.supernodes

    def live(self) -> list[int]:
        """Devices that may get units: online and not blocked."""
        return [d for d in range(len(self.devices)) if d not in self.offline and not self.strikes.blocked(d)]

    def rejoin(self, device: int) -> None:
        """``device``, taken offline when it missed a deadline, may get units again. What its nodes held is not
        trusted (a device that went away may have restarted empty): its weight blocks go again with its next
        messages. Between steps only (no running sum open: a step's sums are planned over the devices live when it
        began); a device that is not offline is an error that names it."""
        with self._lock:
            if device not in self.offline:
                raise ValueError(f"device {device} is not offline (offline: {sorted(self.offline) or 'none'})")
            if self._sums:
                raise RuntimeError(f"device {device} may rejoin between steps only: running sums are open "
                                   f"({', '.join(sorted(name for name, _ in self._sums))})")
            self.offline.discard(device)
            for node in range(self.supernodes):
                self.held.pop(self.slot(device, node), None)

    def phase(self, gemms: list[Gemm]) -> list[torch.Tensor | None]:
        """Compute every GEMM of one phase through units and return the verified products.

        Round after round: send each device one message with its pending units; a device that does not answer
        goes offline and its units move on; when every unit is in, each GEMM is assembled and checked once
        (Freivalds on the whole product); a GEMM that fails has its tiles checked one by one, the culprits'
        devices get a strike and their tiles are re-dispatched to another device (first valid result wins).

        With ``accumulate`` > 1 a weight gradient (``Gemm.sums``) is summed on the devices over the step's
        micro-batches (``fedfusion.units.accumulate``): its product is None but for the step's last micro-batch to
        reach that weight, which waits until the others' products are kept and gets the step's sum.
        """
        with self._lock:  # released only while the transport waits for the devices
            joined = {gi: self._join(g) for gi, g in enumerate(gemms) if g.sums and self.accumulate > 1}
            for s, _, emit in joined.values():
                if emit:  # every other micro-batch's products kept (or lost) first: the device sums them all
                    self._settled.wait_for(lambda s=s: s.finished >= s.count - 1)  # type: ignore[misc]
            settled = False
            try:
                outs = self._phase(gemms, joined)
                settled = True
            finally:
                for s, _, emit in joined.values():
                    if emit and settled:
                        del self._sums[s.name, self.node]
                    elif not emit:
                        s.finished += 1
                self._settled.notify_all()
            return outs

    def _join(self, g: Gemm) -> tuple[StepSum, int, bool]:
        """The calling micro-batch's part in its node's sum of ``g``'s weight gradient over the step: (sum, its
        place among the node's micro-batches, emit). With k SuperNodes per device node n sums micro-batches n, n+k, .."""
        node, k = self.node, self.supernodes
        count = len(range(node, self.accumulate, k))
        s = self._sums.setdefault((g.sums, node), StepSum(g.sums, count, []))
        micro = self.chain // k
        if micro in s.operands or not 0 <= micro < s.count:
            raise RuntimeError(f"micro-batch {self.chain} of {self.accumulate} reached {g.sums} twice or out of range "
                               "(set engine.chain per micro-batch)")
        s.operands[micro] = (g.a.logical(), g.b.logical())
        s.arrived += 1
        return s, micro, s.arrived == s.count

    def _phase(self, gemms: list[Gemm], joined: dict[int, tuple[StepSum, int, bool]]) -> list[torch.Tensor | None]:
        start, worker_s = time.perf_counter(), 0.0
        elem = gemms[0].a.base.element_size()
        cm = self.cost_model(elem)
        shapes = [g.shape for g in gemms]
        if not self.live():  # every device offline or blocked: the server computes the phase itself
            self.server_fallback += len(gemms)
            return [(joined[gi][0].server_sum() if joined[gi][2] else None) if gi in joined
                    else g.a.logical() @ g.b.logical() for gi, g in enumerate(gemms)]
        plan = plan_phase(cm, self.live(), shapes, self.layouts, self.max_groups)
        rec = PhaseRecord(self.chain, shapes, [spec(g) for g in gemms], plan)
        phase_id = next(self._phase_ids)
        work = _Work(list(gemms), [t for t in plan.tiles if t.gemm not in joined])
        for gi, (s, micro, emit) in joined.items():
            if not s.tiles:  # the first micro-batch fixes the tiling and the holders of the sums
                s.tiles = [replace(t, gemm=0) for t in plan.tiles if t.gemm == gi]
            live = set(self.live())
            for pos, t in enumerate(s.tiles):
                if t.device not in live:
                    s.lost.add(pos)
                if pos not in s.lost:
                    uid = work.add(replace(t, gemm=gi), (gi, pos, -1))
                    work.sums[uid] = (s.key(pos), micro, s.count if emit else 0)
                elif emit:
                    for uid in work.recompute(gi, s, pos):
                        work.tiles[uid] = self._reassign(cm, work.tiles[uid], work.tried[uid], plan.tiles)
                        rec.redispatched += 1
        tiles, pending, tried, results = work.tiles, work.pending, work.tried, work.results
        first = True
        while True:
            while pending:
                for uid in [u for u in pending if tiles[u].device < 0]:  # no device left: the server does it
                    a, b = work.gemms[tiles[uid].gemm].blocks(tiles[uid])
                    results[uid] = a @ b
                    self.server_fallback += 1
                    pending.discard(uid)
                if not pending:
                    break
                worker_s += self._dispatch(work, rec, elem, first, phase_id)
                first = False
                for uid in [u for u in pending if u in work.sums]:  # a running sum lost: recomputed at the emit
                    gi, pos, _ = work.pos.pop(uid)
                    s = joined[gi][0]
                    s.lost.add(pos)
                    pending.discard(uid)
                    if work.sums[uid][2]:
                        work.recompute(gi, s, pos)
                for uid in pending:
                    tiles[uid] = self._reassign(cm, tiles[uid], tried[uid], plan.tiles)
                    rec.redispatched += 1
            outs = self._assemble(work, len(gemms), joined)
            if self.verifier is None:
                break
            v0 = time.thread_time()  # CPU seconds of the check (wall time on shared cores is noise)
            for gi, c in enumerate(outs):
                if c is not None:
                    outs[gi] = self._verify(work, gi, c, joined.get(gi), rec)
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

    def _verify(self, work: _Work, gi: int, c: torch.Tensor, joined: tuple[StepSum, int, bool] | None,
                rec: PhaseRecord) -> torch.Tensor:
        """Check GEMM ``gi``'s product ``c`` (a step's sum: over every micro-batch's operands); when it fails,
        strike the culprit tiles' devices and make their units pending again (a running sum: recomputed in full
        elsewhere). Returns the product to use (the server's own when no single tile is caught)."""
        assert self.verifier is not None
        g = work.gemms[gi]
        a, b = joined[0].whole() if joined else (g.a.logical(), g.b.logical())
        weight = (g.b.key, g.b.t) if not joined and is_weight(g.b.key) else None
        rec.verify_flops += self.verifier.flops(a, b)
        if self.verifier.check(a, b, c, weight=weight):
            return c
        culprits = 0
        mine = [(u, work.pos.get(u)) for u, t in enumerate(work.tiles)
                if u in work.results and (t.gemm == gi or work.pos.get(u, (-1,))[0] == gi)]
        for uid, where in mine:
            t = work.tiles[uid]
            ab = joined[0].blocks(where[1]) if joined and where and where[2] < 0 else work.gemms[t.gemm].blocks(t)
            rec.verify_flops += self.verifier.flops(*ab)
            if self.verifier.check(*ab, work.results[uid]):
                continue
            culprits += 1
            self.strikes.strike(t.device)
            rec.failed_devices.append(t.device)
            del work.results[uid]
            if joined and where and where[2] < 0:  # a wrong sum: every micro-batch of that tile, elsewhere
                work.pos.pop(uid)
                joined[0].lost.add(where[1])
                work.recompute(gi, joined[0], where[1])
            else:
                work.pending.add(uid)
        if culprits:
            return c
        self.server_fallback += 1  # wrong as a whole, no tile caught alone: the server computes this GEMM
        return joined[0].server_sum() if joined else g.a.logical() @ g.b.logical()

    def _dispatch(self, work: _Work, rec: PhaseRecord, elem: int, first: bool, phase_id: int) -> float:
        """One message per device (to the micro-batch's SuperNode of it) with its pending units; collect
        well-formed replies. Returns the seconds the transport took (the lock released meanwhile, so other
        micro-batches' phases go on)."""
        tiles, pending, gemms = work.tiles, work.pending, work.gemms
        node = self.node
        by_dev: dict[int, list[int]] = {}
        for uid in sorted(pending):
            by_dev.setdefault(tiles[uid].device, []).append(uid)
        payloads: dict[int, bytes] = {}
        deadlines: dict[int, float] = {}
        cm = self.cost_model(elem)
        for dev, uids in by_dev.items():
            slot = self.slot(dev, node)
            units = [(uid, gemms[tiles[uid].gemm], tiles[uid]) for uid in uids]
            held = self.held.setdefault(slot, set()) if self.cache_weights else None
            sums = {uid: work.sums[uid] for uid in uids if uid in work.sums}
            if first:
                versions = {op.key: op.version for g in gemms for op in (g.a, g.b)}
                rec.formula_down[dev], rec.formula_up[dev] = formula_bytes(
                    [u[2] for u in units], [spec(g) for g in gemms], elem, None if held is None else set(held),
                    versions, sums={i: bool(sums[uid][2]) for i, uid in enumerate(uids) if uid in sums}, phase=phase_id)
            payloads[slot] = encode_units(phase_id, units, held, sums)
            rec.down_bytes[dev] = rec.down_bytes.get(dev, 0) + len(payloads[slot])
            down, flops, up = tile_loads([u[2] for u in units], len(self.devices))
            rec.flops[dev] = rec.flops.get(dev, 0.0) + float(flops[dev])
            deadlines[slot] = self.deadline_factor * float(cm.time(down, flops, up)[dev])
            for uid in uids:
                work.tried[uid].add(dev)
        t0 = time.perf_counter()
        self._lock.release()
        try:
            replies = self.transport(payloads, deadlines)  # type: ignore[misc]
        finally:
            self._lock.acquire()
        worker_s = time.perf_counter() - t0
        for dev, uids in by_dev.items():
            reply = replies.get(self.slot(dev, node))
            if reply is None:
                self.offline.add(dev)
                rec.failed_devices.append(dev)
                continue
            if not reply:  # an error reply: the node lost its cache and its sums (or failed); its units go elsewhere
                self.held.pop(self.slot(dev, node), None)
                for (_, at), s in self._sums.items():
                    if at == node:
                        s.lost |= {pos for pos, t in enumerate(s.tiles) if t.device == dev}
                continue
            rec.up_bytes[dev] = rec.up_bytes.get(dev, 0) + len(reply)
            got = decode_reply(reply)
            keeps = [uid for uid in uids if uid in work.sums and not work.sums[uid][2]]
            if decode_kept(reply) != len(keeps):  # kept all or none: the count says which
                keeps = []
            for uid in uids:
                t, c = tiles[uid], got.get(uid)
                if uid in keeps:
                    pending.discard(uid)
                elif c is not None and c.shape == (t.i1 - t.i0, t.j1 - t.j0) and c.dtype == gemms[t.gemm].a.base.dtype:
                    work.results[uid] = c
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
    def _assemble(work: _Work, count: int, joined: dict[int, tuple[StepSum, int, bool]]) -> list[torch.Tensor | None]:
        """Each GEMM's product from its tiles (None: a micro-batch's share of a sum the devices keep); k-split
        partials are summed in order of their inner range, a recomputed sum's micro-batches in micro-batch order."""
        outs: list[torch.Tensor | None] = []
        for gi in range(count):
            g = work.gemms[gi]
            if gi in joined and not joined[gi][2]:
                outs.append(None)
                continue
            s = g.shape
            c = torch.zeros((s.m, s.n), dtype=g.a.base.dtype)
            if gi in joined:
                parts: dict[int, torch.Tensor] = {}
                for uid, (_, pos, _) in sorted(((u, w) for u, w in work.pos.items() if w[0] == gi),
                                               key=lambda uw: uw[1][2]):
                    r = work.results[uid]
                    parts[pos] = r if pos not in parts else parts[pos] + r
                tiles = joined[gi][0].tiles
                for pos in sorted(parts, key=lambda p: tiles[p].k0):
                    t = tiles[pos]
                    c[t.i0:t.i1, t.j0:t.j1] += parts[pos].to(c.dtype)
            else:
                for uid in sorted((u for u, t in enumerate(work.tiles) if t.gemm == gi), key=lambda u: work.tiles[u].k0):
                    t = work.tiles[uid]
                    c[t.i0:t.i1, t.j0:t.j1] += work.results[uid].to(c.dtype)
            outs.append(c)
        return outs


@dataclass
class _Work:
    """One phase's units as the engine works through them: GEMMs (the phase's, then the micro-batches' of a sum
    recomputed in full), tiles by unit id, pending units, the devices tried per unit, results; for the units of a
    step's sum, their running-sum fields (``sums``) and ``pos``: (GEMM, tile position in the sum, micro-batch or
    -1 for a device's running sum)."""

    gemms: list[Gemm]
    tiles: list[Tile]
    pending: set[int] = field(default_factory=set)
    tried: dict[int, set[int]] = field(default_factory=dict)
    results: dict[int, torch.Tensor] = field(default_factory=dict)
    sums: dict[int, SumRef] = field(default_factory=dict)
    pos: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    _micro: dict[tuple[int, int], int] = field(default_factory=dict)  # (GEMM, micro-batch) -> its index in gemms

    def __post_init__(self) -> None:
        self.pending = set(range(len(self.tiles)))
        self.tried = {uid: set() for uid in self.pending}

    def add(self, tile: Tile, pos: tuple[int, int, int], tried: set[int] | None = None) -> int:
        uid = len(self.tiles)
        self.tiles.append(tile)
        self.pending.add(uid)
        self.tried[uid] = set(tried or ())
        self.pos[uid] = pos
        return uid

    def recompute(self, gi: int, s: StepSum, pos: int) -> list[int]:
        """Sum ``pos`` of GEMM ``gi`` as one plain unit per micro-batch, on its holder for now (the caller moves
        them: the holder counts as tried)."""
        t, uids = s.tiles[pos], []
        for m, (a, b) in sorted(s.operands.items()):
            if (gi, m) not in self._micro:  # operand names apart per micro-batch: blocks are deduplicated by name
                self._micro[(gi, m)] = len(self.gemms)
                self.gemms.append(Gemm(Operand(f"A{gi}~{m}", a), Operand(f"B{gi}~{m}", b)))
            uids.append(self.add(replace(t, gemm=self._micro[(gi, m)]), (gi, pos, m), {t.device}))
        return uids
