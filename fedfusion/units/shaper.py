"""Links emulated for real: when a message would be through a device's link, on the real clock.

The timeline (``fedfusion.units.timeline``) predicts a step from each device's link rates and latency; a run on
loopback moves the same bytes in microseconds. :class:`Shaper` holds, per device, its downlink and uplink as FIFO
queues (and the server's send and receive links, shared by every device: the timeline's own
:class:`~fedfusion.units.timeline.ServerQueue`), books each real message on them when it is ready and says when it
is through; the transport (``fedfusion.strategies.transport.GridTransport``) sleeps until then before it hands a
message on to the node or accepts a node's reply. The arithmetic is the timeline's
(``timeline._Links.reply_at``):

    down: starts at s = max(ready, downlink free); its bytes pass the server's send link (its first idle stretch from s on) and the
          device's downlink (bytes / down_bps from s) at once; it is through when both are (the downlink is free
          again then) and arrives rtt / 2 later
    up:   starts at u = max(ready, uplink free); the device's uplink (bytes / up_bps from u) and the server's
          receive link at once; accepted rtt / 2 after both are through

What it leaves to the real run: a message's fixed cost (``UnitDevice.overhead_s``: the real serialisation, Flower's
queues and the node's polling are real), the devices' compute (the node computes on this machine), and the order in
which a device takes its messages (a SuperNode's own). No Flower here; the clock and the sleep are parameters so a
test can run it on a fake clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fedfusion.units.devices import UnitDevice, UnitServer
from fedfusion.units.timeline import ServerQueue


@dataclass
class LinkQueue:
    """One device's link, FIFO: ``bps`` bytes/s (0: unlimited) and the time it is free again."""

    bps: float
    free: float = float("-inf")

    def through(self, ready: float, nbytes: int) -> float:
        """When ``nbytes`` that are ready at ``ready`` have passed the link (nothing booked)."""
        return max(ready, self.free) + (nbytes / self.bps if self.bps else 0.0)


class Shaper:
    """Every device's downlink and uplink and the server's two links on one clock (``clock``: seconds, monotonic).
    :meth:`down` and :meth:`up` book a message and return when it arrives; :meth:`wait` sleeps until a time.
    Thread-safe: micro-batches in flight book from their own threads."""

    def __init__(self, devices: list[UnitDevice], server: UnitServer, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], object] = time.sleep) -> None:
        self.devices = devices
        self.downlinks = [LinkQueue(d.down_bps) for d in devices]
        self.uplinks = [LinkQueue(d.up_bps) for d in devices]
        self.server = server
        self.send, self.recv = ServerQueue(), ServerQueue()
        self.clock, self.sleep = clock, sleep
        self._lock = threading.Lock()

    def down(self, device: int, nbytes: int, ready: float | None = None) -> float:
        """Book a message of ``nbytes`` from the server to ``device``, ready at ``ready`` (default: now); when it
        arrives at the device."""
        return self._book(self.downlinks[device], self.send, self.server.send_bps, device, nbytes, ready)

    def up(self, device: int, nbytes: int, ready: float | None = None) -> float:
        """Book a reply of ``nbytes`` from ``device`` to the server, ready at ``ready`` (default: now); when the
        server has it."""
        return self._book(self.uplinks[device], self.recv, self.server.recv_bps, device, nbytes, ready)

    def _book(self, link: LinkQueue, shared: ServerQueue, shared_bps: float, device: int, nbytes: int,
              ready: float | None) -> float:
        with self._lock:
            start = max(self.clock() if ready is None else ready, link.free)
            through_server = shared.book(start, nbytes / shared_bps if shared_bps else 0.0)
            link.free = max(link.through(start, nbytes), through_server)
            return link.free + self.devices[device].rtt_s / 2

    def wait(self, until: float) -> None:
        """Sleep until the clock reaches ``until`` (at once when it has)."""
        left = until - self.clock()
        if left > 0:
            self.sleep(left)
