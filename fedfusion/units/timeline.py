"""Virtual time of a step in the units mode: emulated links, the server's links and compute, several micro-batches in
flight, devices that die.

Each device has three FIFO resources: its downlink, its processor and its uplink; the parameter server has three
shared ones: its send link, its receive link (``UnitServer``: every device's messages pass them) and its processor.
A message issued at time ``t``

    down:    starts at s = max(t, downlink free); its bytes pass the server's send link (bytes_down / send_bps, in
             that link's first idle stretch from s on) and the device's downlink (overhead + bytes_down / down_bps
             from s) at once, so it is down when both are through; then rtt / 2 to arrive
    compute: starts at max(arrival, processor free), takes flops / flops_rate
    up:      starts at u = max(compute end, uplink free), its bytes pass the device's uplink (bytes_up / up_bps from
             u) and the server's receive link (bytes_up / recv_bps, its first idle stretch from u on); rtt / 2 back

so a device can receive micro-batch 2's operands while it computes micro-batch 1's and sends back micro-batch
0's (that needs a device runtime that takes its next message while it works on the current one), and a step's
downloads and uploads, every device's together, take at least their bytes over the server's links (the 168M target
on 1,024 laptops: 59 GB down a step, ~47 s at 10 Gb/s). The server's own compute between two phases of a chain
(``server_gap_s``: its attention, norms, sums and checks) runs on its processor, in its first idle stretch from the
phase's end on, and the optimizer after the last phase. The server's queues fill idle stretches (a transfer booked
later but ready earlier takes an earlier gap); the devices' are FIFO in the order messages are booked.

``lanes`` caps the messages a device holds at once: a message cannot start its download before the reply of the
message ``lanes`` before it on that device is back. ``lanes=1`` is the order of Flower 1.42's SuperNode: it pulls a
message, runs the ClientApp, sends the reply and only then pulls the next, so its downlink, processor and uplink
never overlap. Only the order: the model charges one ``rtt`` and ``overhead_s`` per message, while a deployed
SuperNode makes several calls per message, polls its ClientApp every 0.5 s and sleeps 3 s after a pull that finds
nothing (the simulation engine, for its part, may run two of a node's messages at once); ``lanes=0`` (no limit, the
default) is a runtime that prefetches, the seed paper's devices. ``supernodes=k`` prices more lanes within Flower
(``units.supernodes``, ``UnitEngine.supernodes``): each device runs k SuperNodes, micro-batch ``c`` goes to its node
``c mod k``, and each node holds one message at a time and its own weight blocks and running sums (so weights travel
and sums upload once per node and step), over the device's one set of links and processor.
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
replies still hold its lanes until the server notices.

``lower_bound_s`` is what no schedule of the step's messages can beat under this model (without churn): the
optimizer's time plus the largest of every resource's busy time (a device's downlink with its messages' overheads,
its uplink, its processor; a lane's messages end to end, each at least overhead + rtt + its transfers and compute,
over the lanes; the server's links and processor) and the chains' critical path (each phase at least the least
rtt + overhead of any device, the server's time between phases, ``in_flight`` chains at a time).

Accumulation (``accumulate``, ``fedfusion.units.accumulate``): a weight gradient's tiles upload only with the
step's last micro-batch to reach that phase (the others' replies just list the kept units); the device's FIFO
processor has summed the earlier micro-batches by then. A device that dies holding sums has them recomputed at
the emit on the live device that answers first, every micro-batch's unit (approximation: the emit's own tiles
are planned on the live devices as if their sums matched that plan).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedfusion.units.devices import DEFAULT_SERVER, UnitDevice, UnitServer
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
    """What one simulated step cost: time, its lower bound and what sets it, per-device bytes and busy seconds, the
    server's busy seconds, churn."""

    step_s: float
    lower_bound_s: float  # no schedule beats it under the model (the module's docstring); churn off
    bound_by: str  # the resource or path that sets lower_bound_s
    phases_per_chain: int
    down_bytes: np.ndarray
    up_bytes: np.ndarray
    down_busy_s: np.ndarray
    up_busy_s: np.ndarray
    compute_s: np.ndarray
    server_send_busy_s: float
    server_recv_busy_s: float
    server_compute_s: float  # its time between phases and the optimizer
    redispatched: int = 0
    detected: dict[int, float] = field(default_factory=dict)
    phase_deadlines: list[tuple[float, float]] = field(default_factory=list)  # (issue, deadline) of each phase
    idle_gap_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per device: waits between its messages

    @property
    def link_utilisation(self) -> float:
        """Busy fraction of the busiest link over the step, the server's included."""
        busiest = max(self.down_busy_s.max(), self.up_busy_s.max(), self.server_send_busy_s, self.server_recv_busy_s)
        return float(busiest / self.step_s) if self.step_s else 0.0

    @property
    def server_link_utilisation(self) -> float:
        """Busy fraction of the server's busier link over the step."""
        return max(self.server_send_busy_s, self.server_recv_busy_s) / self.step_s if self.step_s else 0.0

    @property
    def step_over_bound(self) -> float:
        """How far the step is from what no schedule can beat (>= 1)."""
        return self.step_s / self.lower_bound_s if self.lower_bound_s else 1.0

    @property
    def devices_used(self) -> int:
        return int(np.count_nonzero(self.down_bytes))


