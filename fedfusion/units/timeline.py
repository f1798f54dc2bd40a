"""Virtual time of a step in the units mode: emulated links, several micro-batches in flight, devices that die.

Each device has three FIFO resources: its downlink, its processor and its uplink. A message issued at time ``t``

    down:    starts at max(t, downlink free), takes overhead + bytes_down / down_bps, then rtt / 2 to arrive
    compute: starts at max(arrival, processor free), takes flops / flops_rate
    up:      starts at max(compute end, uplink free), takes bytes_up / up_bps, then rtt / 2 back

so a device can receive micro-batch 2's operands while it computes micro-batch 1's and sends back micro-batch
0's. That needs a device runtime that takes its next message while it works on the current one. ``lanes`` caps the
messages a device holds at once: a message cannot start its download before the reply of the message ``lanes``
before it on that device is back. ``lanes=1`` is the order of Flower 1.42's SuperNode: it pulls a message, runs the
ClientApp, sends the reply and only then pulls the next, so its downlink, processor and uplink never overlap. Only
the order: the model charges one ``rtt`` and ``overhead_s`` per message, while a deployed SuperNode makes several
calls per message, polls its ClientApp every 0.5 s and sleeps 3 s after a pull that finds nothing (the simulation
engine, for its part, may run two of a node's messages at once); ``lanes=0`` (no limit, the default) is a runtime that prefetches, the seed
paper's devices. ``supernodes=k`` prices more lanes within Flower (``units.supernodes``, ``UnitEngine.supernodes``):
each device runs k SuperNodes, micro-batch ``c`` goes to its node ``c mod k``, and each node holds one message at a
time and its own weight blocks and running sums (so weights travel and sums upload once per node and step), over the
device's one set of links and processor.
Micro-batches are independent chains of dependent phases (a phase is issued when the previous phase of
its chain is back, plus the server's own time between phases), processed in order of issue time. ``in_flight``
chains run at once (the scheduler keeps that many micro-batches' messages queued, the engine one thread each);
the next starts when one ends. A device's idle gap is the time its processor waits between two messages.

Churn: a device killed at ``Kill.at_s`` never answers a message whose reply was due after that. The server
notices at the message's deadline, ``issue + deadline_factor * (predicted reply - issue)``, drops the device
from later plans and re-dispatches the lost units, each to the live device with the earliest predicted reply
(first valid result wins; the dead device's late results never come). Bytes are the closed form of
``messages.formula_bytes``. Approximations: messages are booked first come, first served, so a re-dispatched
message queues behind work already booked and a message booked after it with an earlier issue time waits behind it
(on the links and, with ``lanes``, for a lane); a deadline here counts from the issue, so it includes a message's
wait for a lane, while the engine's is a multiple of the message's own predicted time; and a dead device's booked
replies still hold its lanes until the server notices. ``floor_s`` is the overlap floor, which assumes a device's
download, compute and upload overlap (a one-lane device cannot reach it).

Accumulation (``accumulate``, ``fedfusion.units.accumulate``): a weight gradient's tiles upload only with the
step's last micro-batch to reach that phase (the others' replies just list the kept units); the device's FIFO
processor has summed the earlier micro-batches by then. A device that dies holding sums has them recomputed at
the emit on the live device that answers first, every micro-batch's unit (approximation: the emit's own tiles
are planned on the live devices as if their sums matched that plan).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedfusion.units.devices import UnitDevice
from fedfusion.units.engine import PhaseRecord
from fedfusion.units.messages import Spec, formula_bytes
from fedfusion.units.phases import WEIGHT_GRADIENT, Phase
from fedfusion.units.plan import LAYOUTS, CostModel, PhasePlan, Tile, plan_phase


@dataclass(frozen=True)
class Kill:
    """Device ``device`` stops answering at virtual time ``at_s``."""

    device: int
    at_s: float


@dataclass
class StepTiming:
    """What one simulated step cost: time, its physical floor, per-device bytes and busy seconds, churn."""

    step_s: float
    floor_s: float  # max over devices of (downlink bytes time + message overheads, uplink, compute) + phases x latency
    phases_per_chain: int
    down_bytes: np.ndarray
    up_bytes: np.ndarray
    down_busy_s: np.ndarray
    up_busy_s: np.ndarray
    compute_s: np.ndarray
    redispatched: int = 0
    detected: dict[int, float] = field(default_factory=dict)
    phase_deadlines: list[tuple[float, float]] = field(default_factory=list)  # (issue, deadline) of each phase
    idle_gap_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per device: waits between its messages

    @property
    def link_utilisation(self) -> float:
        """Busy fraction of the busiest link over the step."""
        return float(max(self.down_busy_s.max(), self.up_busy_s.max()) / self.step_s) if self.step_s else 0.0

    @property
    def devices_used(self) -> int:
        return int(np.count_nonzero(self.down_bytes))


class _Links:
    """The FIFO resources of every device and what they carried."""

    def __init__(self, devices: list[UnitDevice], lanes: int = 0) -> None:
        n = len(devices)
        self.devices = devices
        self.lanes = lanes  # messages held at once per (device, node)
        self.replies: dict[tuple[int, int], list[float]] = {}  # per (device, node): its booked messages' replies
        self.down_free, self.cpu_free, self.up_free = np.zeros(n), np.zeros(n), np.zeros(n)
        self.down_bytes, self.up_bytes = np.zeros(n), np.zeros(n)
        self.down_busy, self.up_busy, self.compute = np.zeros(n), np.zeros(n), np.zeros(n)
        self.overhead = np.zeros(n)  # per-message fixed costs, serialised with the downlink
        self.messages = np.zeros(n, dtype=np.int64)
        self.idle_gap = np.zeros(n)  # processor seconds waiting between a message's compute and the next's

    def reply_at(self, d: int, t: float, down_b: float, flops: float, up_b: float, book: bool,
                 node: int = 0) -> float:
        """When a message issued at ``t`` to ``node`` of device ``d`` would be back; ``book`` reserves the resources."""
        dev = self.devices[d]
        replies = self.replies.setdefault((d, node), [])
        if self.lanes and len(replies) >= self.lanes:  # waits for a lane's reply to be back
            t = max(t, replies[-self.lanes])
        down_end = max(t, self.down_free[d]) + dev.overhead_s + down_b / dev.down_bps
        comp_start = max(down_end + dev.rtt_s / 2, self.cpu_free[d])
        comp_end = comp_start + flops / dev.flops
        up_end = max(comp_end, self.up_free[d]) + up_b / dev.up_bps
        if book:
            if self.messages[d]:
                self.idle_gap[d] += comp_start - self.cpu_free[d]
            self.messages[d] += 1
            self.down_free[d], self.cpu_free[d], self.up_free[d] = down_end, comp_end, up_end
            self.down_bytes[d] += down_b
            self.up_bytes[d] += up_b
            self.down_busy[d] += down_b / dev.down_bps
            self.up_busy[d] += up_b / dev.up_bps
            self.compute[d] += flops / dev.flops
            self.overhead[d] += dev.overhead_s
            replies.append(float(up_end + dev.rtt_s / 2))
        return float(up_end + dev.rtt_s / 2)


def _reply_with(links: _Links, d: int, t: float, tiles: list[Tile], specs: list[Spec], elem_bytes: int,
                held: set[str] | None, resident: bool, node: int) -> float:
    """When device ``d`` would answer a message with ``tiles`` issued at ``t`` (nothing booked)."""
    down_b, up_b = formula_bytes(tiles, specs, elem_bytes, None if held is None else set(held), resident=resident)
    return links.reply_at(d, t, down_b, sum(u.flops for u in tiles), up_b, book=False, node=node)


def chains_from_trace(trace: list[PhaseRecord]) -> list[list[Phase]]:
    """The engine's recorded phases grouped into micro-batch chains, in order."""
    chains: dict[int, list[Phase]] = {}
    for rec in trace:
        chains.setdefault(rec.chain, []).append((rec.shapes, rec.specs))
    return [chains[c] for c in sorted(chains)]


