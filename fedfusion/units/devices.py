"""What the unit planner needs to know about one device (memory, speed, links, latency, availability) and what the
timeline needs to know about the parameter server (its links).

Plain numbers in SI units (bytes, FLOP/s, bytes/s, seconds) so the planner and the timeline never depend on the
catalog's format; ``from_catalog`` and ``server_from_catalog`` are the adapters from
``fedfusion.devices.catalog.Device`` (easy to re-point).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class UnitDevice:
    """One worker of the units mode.

    ``flops`` is the sustained GEMM rate (FLOP/s), ``down_bps``/``up_bps`` the link rates in bytes/s as seen from
    the device (down = server to device), ``rtt_s`` the round-trip latency of one message, ``overhead_s`` the
    fixed cost of one message (encode, dispatch, process start), ``memory_bytes`` what its units may occupy and
    ``availability`` the chance it is online when a step starts (used by churn experiments, not by the planner).
    """

    name: str
    memory_bytes: float
    flops: float
    down_bps: float
    up_bps: float
    rtt_s: float = 0.05
    overhead_s: float = 0.005
    availability: float = 1.0

    def __post_init__(self) -> None:
        for field in ("memory_bytes", "flops", "down_bps", "up_bps"):
            if not getattr(self, field) > 0:
                raise ValueError(f"device {self.name!r}: {field} must be positive")
        if self.rtt_s < 0 or self.overhead_s < 0 or not 0 <= self.availability <= 1:
            raise ValueError(f"device {self.name!r}: rtt_s, overhead_s >= 0 and availability in [0, 1]")


def from_catalog(tier: Any, *, name: str | None = None, rtt_s: float = 0.05, overhead_s: float = 0.005,
                 memory_share: float = 1.0, link_scale: float = 1.0) -> UnitDevice:
    """A ``UnitDevice`` from a catalog tier (``fedfusion.devices.catalog.Device``: GB, TFLOP/s, Mbit/s), its link
    rates times ``link_scale`` (``units.link_scale``)."""
    return UnitDevice(name=name or tier.name, memory_bytes=tier.memory_gb * 1e9 * memory_share,
                      flops=tier.tflops * 1e12, down_bps=tier.down_mbps * 1e6 / 8 * link_scale,
                      up_bps=tier.up_mbps * 1e6 / 8 * link_scale, rtt_s=rtt_s, overhead_s=overhead_s)


@dataclass(frozen=True)
class UnitServer:
    """The parameter server's links as the timeline queues them: ``send_bps`` carries every message's download,
    ``recv_bps`` every reply's upload (bytes/s; 0: unlimited, an infinitely fast server). The default is a 10 Gb/s
    datacenter link each way, the catalog's cloud tiers' (``cloud-a100``, ``units.server_device``'s default). The
    server's compute reaches the timeline as seconds (``ledger.server_timeline``, priced on its catalog tier)."""

    name: str = "10 Gb/s server"
    send_bps: float = 10e9 / 8
    recv_bps: float = 10e9 / 8

    def __post_init__(self) -> None:
        if self.send_bps < 0 or self.recv_bps < 0:
            raise ValueError(f"server {self.name!r}: send_bps and recv_bps must be >= 0 (0: unlimited)")


DEFAULT_SERVER = UnitServer()
UNLIMITED_SERVER = UnitServer("unlimited server", 0.0, 0.0)  # links that never queue: the devices' links alone


def server_from_catalog(tier: Any) -> UnitServer:
    """A ``UnitServer`` from a catalog tier (``units.server_device``): it sends at its up rate, receives at its down
    rate (Mbit/s), as ``ledger.price_server`` prices its traffic."""
    return UnitServer(name=tier.name, send_bps=tier.up_mbps * 1e6 / 8, recv_bps=tier.down_mbps * 1e6 / 8)
