"""Energy and carbon of counted work: virtual seconds, joules drawn from the wall and grams of CO2e.

Simulated clients do not run on the devices they stand for, so their time and energy are priced from
counted work (training FLOPs, bytes moved) at the catalog's rates rather than measured. Following the
edge-vs-cloud debate (seed paper vs Patterson et al.), chargers and power supplies lose energy before
the device sees it, the grid zone sets operational carbon, and manufacturing (embodied) carbon is
charged by the share of the device's lifetime the work keeps it busy. What a host's own meters measure is
:mod:`fedfusion.devices.meters`' concern, reported next to these prices, never in their place.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fedfusion.devices.catalog import Device

# Yearly average carbon intensity of grid electricity in 2023, gCO2e per kWh (national averages, WORLD the
# global one); callers may pass their own table as ``grid``.
GRID_G_PER_KWH: dict[str, float] = {
    "USA": 369.5, "GBR": 237.6, "DEU": 381.0, "FRA": 56.0, "IND": 713.4,
    "CHN": 582.3, "POL": 661.9, "SWE": 40.7, "NOR": 30.1, "WORLD": 475.0,
}

_J_PER_KWH = 3.6e6
_S_PER_YEAR = 365.25 * 24 * 3600


def train_flops(params: int, tokens: int) -> float:
    """Training FLOPs: 6 per parameter per token (2 forward, 4 backward)."""
    return 6.0 * params * tokens


def frozen_work_params(base_params: int, adapter_params: int) -> int:
    """The parameter count whose :func:`train_flops` price training on a frozen base (a LoRA client's adapters, a
    full-forward window of the target): the frozen base costs its forward and the activations' gradients (2 of
    the 3 thirds), the trained part all of it."""
    return base_params * 2 // 3 + adapter_params


@dataclass(frozen=True)
class WorkCost:
    """What one piece of work costs on one device: seconds, joules and grams of CO2e."""

    compute_s: float
    comm_s: float
    compute_j: float
    radio_j: float
    idle_j: float
    wall_j: float  # device joules / charger (or PSU) efficiency
    co2_operational_g: float
    co2_embodied_g: float
    co2_g: float

    @property
    def virtual_s(self) -> float:
        """Simulated duration: computing plus transferring (idle waiting is not work)."""
        return self.compute_s + self.comm_s

    def ledger(self, wasted: bool) -> dict[str, float]:
        """The energy fields of a clients.jsonl row (``wasted``: the work bought nothing)."""
        return {"virtual_s": self.virtual_s, "compute_s": self.compute_s, "comm_s": self.comm_s,
                "energy_j": self.wall_j, "co2_g": self.co2_g, "co2_operational_g": self.co2_operational_g,
                "co2_embodied_g": self.co2_embodied_g, "wasted": wasted}

    @property
    def compute_wall_j(self) -> float:
        """The share of ``wall_j`` drawn for computing (charger losses split in proportion)."""
        return self._wall_share(self.compute_j)

    @property
    def radio_wall_j(self) -> float:
        """The share of ``wall_j`` drawn for transfers (charger losses split in proportion)."""
        return self._wall_share(self.radio_j)

    def _wall_share(self, device_j: float) -> float:
        total = self.compute_j + self.radio_j + self.idle_j
        return self.wall_j * device_j / total if total else 0.0

    def to_dict(self) -> dict[str, float]:
        """All fields plus ``virtual_s``, for ledgers and JSON."""
        return {**asdict(self), "virtual_s": self.virtual_s}


# How much slower than torch a tier trains through each runtime: the ExecuTorch runtime's measured steps/s against
# eager torch's on the same program and batches (benchmarks/results/device_runtime.md, quickstart phone tier:
# 1.90 against 9.08 steps/s). A catalog tier with ``runtime: executorch`` is priced at this speed.
RUNTIME_SLOWDOWN = {"torch": 1.0, "executorch": 9.08 / 1.90}


def runtime_notes(catalog: dict[str, Device], tiers: list[str]) -> list[str]:
    """One line per tier of ``tiers`` that trains through a runtime slower than torch, saying how it is priced."""
    return [f"{tier}: trains through the {catalog[tier].runtime} runtime, priced at its measured speed, "
            f"{RUNTIME_SLOWDOWN[catalog[tier].runtime]:.1f}x torch's step time "
            "(benchmarks/results/device_runtime.md, the phone tier's program)"
            for tier in tiers if tier in catalog and RUNTIME_SLOWDOWN[catalog[tier].runtime] != 1.0]


def price_work(
    device: Device,
    flops: float,
    bytes_down: int,
    bytes_up: int,
    zone: str | None = None,
    charger_efficiency: float = 0.85,
    idle_s: float = 0.0,
    grid: dict[str, float] | None = None,
    compute_s: float | None = None,
) -> WorkCost:
    """Price ``flops`` of training and a download/upload on ``device``.

    Compute runs at the catalog's sustained TFLOPS (divided by :data:`RUNTIME_SLOWDOWN` of the device's runtime)
    and training watts (``compute_s``: the seconds the device itself measured for that work, used as they are), transfers
    at its link rates and
    radio watts, ``idle_s`` at idle watts. Wall joules divide the device's joules by
    ``charger_efficiency`` (for mains and cloud tiers, read it as power-supply efficiency). Operational
    carbon uses the intensity of ``zone`` (default: the device's zone) in ``grid`` (default
    :data:`GRID_G_PER_KWH`); embodied carbon is ``embodied_kg`` times busy seconds over lifetime seconds.
    """
    if not 0 < charger_efficiency <= 1:
        raise ValueError(f"charger_efficiency must be in (0, 1], got {charger_efficiency}")
    if min(flops, bytes_down, bytes_up, idle_s) < 0:
        raise ValueError("flops, bytes_down, bytes_up and idle_s must be non-negative")
    table = GRID_G_PER_KWH if grid is None else grid
    where = zone or device.zone
    if where not in table:
        raise ValueError(f"unknown grid zone {where!r}; known zones: {', '.join(sorted(table))}")
    if compute_s is None:
        compute_s = flops / (device.tflops * 1e12) * RUNTIME_SLOWDOWN[device.runtime]
    elif not compute_s >= 0:
        raise ValueError(f"compute_s must be a number >= 0, got {compute_s}")
    comm_s = bytes_down * 8 / (device.down_mbps * 1e6) + bytes_up * 8 / (device.up_mbps * 1e6)
    compute_j = compute_s * device.train_w
    radio_j = comm_s * device.radio_w
    idle_j = idle_s * device.idle_w
    wall_j = (compute_j + radio_j + idle_j) / charger_efficiency
    operational = wall_j / _J_PER_KWH * table[where]
    embodied = device.embodied_kg * 1000 * (compute_s + comm_s) / (device.lifetime_years * _S_PER_YEAR)
    return WorkCost(
        compute_s=compute_s, comm_s=comm_s, compute_j=compute_j, radio_j=radio_j, idle_j=idle_j,
        wall_j=wall_j, co2_operational_g=operational, co2_embodied_g=embodied, co2_g=operational + embodied,
    )


def round_wall_time(costs: list[WorkCost]) -> float:
    """Simulated seconds one synchronous round takes: its slowest client's (0 for no clients)."""
    return max((c.virtual_s for c in costs), default=0.0)