class ServerQueue:
    """A shared resource of the server (a link or its processor): its busy stretches, sorted and merged; a job takes
    the first idle stretch at or after its ready time that holds it (the shaper books the server's links on it too,
    :mod:`fedfusion.units.shaper`)."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.busy = 0.0

    def slot(self, ready: float, seconds: float) -> float:
        """When a job of ``seconds`` ready at ``ready`` would end (nothing booked)."""
        if seconds <= 0:
            return ready
        i, start = bisect.bisect_right(self.ends, ready), ready
        while i < len(self.starts) and start + seconds > self.starts[i]:
            start = max(start, self.ends[i])
            i += 1
        return start + seconds

    def book(self, ready: float, seconds: float) -> float:
        """Reserve the job's stretch; returns its end."""
        end = self.slot(ready, seconds)
        if seconds <= 0:
            return end
        start, self.busy = end - seconds, self.busy + seconds
        i = bisect.bisect_left(self.starts, start)
        if i and self.ends[i - 1] >= start:  # touches the stretch before: extend it
            i -= 1
            self.ends[i] = end
        else:
            self.starts.insert(i, start)
            self.ends.insert(i, end)
        if i + 1 < len(self.starts) and self.starts[i + 1] <= self.ends[i]:  # and the one after: merge
            self.ends[i] = self.ends.pop(i + 1)
            self.starts.pop(i + 1)
        return end


class _Links:
    """The FIFO resources of every device, the server's shared links, and what they carried."""

    def __init__(self, devices: list[UnitDevice], server: UnitServer, lanes: int = 0) -> None:
        n = len(devices)
        self.devices, self.server = devices, server
        self.lanes = lanes  # messages held at once per (device, node)
        self.replies: dict[tuple[int, int], list[float]] = {}  # per (device, node): its booked messages' replies
        self.lane_hold: dict[tuple[int, int], float] = {}  # per (device, node): its messages' least time held
        self.send, self.recv = ServerQueue(), ServerQueue()
        self.down_free, self.cpu_free, self.up_free = np.zeros(n), np.zeros(n), np.zeros(n)
        self.down_bytes, self.up_bytes = np.zeros(n), np.zeros(n)
        self.down_busy, self.up_busy, self.compute = np.zeros(n), np.zeros(n), np.zeros(n)
        self.overhead = np.zeros(n)  # per-message fixed costs, serialised with the downlink
        self.messages = np.zeros(n, dtype=np.int64)
        self.idle_gap = np.zeros(n)  # processor seconds waiting between a message's compute and the next's

    def reply_at(self, d: int, t: float, down_b: float, flops: float, up_b: float, book: bool,
                 node: int = 0) -> float:
        """When a message issued at ``t`` to ``node`` of device ``d`` would be back; ``book`` reserves the resources."""
        dev, server = self.devices[d], self.server
        replies = self.replies.setdefault((d, node), [])
        if self.lanes and len(replies) >= self.lanes:  # waits for a lane's reply to be back
            t = max(t, replies[-self.lanes])
        send_s = down_b / server.send_bps if server.send_bps else 0.0
        recv_s = up_b / server.recv_bps if server.recv_bps else 0.0
        down_start = max(t, self.down_free[d])
        sent = (self.send.book if book else self.send.slot)(down_start, send_s)
        down_end = max(down_start + dev.overhead_s + down_b / dev.down_bps, sent)
        comp_start = max(down_end + dev.rtt_s / 2, self.cpu_free[d])
        comp_end = comp_start + flops / dev.flops
        up_start = max(comp_end, self.up_free[d])
        received = (self.recv.book if book else self.recv.slot)(up_start, recv_s)
        up_end = max(up_start + up_b / dev.up_bps, received)
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
            self.lane_hold[d, node] = self.lane_hold.get((d, node), 0.0) + (
                dev.overhead_s + dev.rtt_s + down_b / dev.down_bps + flops / dev.flops + up_b / dev.up_bps)
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
             accumulate: bool = False, lanes: int = 0, supernodes: int = 0,
             server: UnitServer = DEFAULT_SERVER) -> StepTiming:
    """Virtual time of one step whose micro-batches are ``chains``, ``in_flight`` at once (0: all, from time 0), through
    ``server``'s links (default: 10 Gb/s each way; ``UNLIMITED_SERVER``: the devices' links alone), with
    ``server_gap_s`` of the server's compute between a chain's phases and ``optimizer_s`` after the last; with
    ``cache_weights`` a device receives each weight block once per step (``messages.DeviceRuntime``), with
    ``resident_weights`` never (a frozen base cached on the devices by earlier steps); with ``accumulate`` the
    devices sum weight gradients over the micro-batches and upload each tile once per step; ``lanes``: the messages
    a device holds at once (0: no limit; 1: Flower's SuperNode); ``supernodes``: SuperNodes per device (0: off; see
    the module)."""
    if lanes < 0 or supernodes < 0 or (lanes and supernodes):
        raise ValueError(f"lanes and supernodes must be >= 0 and not both set, got {lanes} and {supernodes}")
    cm = CostModel(devices, elem_bytes)
    links = _Links(devices, server, 1 if supernodes else lanes)
    cpu = ServerQueue()  # the server's processor: its time between phases
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
            heapq.heappush(heap, (cpu.book(done, server_gap_s), c, p + 1))
        else:
            ends.append(done)
            if running < len(chains):  # the next micro-batch takes the finished one's place
                heapq.heappush(heap, (cpu.book(done, server_gap_s), running, 0))
                running += 1
    bound, by = _lower_bound(links, cpu.busy, chains, in_flight, server_gap_s)
    return StepTiming(max(ends) + optimizer_s, bound + optimizer_s, by, max(len(ch) for ch in chains),
                      links.down_bytes, links.up_bytes, links.down_busy, links.up_busy, links.compute,
                      links.send.busy, links.recv.busy, cpu.busy + optimizer_s, redispatched, known_dead, deadlines,
                      links.idle_gap)


