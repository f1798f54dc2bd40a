"""Edge vs cloud: the same training work priced on the recipe's edge population and on a cloud GPU.

The seed papers claim idle edge devices train with 1.5-4x less energy and 3.5-8x less carbon than a
cloud GPU once embodied carbon counts; critics (Patterson et al.) answer that chargers, radios and
stragglers erase the gain. This module lets a user check the claim for their own federation: it
prices counted work with :func:`fedfusion.energy.price_work` on both sides and shows how the answer
moves with device lifetime and grid intensity.

Assumptions (each is a parameter of :func:`edge_vs_cloud`, and :func:`assumptions` prints them):

- **Same work.** The cloud trains the FLOPs the edge clients completed usefully (``useful_flops``,
  default: all), on one cloud GPU at the catalog's sustained TFLOPS; the edge side also pays for
  wasted work (failed, dropped, rejected clients), its transfers (model down and up, at the catalog's
  link rates and radio watts) and idle waiting.
- **Overheads.** Edge wall energy divides device joules by ``charger_efficiency``; the cloud multiplies
  GPU-and-host joules by the datacenter ``pue`` (passed to ``price_work`` as efficiency 1/PUE).
- **Data.** By default the cloud already holds the training data; ``data_upload_bytes`` charges the
  edge devices' radios for uploading it (split across tiers by their share of the work).
- **Carbon.** Operational: wall kWh x grid intensity of the device's zone (the cloud's own zone for the
  cloud). Embodied: the device's lifecycle kgCO2e x busy seconds / lifetime seconds (a device is charged
  only for the time the work keeps it busy, i.e. full utilisation of its life is assumed on both
  sides); ``edge_embodied_share`` scales the edge part (0: the devices exist anyway, the seed paper's
  argument; 1: charge them in full, the default).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from fedfusion.devices import Device, load_catalog
from fedfusion.energy import GRID_G_PER_KWH, WorkCost, price_work, train_flops

_J_PER_KWH = 3.6e6
LIFETIMES_Y = (1.0, 2.0, 3.0, 5.0)
GRIDS_G_PER_KWH = (30.0, 100.0, 250.0, 475.0, 700.0)


@dataclass(frozen=True)
class TierWork:
    """Work one edge tier did (or would do): training FLOPs, bytes moved, idle seconds waiting.

    ``useful_flops`` is the part that reached the model (default: all of ``flops``)."""

    tier: str
    flops: float
    bytes_down: float = 0.0
    bytes_up: float = 0.0
    idle_s: float = 0.0
    useful_flops: float | None = None
    zone: str | None = None

    def __post_init__(self) -> None:
        for name in ("flops", "bytes_down", "bytes_up", "idle_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"work of tier {self.tier!r}: {name} must be >= 0, got {getattr(self, name)}")
        if self.useful_flops is not None and not 0 <= self.useful_flops <= self.flops:
            raise ValueError(f"work of tier {self.tier!r}: useful_flops must be in [0, flops], got {self.useful_flops}")

    @property
    def useful(self) -> float:
        return self.flops if self.useful_flops is None else self.useful_flops


def work_from_clients(rows: Iterable[Mapping[str, Any]]) -> list[TierWork]:
    """Per-tier work from clients.jsonl rows (``device``, ``params``, ``tokens``, ``bytes_down``,
    ``bytes_up``, ``status``), charged as the run's ledger does: every client its planned training and
    download, uploads only for replies that arrived (ok, rejected); only ok clients' FLOPs are useful."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for row in rows:
        try:
            tier, flops, status = str(row["device"]), train_flops(int(row["params"]), int(row["tokens"])), row["status"]
            a = acc[tier]
            a[0] += flops
            a[1] += flops if status == "ok" else 0.0
            a[2] += float(row["bytes_down"])
            a[3] += float(row["bytes_up"]) if status in ("ok", "rejected") else 0.0
        except KeyError as exc:
            raise ValueError(f"clients row lacks {exc.args[0]!r}: {dict(row)}") from None
    return [TierWork(t, flops=a[0], useful_flops=a[1], bytes_down=a[2], bytes_up=a[3]) for t, a in acc.items()]


