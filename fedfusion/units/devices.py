"""What the unit planner needs to know about one device: memory, speed, links, latency, availability.

Plain numbers in SI units (bytes, FLOP/s, bytes/s, seconds) so the planner and the timeline never depend on the
catalog's format; ``from_catalog`` is the one adapter from ``fedfusion.devices.catalog.Device`` (easy to re-point).
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
                 memory_share: float = 1.0) -> UnitDevice:
    """A ``UnitDevice`` from a catalog tier (``fedfusion.devices.catalog.Device``: GB, TFLOP/s, Mbit/s)."""
    return UnitDevice(name=name or tier.name, memory_bytes=tier.memory_gb * 1e9 * memory_share,
                      flops=tier.tflops * 1e12, down_bps=tier.down_mbps * 1e6 / 8, up_bps=tier.up_mbps * 1e6 / 8,
                      rtt_s=rtt_s, overhead_s=overhead_s)