def _lower_bound(links: _Links, server_cpu_s: float, chains: list[list[Phase]], in_flight: int,
                 server_gap_s: float) -> tuple[float, str]:
    """The step's lower bound before the optimizer and what sets it: the busiest resource (every booked use of a
    resource ends before the last reply) or the chains' critical path (each phase at least the least rtt +
    overhead, the server's time between a chain's phases, ``in_flight`` chains at a time, one after another)."""
    latency = min(dev.rtt_s + dev.overhead_s for dev in links.devices)
    lengths = sorted(len(ch) * latency + (len(ch) - 1) * server_gap_s for ch in chains)
    running = len(chains) if in_flight <= 0 else min(in_flight, len(chains))
    waves = math.ceil(len(chains) / running)  # some chain slot runs at least this many chains in turn
    candidates = [(lengths[-1], "latency"), (waves * lengths[0] + (waves - 1) * server_gap_s, "latency"),
                  (links.send.busy, "server send link"), (links.recv.busy, "server receive link"),
                  (server_cpu_s, "server compute")]
    for name, busy in (("downlink", links.down_busy + links.overhead), ("uplink", links.up_busy),
                       ("compute", links.compute)):
        d = int(np.argmax(busy))
        candidates.append((float(busy[d]), f"device {d} {name}"))
    if links.lanes:
        for (d, node), hold in links.lane_hold.items():
            candidates.append((hold / links.lanes, f"device {d} lanes" + (f" (node {node})" if node else "")))
    return max(candidates, key=lambda x: x[0])


def choose_micro_batches(devices: list[UnitDevice], phases_for: Callable[[int], list[Phase]], batch_size: int, *,
                         target_utilisation: float = 0.7,
                         kwargs_for: Callable[[int], dict[str, Any]] | None = None, min_count: int = 1,
                         **kwargs: Any) -> tuple[int, dict[int, StepTiming]]:
    """The micro-batch count for a step, predicted with ``simulate`` (``kwargs`` pass through, with
    ``kwargs_for(m)``'s added for count ``m``: e.g. the server's time between phases, which grows with the count):
    among the divisors of ``batch_size`` from ``min_count`` on (k SuperNodes per device need k micro-batches to keep
    each node busy), the smallest whose busiest-link utilisation (the server's links included) reaches
    ``target_utilisation`` without a slower step than the smallest divisor's; else the one with the shortest step
    (ties: the smaller count).
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