def _price(device: Device, flops: float, down: float, up: float, efficiency: float, zone: str | None,
           grid: Mapping[str, float], idle_s: float = 0.0) -> WorkCost:
    return price_work(device, flops, int(down), int(up), zone=zone, charger_efficiency=efficiency, idle_s=idle_s,
                      grid=dict(grid))


def _row(side: str, device: str, zone: str, flops: float, cost: WorkCost,
         embodied_share: float = 1.0) -> dict[str, Any]:
    embodied = cost.co2_embodied_g * embodied_share
    return {"side": side, "device": device, "zone": zone, "flops": flops, "busy_h": cost.virtual_s / 3600,
            "energy_kwh": cost.wall_j / _J_PER_KWH, "co2_operational_g": cost.co2_operational_g,
            "co2_embodied_g": embodied, "co2_g": cost.co2_operational_g + embodied}


def _total(side: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("flops", "busy_h", "energy_kwh", "co2_operational_g", "co2_embodied_g", "co2_g")
    return {"side": side, "device": "total", "zone": "", **{k: sum(r[k] for r in rows) for k in keys}}


def edge_vs_cloud(
    work: Sequence[TierWork], catalog: Mapping[str, Device] | None = None, cloud: str = "cloud-a100",
    pue: float = 1.2, charger_efficiency: float = 0.85, cloud_zone: str | None = None,
    grid: Mapping[str, float] | None = None, data_upload_bytes: float = 0.0, edge_embodied_share: float = 1.0,
    lifetime_years: float | None = None, edge_grid_g_per_kwh: float | None = None,
) -> list[dict[str, Any]]:
    """Rows: one per edge tier, the edge total, the cloud device (and data upload), the cloud total, and
    ``edge / cloud`` ratios of every column. ``lifetime_years`` and ``edge_grid_g_per_kwh`` override every
    edge tier's lifetime and grid intensity (for sensitivity tables)."""
    catalog = load_catalog() if catalog is None else catalog
    table = dict(GRID_G_PER_KWH if grid is None else grid)
    if not work:
        raise ValueError("work: no edge work to compare")
    if cloud not in catalog:
        raise ValueError(f"cloud: {cloud!r} is not in the device catalog")
    if pue < 1:
        raise ValueError(f"pue: must be >= 1, got {pue}")
    if not 0 <= edge_embodied_share <= 1:
        raise ValueError(f"edge_embodied_share: must be in [0, 1], got {edge_embodied_share}")
    if data_upload_bytes < 0:
        raise ValueError(f"data_upload_bytes: must be >= 0, got {data_upload_bytes}")
    if lifetime_years is not None and lifetime_years <= 0:
        raise ValueError(f"lifetime_years: must be > 0, got {lifetime_years}")
    if edge_grid_g_per_kwh is not None:
        if edge_grid_g_per_kwh < 0:
            raise ValueError(f"edge_grid_g_per_kwh: must be >= 0, got {edge_grid_g_per_kwh}")
        table["EDGE"] = edge_grid_g_per_kwh
    total_flops = sum(w.flops for w in work) or 1.0
    edge_rows, upload_rows = [], []
    for w in work:
        if w.tier not in catalog:
            raise ValueError(f"work: tier {w.tier!r} is not in the device catalog")
        device = catalog[w.tier]
        if lifetime_years is not None:
            device = dataclasses.replace(device, lifetime_years=lifetime_years)
        zone = "EDGE" if edge_grid_g_per_kwh is not None else (w.zone or device.zone)
        cost = _price(device, w.flops, w.bytes_down, w.bytes_up, charger_efficiency, zone, table, w.idle_s)
        edge_rows.append(_row("edge", w.tier, zone, w.flops, cost, edge_embodied_share))
        if data_upload_bytes:
            share = data_upload_bytes * w.flops / total_flops
            up = _price(device, 0.0, 0.0, share, charger_efficiency, zone, table)
            upload_rows.append(_row("cloud", f"data upload from {w.tier}", zone, 0.0, up, edge_embodied_share))
    useful = sum(w.useful for w in work)
    gpu = catalog[cloud]
    cloud_cost = _price(gpu, useful, 0.0, 0.0, 1.0 / pue, cloud_zone, table)
    cloud_rows = [_row("cloud", cloud, cloud_zone or gpu.zone, useful, cloud_cost), *upload_rows]
    edge_total, cloud_total = _total("edge", edge_rows), _total("cloud", cloud_rows)
    ratio = {"side": "edge / cloud", "device": "ratio", "zone": ""}
    for key in ("flops", "busy_h", "energy_kwh", "co2_operational_g", "co2_embodied_g", "co2_g"):
        ratio[key] = edge_total[key] / cloud_total[key] if cloud_total[key] else float("inf")
    return [*edge_rows, edge_total, *cloud_rows, cloud_total, ratio]


def sensitivity(
    work: Sequence[TierWork], lifetimes: Sequence[float] = LIFETIMES_Y, grids: Sequence[float] = GRIDS_G_PER_KWH,
    **options: Any,
) -> list[dict[str, Any]]:
    """Edge/cloud CO2 ratio for every edge device lifetime (rows, years) x edge grid intensity (columns,
    g/kWh); the cloud keeps its own zone and lifetime. ``options`` go to :func:`edge_vs_cloud`."""
    rows = []
    for life in lifetimes:
        row: dict[str, Any] = {"edge lifetime (years)": life}
        for g in grids:
            ratio = edge_vs_cloud(work, lifetime_years=life, edge_grid_g_per_kwh=g, **options)[-1]
            row[f"{g:g} g/kWh"] = ratio["co2_g"]
        rows.append(row)
    return rows


def assumptions(
    cloud: str = "cloud-a100", pue: float = 1.2, charger_efficiency: float = 0.85, cloud_zone: str | None = None,
    data_upload_bytes: float = 0.0, edge_embodied_share: float = 1.0, catalog: Mapping[str, Device] | None = None,
    grid: Mapping[str, float] | None = None, **_: Any,
) -> list[str]:
    """The assumptions behind an :func:`edge_vs_cloud` table with these options, one sentence each."""
    catalog = load_catalog() if catalog is None else catalog
    table = GRID_G_PER_KWH if grid is None else grid
    gpu = catalog[cloud]
    zone = cloud_zone or gpu.zone
    return [
        f"Cloud: one {gpu.description} at {gpu.tflops:g} sustained TFLOPS and {gpu.train_w:g} W, PUE {pue:g}, "
        f"zone {zone} ({table[zone]:g} gCO2e/kWh), {gpu.embodied_kg:g} kgCO2e over {gpu.lifetime_years:g} years.",
        "The cloud trains only the FLOPs that reached the model; the edge also pays for wasted work, "
        "transfers (catalog link rates and radio watts) and idle waiting.",
        f"Edge chargers and power supplies deliver {charger_efficiency:.0%} of the wall energy to the device.",
        "Data already in the cloud." if not data_upload_bytes else
        f"{data_upload_bytes / 1e9:g} GB of training data uploaded from the edge devices' radios to the cloud.",
        "Operational carbon: wall kWh x yearly grid intensity of each device's zone (2023 averages).",
        "Embodied carbon: lifecycle kgCO2e x busy time / lifetime, i.e. fully utilised devices on both sides; "
        f"edge embodied carbon counted at {edge_embodied_share:.0%}.",
        "Device figures are class estimates from the catalog (see its sources; many are marked assumed).",
    ]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows of dicts (same keys) as a GitHub markdown table."""
    if not rows:
        return ""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def edge_cloud_markdown(work: Sequence[TierWork], **options: Any) -> str:
    """The report section: comparison table, sensitivity table and assumptions, for ``options`` of
    :func:`edge_vs_cloud`."""
    rows = edge_vs_cloud(work, **options)
    ratio = rows[-1]
    return "\n\n".join([
        "## Edge vs cloud",
        f"The same training work on the edge population costs {ratio['energy_kwh']:.3g}x the energy and "
        f"{ratio['co2_g']:.3g}x the CO2e of the cloud (below 1: the edge is cheaper).",
        markdown_table(rows),
        "### Sensitivity: edge/cloud CO2e by edge device lifetime and edge grid intensity",
        markdown_table(sensitivity(work, **options)),
        "### Assumptions",
        "\n".join(f"- {a}" for a in assumptions(**options)),
    ])