def simulate(devices: list[UnitDevice], chains: list[list[Phase]], *, elem_bytes: int = 4, server_gap_s: float = 0.0,
             optimizer_s: float = 0.0, kills: tuple[Kill, ...] = (), deadline_factor: float = 3.0,
             layouts: tuple[str, ...] = LAYOUTS, max_groups: int | None = None,
             cache_weights: bool = True, resident_weights: bool = False, in_flight: int = 0,
             accumulate: bool = False, lanes: int = 0, supernodes: int = 0) -> StepTiming:
    """Virtual time of one step whose micro-batches are ``chains``, ``in_flight`` at once (0: all, from time 0); with
    ``cache_weights`` a device receives each weight block once per step (``messages.DeviceRuntime``), with
    ``resident_weights`` never (a frozen base cached on the devices by earlier steps); with ``accumulate`` the
    devices sum weight gradients over the micro-batches and upload each tile once per step; ``lanes``: the messages
    a device holds at once (0: no limit; 1: Flower's SuperNode); ``supernodes``: SuperNodes per device (0: off; see
    the module)."""
    if lanes < 0 or supernodes < 0 or (lanes and supernodes):
        raise ValueError(f"lanes and supernodes must be >= 0 and not both set, got {lanes} and {supernodes}")
    cm = CostModel(devices, elem_bytes)
    links = _Links(devices, 1 if supernodes else lanes)
    kill_at = {k.device: k.at_s for k in kills}
    known_dead: dict[int, float] = {}
    held: dict[tuple[int, int], set[str]] = {}  # (device, node) -> the weight blocks it holds

    def node_of(chain: int) -> int:
        return chain % supernodes if supernodes else 0

    members = Counter(node_of(c) for c in range(len(chains)))  # node -> its micro-batches
    plans: dict[tuple[object, ...], PhasePlan] = {}
    running = len(chains) if in_flight <= 0 else min(in_flight, len(chains))
    heap = [(0.0, c, 0) for c in range(running)]
    ends, redispatched, deadlines = [0.0], 0, []
    reached: dict[tuple[int, int], int] = {}  # accumulate: (phase position, node) -> micro-batches that reached it
    holders: dict[tuple[int, int], dict[int, list[Tile]]] = {}  # accumulate: (position, node) -> device -> its sums
    while heap:
        t, c, p = heapq.heappop(heap)
        shapes, specs = chains[c][p]
        node = node_of(c)
        summed = accumulate and members[node] > 1 and WEIGHT_GRADIENT in specs
        emit = False
        if summed:
            reached[p, node] = reached.get((p, node), 0) + 1
            emit = reached[p, node] == members[node]
        live = tuple(d for d in range(len(devices)) if known_dead.get(d, np.inf) > t)
        key = (tuple(shapes), live)
        if key not in plans:
            plans[key] = plan_phase(cm, list(live), shapes, layouts, max_groups)
        work: list[tuple[float, int, list[Tile]]] = []  # (issue time, device, tiles)
        by_dev: dict[int, list[Tile]] = {}
        for tile in plans[key].tiles:
            by_dev.setdefault(tile.device, []).append(tile)
        work = [(t, d, tl) for d, tl in by_dev.items()]
        if summed and not emit:
            for d, tl in by_dev.items():
                holders.setdefault((p, node), {}).setdefault(d, [x for x in tl if specs[x.gemm] == WEIGHT_GRADIENT])
        done, phase_deadline = t, t
        if emit:  # the sums of devices known dead: every micro-batch's unit on the live device that answers first
            for d, lost in holders.get((p, node), {}).items():
                if known_dead.get(d, np.inf) <= t and lost:
                    alive = [x for x in range(len(devices)) if known_dead.get(x, np.inf) > t]
                    down_b, up_b = formula_bytes(lost, specs, elem_bytes, resident=resident_weights)
                    flops = float(sum(x.flops for x in lost))
                    n = members[node]
                    best = min(alive, key=lambda x: links.reply_at(x, t, n * down_b, n * flops, n * up_b, book=False,
                                                                    node=node))
                    done = max(done, links.reply_at(best, t, n * down_b, n * flops, n * up_b, book=True, node=node))
                    redispatched += n * len(lost)
        while work:
            issue, d, tiles = work.pop(0)
            sums = {i: emit for i, x in enumerate(tiles) if specs[x.gemm] == WEIGHT_GRADIENT} if summed else None
            down_b, up_b = formula_bytes(tiles, specs, elem_bytes,
                                         held.setdefault((d, node), set()) if cache_weights else None,
                                         resident=resident_weights, sums=sums)
            reply = links.reply_at(d, issue, down_b, sum(x.flops for x in tiles), up_b, book=True, node=node)
            deadline = issue + deadline_factor * (reply - issue)
            phase_deadline = max(phase_deadline, deadline)
            if kill_at.get(d, np.inf) >= reply:
                done = max(done, reply)
                continue
            known_dead[d] = min(known_dead.get(d, np.inf), deadline)
            redispatched += len(tiles)
            alive = [x for x in range(len(devices)) if known_dead.get(x, np.inf) > deadline and x != d]
            if not alive:
                raise RuntimeError("every device is gone")
            moved: dict[int, list[Tile]] = {}
            for tile in tiles:  # each lost unit to the device that would answer first, counting what it got already
                best = min(alive, key=lambda x: _reply_with(
                    links, x, deadline, moved.get(x, []) + [tile], specs, elem_bytes,
                    held.get((x, node), set()) if cache_weights else None, resident_weights, node))
                moved.setdefault(best, []).append(tile)
            work += [(deadline, x, tl) for x, tl in moved.items()]
        deadlines.append((t, phase_deadline))
        if p + 1 < len(chains[c]):
            heapq.heappush(heap, (done + server_gap_s, c, p + 1))
        else:
            ends.append(done)
            if running < len(chains):  # the next micro-batch takes the finished one's place
                heapq.heappush(heap, (done + server_gap_s, running, 0))
                running += 1
    step = max(ends) + optimizer_s
    rtt = min(dev.rtt_s + dev.overhead_s for dev in devices)
    phases = max(len(ch) for ch in chains)
    busy = np.maximum(np.maximum(links.down_busy + links.overhead, links.up_busy), links.compute)
    return StepTiming(step, float(busy.max()) + phases * rtt, phases, links.down_bytes, links.up_bytes,
                      links.down_busy, links.up_busy, links.compute, redispatched, known_dead, deadlines,
                      links.idle_gap)


def choose_micro_batches(devices: list[UnitDevice], phases_for: Callable[[int], list[Phase]], batch_size: int, *,
                         target_utilisation: float = 0.7,
                         kwargs_for: Callable[[int], dict[str, Any]] | None = None, min_count: int = 1,
                         **kwargs: Any) -> tuple[int, dict[int, StepTiming]]:
    """The micro-batch count for a step, predicted with ``simulate`` (``kwargs`` pass through, with
    ``kwargs_for(m)``'s added for count ``m``: e.g. the server's time between phases, which grows with the count):
    among the divisors of ``batch_size`` from ``min_count`` on (k SuperNodes per device need k micro-batches to keep
    each node busy), the smallest whose busiest-link utilisation reaches ``target_utilisation`` without a slower step
    than the smallest divisor's; else the one with the shortest step (ties: the smaller count).
    ``phases_for(m)`` is one micro-batch's phase list when the batch is cut into ``m``. Returns the count and every
    count's timing, so a setting that reaches no count at the target stays visible as such (latency-bound: a chain's
    phases x (RTT + overhead) exceed what the links carry)."""
    counts = [m for m in range(max(1, min_count), batch_size + 1) if batch_size % m == 0]
    if not counts:
        raise ValueError(f"no divisor of batch size {batch_size} is at least {min_count}")
    timings = {m: simulate(devices, [phases_for(m)] * m, **kwargs, **(kwargs_for(m) if kwargs_for else {}))
               for m in counts}
    one = timings[counts[0]].step_s
    ok = [m for m in counts if timings[m].link_utilisation >= target_utilisation and timings[m].step_s <= one]
    return (ok[0] if ok else min(counts, key=lambda m: (timings[m].step_s, m))), timings
