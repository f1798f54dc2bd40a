"""Edge vs cloud: the same training work priced on the recipe's edge population and on a cloud GPU.

The seed papers claim idle edge devices train with 1.5-4x less energy and 3.5-8x less carbon than a
cloud GPU once embodied carbon counts; critics (Patterson et al.) answer that chargers, radios and
stragglers erase the gain. This module lets a user check the claim for their own federation: it
prices counted work with :func:`fedfusion.devices.energy.price_work` on both sides and shows how the answer
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
  cloud). Embodied: the device's lifecycle kgCO2e x busy seconds / (lifetime seconds x utilisation), where
  utilisation is the share of its life a device is busy with any work (default 1 on both sides: only the
  time this work keeps it busy is charged). ``edge_embodied_share`` scales the edge part: 1 is the
  attributional view (the default), 0 the consequential one of the seed paper (the devices exist anyway,
  their manufacturing is sunk; the cloud GPU is new hardware bought for the work). :func:`carbon_views`
  prices both, and the utilisation the critics ask about, side by side.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from fedfusion.config.choices import DEFAULT_CLOUD
from fedfusion.devices.catalog import Device, load_catalog
from fedfusion.devices.energy import GRID_G_PER_KWH, WorkCost, price_work, train_flops

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
    ``bytes_up``, ``status``), charged as the run's ledger does (``fedfusion.run.federation.price_client``): every client its
    planned training and download, uploads for replies that arrived (ok, rejected) and, for a client the
    round was closed without (cut), a reply the size of its download; only ok clients' FLOPs are useful."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for row in rows:
        try:
            tier, flops, status = str(row["device"]), train_flops(int(row["params"]), int(row["tokens"])), row["status"]
            a = acc[tier]
            a[0] += flops
            a[1] += flops if status == "ok" else 0.0
            a[2] += float(row["bytes_down"])
            a[3] += (float(row["bytes_up"]) if status in ("ok", "rejected")
                     else float(row["bytes_down"]) if status == "cut" else 0.0)
        except KeyError as exc:
            raise ValueError(f"clients row lacks {exc.args[0]!r}: {dict(row)}") from None
    return [TierWork(t, flops=a[0], useful_flops=a[1], bytes_down=a[2], bytes_up=a[3]) for t, a in acc.items()]


def cloud_tiers(catalog: Mapping[str, Device]) -> list[str]:
    """The catalog's cloud tiers: those named ``cloud-...`` (the built-in A5000, A100 and H100)."""
    return [name for name in catalog if name.startswith("cloud-")]


def check_cloud(cloud: str, catalog: Mapping[str, Device]) -> None:
    """Raise a ValueError naming ``cloud`` and the catalog's cloud tiers when the catalog lacks it."""
    if cloud not in catalog:
        tiers = ", ".join(cloud_tiers(catalog)) or "none (name a tier cloud-...)"
        raise ValueError(f"cloud: {cloud!r} is not in the device catalog; its cloud tiers: {tiers}")


def _price(device: Device, flops: float, down: float, up: float, efficiency: float, zone: str | None,
           grid: Mapping[str, float], idle_s: float = 0.0) -> WorkCost:
    return price_work(device, flops, int(down), int(up), zone=zone, charger_efficiency=efficiency, idle_s=idle_s,
                      grid=dict(grid))


def _row(side: str, device: str, zone: str, flops: float, cost: WorkCost,
         embodied_scale: float = 1.0) -> dict[str, Any]:
    embodied = cost.co2_embodied_g * embodied_scale
    return {"side": side, "device": device, "zone": zone, "flops": flops, "busy_h": cost.virtual_s / 3600,
            "energy_kwh": cost.wall_j / _J_PER_KWH, "co2_operational_g": cost.co2_operational_g,
            "co2_embodied_g": embodied, "co2_g": cost.co2_operational_g + embodied}


def _total(side: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("flops", "busy_h", "energy_kwh", "co2_operational_g", "co2_embodied_g", "co2_g")
    return {"side": side, "device": "total", "zone": "", **{k: sum(r[k] for r in rows) for k in keys}}


def _check(name: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    if not (low < value <= high if low_open else low <= value <= high):
        raise ValueError(f"{name}: must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value}")


def edge_vs_cloud(
    work: Sequence[TierWork], catalog: Mapping[str, Device] | None = None, cloud: str = DEFAULT_CLOUD,
    pue: float = 1.2, charger_efficiency: float = 0.85, cloud_zone: str | None = None,
    grid: Mapping[str, float] | None = None, data_upload_bytes: float = 0.0, edge_embodied_share: float = 1.0,
    lifetime_years: float | None = None, edge_grid_g_per_kwh: float | None = None,
    edge_utilisation: float = 1.0, cloud_utilisation: float = 1.0,
) -> list[dict[str, Any]]:
    """Rows: one per edge tier, the edge total, the cloud device (and data upload), the cloud total, and
    ``edge / cloud`` ratios of every column. ``lifetime_years`` and ``edge_grid_g_per_kwh`` override every
    edge tier's lifetime and grid intensity (for sensitivity tables); embodied carbon is divided by each
    side's utilisation (the share of its life the device is busy with any work)."""
    catalog = load_catalog() if catalog is None else catalog
    table = dict(GRID_G_PER_KWH if grid is None else grid)
    if not work:
        raise ValueError("work: no edge work to compare")
    check_cloud(cloud, catalog)
    if pue < 1:
        raise ValueError(f"pue: must be >= 1, got {pue}")
    _check("edge_embodied_share", edge_embodied_share, 0.0, 1.0)
    _check("edge_utilisation", edge_utilisation, 0.0, 1.0, low_open=True)
    _check("cloud_utilisation", cloud_utilisation, 0.0, 1.0, low_open=True)
    if data_upload_bytes < 0:
        raise ValueError(f"data_upload_bytes: must be >= 0, got {data_upload_bytes}")
    if lifetime_years is not None and lifetime_years <= 0:
        raise ValueError(f"lifetime_years: must be > 0, got {lifetime_years}")
    if edge_grid_g_per_kwh is not None:
        if edge_grid_g_per_kwh < 0:
            raise ValueError(f"edge_grid_g_per_kwh: must be >= 0, got {edge_grid_g_per_kwh}")
        table["EDGE"] = edge_grid_g_per_kwh
    edge_scale = edge_embodied_share / edge_utilisation
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
        edge_rows.append(_row("edge", w.tier, zone, w.flops, cost, edge_scale))
        if data_upload_bytes:
            share = data_upload_bytes * w.flops / total_flops
            up = _price(device, 0.0, 0.0, share, charger_efficiency, zone, table)
            upload_rows.append(_row("cloud", f"data upload from {w.tier}", zone, 0.0, up, edge_scale))
    useful = sum(w.useful for w in work)
    gpu = catalog[cloud]
    cloud_cost = _price(gpu, useful, 0.0, 0.0, 1.0 / pue, cloud_zone, table)
    cloud_rows = [_row("cloud", cloud, cloud_zone or gpu.zone, useful, cloud_cost, 1.0 / cloud_utilisation),
                  *upload_rows]
    edge_total, cloud_total = _total("edge", edge_rows), _total("cloud", cloud_rows)
    ratio: dict[str, Any] = {"side": "edge / cloud", "device": "ratio", "zone": ""}
    for key in ("flops", "busy_h", "energy_kwh", "co2_operational_g", "co2_embodied_g", "co2_g"):
        ratio[key] = edge_total[key] / cloud_total[key] if cloud_total[key] else float("inf")
    return [*edge_rows, edge_total, *cloud_rows, cloud_total, ratio]


def totals(work: Sequence[TierWork], **options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The edge and the cloud total rows of :func:`edge_vs_cloud`."""
    rows = edge_vs_cloud(work, **options)
    return next(r for r in rows if r["side"] == "edge" and r["device"] == "total"), rows[-2]


@dataclass(frozen=True)
class CarbonView:
    """One way of charging embodied carbon, with the assumption it rests on in one line."""

    name: str
    edge_embodied_share: float
    edge_utilisation: float
    cloud_utilisation: float
    assumption: str

    def options(self) -> dict[str, float]:
        """The :func:`edge_vs_cloud` options that price this view."""
        return {"edge_embodied_share": self.edge_embodied_share, "edge_utilisation": self.edge_utilisation,
                "cloud_utilisation": self.cloud_utilisation}


CARBON_VIEWS = (
    CarbonView("attributional", 1.0, 1.0, 1.0,
               "each device's manufacturing carbon is charged by the hours this work keeps it busy, over its "
               "whole lifetime (both sides fully utilised)"),
    CarbonView("consequential (seed paper)", 0.0, 1.0, 1.0,
               "the edge devices exist anyway, so their manufacturing carbon is sunk; the cloud GPU is hardware "
               "bought for the work, charged by busy hours"),
    CarbonView("attributional, edge busy 20 % of its life", 1.0, 0.2, 0.8,
               "a phone or laptop busy 20 % of its life carries 5x the embodied carbon per busy hour; the cloud GPU "
               "80 % (assumed utilisations)"),
    CarbonView("attributional, edge busy 80 % of its life", 1.0, 0.8, 0.8,
               "edge and cloud equally utilised, 80 % (assumed)"),
)


ATTRIBUTIONAL, CONSEQUENTIAL = CARBON_VIEWS[0], CARBON_VIEWS[1]


def carbon_views(work: Sequence[TierWork], **options: Any) -> list[dict[str, Any]]:
    """Edge and cloud CO2e of the same work under each of :data:`CARBON_VIEWS`; ``options`` go to
    :func:`edge_vs_cloud` (their own embodied share and utilisations are replaced by each view's)."""
    rows = []
    for view in CARBON_VIEWS:
        edge, cloud = totals(work, **{**options, **view.options()})
        rows.append({"view": view.name, "edge CO2e g": edge["co2_g"], "cloud CO2e g": cloud["co2_g"],
                     "edge / cloud": edge["co2_g"] / cloud["co2_g"],
                     "cheaper": "edge" if edge["co2_g"] < cloud["co2_g"] else "cloud",
                     "assumption": view.assumption})
    return rows


EDGE_PARTS = ("compute (useful work)", "idle + wasted work (stragglers, failures, cuts)", "radio (transfers)",
              "charger losses", "embodied, while computing", "embodied, while transferring")
EDGE_COLUMN = "part of the edge's cost"


def _edge_costs(work: Sequence[TierWork], catalog: Mapping[str, Device] | None, charger_efficiency: float,
                grid: Mapping[str, float] | None) -> list[tuple[TierWork, str, WorkCost]]:
    """Each tier's work, grid zone and price (tier's own zone and lifetime)."""
    catalog = load_catalog() if catalog is None else catalog
    table = dict(GRID_G_PER_KWH if grid is None else grid)
    out = []
    for w in work:
        device = catalog[w.tier]
        zone = w.zone or device.zone
        out.append((w, zone, _price(device, w.flops, w.bytes_down, w.bytes_up, charger_efficiency, zone, table,
                                    w.idle_s)))
    return out


def edge_breakdown(work: Sequence[TierWork], catalog: Mapping[str, Device] | None = None,
                   charger_efficiency: float = 0.85, grid: Mapping[str, float] | None = None,
                   edge_embodied_share: float = 1.0, edge_utilisation: float = 1.0, **_: Any) -> list[dict[str, Any]]:
    """The edge side's energy and CO2e split into :data:`EDGE_PARTS` (useful compute, idle and wasted compute,
    radio, charger losses, embodied carbon while computing and while transferring), with each part's share.

    Operational carbon of a part is its wall-side energy times the tier's grid intensity; embodied carbon is
    split by busy seconds, scaled by ``edge_embodied_share / edge_utilisation`` as in :func:`edge_vs_cloud`."""
    table = GRID_G_PER_KWH if grid is None else grid
    energy = dict.fromkeys(EDGE_PARTS, 0.0)
    co2 = dict.fromkeys(EDGE_PARTS, 0.0)
    scale = edge_embodied_share / edge_utilisation
    for w, zone, cost in _edge_costs(work, catalog, charger_efficiency, grid):
        wasted = cost.compute_j * (1 - w.useful / w.flops) if w.flops else 0.0
        parts = {EDGE_PARTS[0]: cost.compute_j - wasted, EDGE_PARTS[1]: wasted + cost.idle_j,
                 EDGE_PARTS[2]: cost.radio_j,
                 EDGE_PARTS[3]: cost.wall_j - cost.compute_j - cost.radio_j - cost.idle_j}
        for part, joules in parts.items():
            energy[part] += joules / _J_PER_KWH
            co2[part] += joules / _J_PER_KWH * table[zone]
        if cost.virtual_s:
            co2[EDGE_PARTS[4]] += cost.co2_embodied_g * scale * cost.compute_s / cost.virtual_s
            co2[EDGE_PARTS[5]] += cost.co2_embodied_g * scale * cost.comm_s / cost.virtual_s
    total_e, total_c = sum(energy.values()) or 1.0, sum(co2.values()) or 1.0
    return [{EDGE_COLUMN: p, "energy kWh": energy[p], "energy share": energy[p] / total_e,
             "CO2e g": co2[p], "CO2e share": co2[p] / total_c} for p in EDGE_PARTS]


def _linear_root(gap: Callable[[float], float], a: float, b: float) -> float | None:
    """Where ``gap`` (linear in its argument) is zero, from its values at ``a`` and ``b``; None if it is flat."""
    ga, gb = gap(a), gap(b)
    return None if ga == gb else a - ga * (b - a) / (gb - ga)


def solve(work: Sequence[TierWork], knob: str, metric: str = "co2_g", ratio: float = 1.0,
          **options: Any) -> float | None:
    """The value of ``knob`` at which the cloud's ``metric`` (``energy_kwh`` or ``co2_g``) is ``ratio`` times
    the edge's (1: break-even), from the same pricing; None where no value does it.

    Knobs: ``edge_embodied_share``, ``edge_grid_g_per_kwh``, ``pue`` (linear in the knob),
    ``lifetime_years``, ``edge_utilisation``, ``cloud_utilisation`` and ``cloud_tflops`` (the cloud GPU's
    sustained TFLOPS; linear in 1/knob). The root may lie outside the knob's allowed range (a share above 1):
    callers judge it."""
    catalog = dict(load_catalog() if options.get("catalog") is None else options["catalog"])
    cloud = options.get("cloud", DEFAULT_CLOUD)
    check_cloud(cloud, catalog)
    inverse = knob in ("lifetime_years", "edge_utilisation", "cloud_utilisation", "cloud_tflops")
    if knob not in ("edge_embodied_share", "edge_grid_g_per_kwh", "pue") and not inverse:
        raise ValueError(f"knob: {knob!r} is not one of edge_embodied_share, edge_grid_g_per_kwh, pue, "
                         "lifetime_years, edge_utilisation, cloud_utilisation, cloud_tflops")

    def gap(h: float) -> float:
        value = 1.0 / h if inverse else h
        opts = {**options, "catalog": catalog}
        if knob == "cloud_tflops":
            opts["catalog"] = {**catalog, cloud: dataclasses.replace(catalog[cloud], tflops=value)}
        else:
            opts[knob] = value
        edge, cloud_total = totals(work, **opts)
        return cloud_total[metric] - ratio * edge[metric]

    lo, hi = {"edge_embodied_share": (0.0, 1.0), "edge_grid_g_per_kwh": (0.0, 100.0), "pue": (1.0, 2.0),
              "cloud_tflops": (1.0 / catalog[cloud].tflops, 0.5 / catalog[cloud].tflops)}.get(knob, (1.0, 2.0))
    root = _linear_root(gap, lo, hi)
    if root is None or (inverse and root <= 0):
        return None
    return 1.0 / root if inverse else root


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


def _pct(x: float) -> str:
    return f"{x:.0%}"


def _flip(root: float | None, low: float, high: float | None, fmt: str, below: str, above: str,
          edge_wins_now: bool) -> str:
    """A break-even cell: the root when it lies in [low, high]; else which side wins over the whole range
    (``below`` / ``above`` the range; without a positive root, the side that wins now wins everywhere)."""
    if root is None:
        return "always: the edge wins at any value" if edge_wins_now else "never: the edge loses at any value"
    if root >= low and (high is None or root <= high):
        return format(root, fmt)
    return below if root < low else above


def flip_table(work: Sequence[TierWork], **options: Any) -> list[dict[str, Any]]:
    """What flips the verdict: for each lever, its value now, the value where edge and cloud cost the same
    (from :func:`solve`, the same pricing), and on which side of it the edge wins. ``options`` go to
    :func:`edge_vs_cloud`."""
    catalog = load_catalog() if options.get("catalog") is None else options["catalog"]
    cloud = options.get("cloud", DEFAULT_CLOUD)
    check_cloud(cloud, catalog)
    gpu = catalog[cloud]
    pue = options.get("pue", 1.2)
    share = options.get("edge_embodied_share", 1.0)
    costs = _edge_costs(work, catalog, options.get("charger_efficiency", 0.85), options.get("grid"))
    compute_j, radio_j = (sum(getattr(c, k) for _, _, c in costs) for k in ("compute_j", "radio_j"))
    compute_s, comm_s = (sum(getattr(c, k) for _, _, c in costs) for k in ("compute_s", "comm_s"))
    zones = sorted({z for _, z, _ in costs})
    table = GRID_G_PER_KWH if options.get("grid") is None else options["grid"]
    attributional = {**options, "edge_embodied_share": 1.0, "edge_utilisation": 1.0, "cloud_utilisation": 1.0}
    consequential = {**attributional, "edge_embodied_share": 0.0}
    lifetimes = sorted({catalog[w.tier].lifetime_years for w in work})
    edge, cloud_total = totals(work, **options)
    wins = {"energy": edge["energy_kwh"] < cloud_total["energy_kwh"], "now": edge["co2_g"] < cloud_total["co2_g"]}
    for view, opts in (("attributional", attributional), ("consequential", consequential)):
        edge, cloud_total = totals(work, **opts)
        wins[view] = edge["co2_g"] < cloud_total["co2_g"]

    def per_work(k: float) -> str:
        return f"x{k:.3g} the training per byte sent" if k > 0 else "never (no transfers)"

    return [
        {"lever": f"cloud sustained TFLOPS (energy; {cloud})", "now": f"{gpu.tflops:g}",
         "break-even": _flip(solve(work, "cloud_tflops", "energy_kwh", **options), 0, None, ".3g", "never", "never",
                             wins["energy"]),
         "reading": "the edge wins on energy when the cloud GPU sustains less"},
        {"lever": "datacenter PUE (energy)", "now": f"{pue:g}",
         "break-even": _flip(solve(work, "pue", "energy_kwh", **options), 1, None, ".3g",
                             "always: the edge wins at any PUE", "never", wins["energy"]),
         "reading": "the edge wins on energy when the PUE is higher"},
        {"lever": "edge compute energy vs radio energy", "now": f"compute {compute_j / (radio_j or 1):.3g}x radio",
         "break-even": per_work(radio_j / compute_j if compute_j else 0.0),
         "reading": "below that, the radio outweighs compute in the edge's energy"},
        {"lever": "edge compute time vs transfer time (embodied carbon follows busy time)",
         "now": f"compute {compute_s / (comm_s or 1):.3g}x transfers",
         "break-even": per_work(comm_s / compute_s if compute_s else 0.0),
         "reading": "below that, transfers keep the devices busy longer than training does"},
        {"lever": "edge embodied share (0 consequential, 1 attributional)", "now": f"{share:g}",
         "break-even": _flip(solve(work, "edge_embodied_share", **options), 0, 1, ".3g",
                             "never: the edge loses even with its embodied carbon sunk",
                             "always: the edge wins even charged in full", wins["now"]),
         "reading": "the edge wins on carbon when the share is lower"},
        {"lever": "edge grid intensity, g/kWh (attributional)",
         "now": ", ".join(f"{z} {table[z]:g}" for z in zones),
         "break-even": _flip(solve(work, "edge_grid_g_per_kwh", **attributional), 0, None, ".3g",
                             "never: the edge loses even on a carbon-free grid", "never", wins["attributional"]),
         "reading": "the edge wins on carbon when its grid is cleaner"},
        {"lever": "edge device lifetime, years (attributional)", "now": ", ".join(f"{x:g}" for x in lifetimes),
         "break-even": _flip(solve(work, "lifetime_years", **attributional), 0, None, ".3g",
                             "never", "never", wins["attributional"]),
         "reading": "the edge wins on carbon when its devices last longer (or are busier: lifetime x utilisation counts)"},
        {"lever": "cloud utilisation (consequential)", "now": "100 %",
         "break-even": _flip(solve(work, "cloud_utilisation", **consequential), 0, 1, ".0%",
                             "never", "always: the edge wins even against a fully used GPU", wins["consequential"]),
         "reading": "the edge wins on carbon when the cloud GPU is busy less of its life"},
    ]


def _dominant(rows: list[dict[str, Any]], share: str) -> str:
    """The part with the largest ``share`` (``energy share`` or ``CO2e share``), and that share."""
    top = max(rows, key=lambda r: r[share])
    return f"{top[EDGE_COLUMN]}, {_pct(top[share])}"


def assumptions(
    cloud: str = DEFAULT_CLOUD, pue: float = 1.2, charger_efficiency: float = 0.85, cloud_zone: str | None = None,
    data_upload_bytes: float = 0.0, catalog: Mapping[str, Device] | None = None,
    grid: Mapping[str, float] | None = None, **_: Any,
) -> list[str]:
    """The assumptions behind an :func:`edge_vs_cloud` table with these options, one sentence each."""
    catalog = load_catalog() if catalog is None else catalog
    table = GRID_G_PER_KWH if grid is None else grid
    check_cloud(cloud, catalog)
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
        "Embodied carbon: lifecycle kgCO2e x busy time / (lifetime x utilisation); the carbon views above say how "
        "much of the edge's is charged and at which utilisation (the main table and the sensitivity table: "
        "the attributional view).",
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


def headline(work: Sequence[TierWork], **options: Any) -> str:
    """One paragraph a reader can trust at a glance: the cloud reference, the energy ratio, both carbon
    views, the verdict and what dominates the edge's cost."""
    catalog = load_catalog() if options.get("catalog") is None else options["catalog"]
    cloud = options.get("cloud", DEFAULT_CLOUD)
    check_cloud(cloud, catalog)
    views = {v["view"]: v for v in carbon_views(work, **options)}
    attributional, consequential = views[ATTRIBUTIONAL.name], views[CONSEQUENTIAL.name]
    energy = edge_vs_cloud(work, **options)[-1]["energy_kwh"]
    parts = edge_breakdown(work, **{**options, "edge_embodied_share": 1.0, "edge_utilisation": 1.0})
    on_energy = "edge" if energy < 1 else "cloud"
    winners = {on_energy, attributional["cheaper"], consequential["cheaper"]}
    verdict = (f"The {on_energy} is cheaper on energy and in both carbon views" if len(winners) == 1 else
               f"The verdict depends on the view: the {on_energy} is cheaper on energy, the "
               f"{attributional['cheaper']} attributionally, the {consequential['cheaper']} consequentially")
    others = ", ".join(t for t in cloud_tiers(catalog) if t != cloud)
    return (
        f"**Cloud reference: one {catalog[cloud].description} (`{cloud}`)**, set by the recipe's `report.cloud`"
        + (f" (other cloud tiers: {others})" if others else "") + ". "
        f"The same training work on the edge population costs **{energy:.3g}x the energy** of the cloud, and "
        f"**{attributional['edge / cloud']:.3g}x the CO2e attributionally** (edge manufacturing charged by busy "
        f"time) or **{consequential['edge / cloud']:.3g}x consequentially** (the seed paper's view: the devices "
        "exist anyway); below 1 the edge is cheaper. "
        f"**{verdict}.** The edge's energy goes mostly to {_dominant(parts, 'energy share')}; its attributional "
        f"CO2e mostly to {_dominant(parts, 'CO2e share')}."
    )


def edge_cloud_markdown(work: Sequence[TierWork], **options: Any) -> str:
    """The report section: headline, carbon views, the edge's cost split, what flips the verdict, the full
    comparison, a sensitivity table and the assumptions, for ``options`` of :func:`edge_vs_cloud`."""
    attributional = {**options, "edge_embodied_share": 1.0, "edge_utilisation": 1.0, "cloud_utilisation": 1.0}
    parts = edge_breakdown(work, **attributional)
    for row in parts:
        row["energy share"], row["CO2e share"] = _pct(row["energy share"]), _pct(row["CO2e share"])
    return "\n\n".join([
        "## Edge vs cloud",
        headline(work, **options),
        "### Carbon views: the same work, with embodied carbon charged each way",
        markdown_table(carbon_views(work, **options)),
        "### Where the edge's cost goes (attributional)",
        markdown_table(parts),
        "### What flips the verdict (break-even points from the same pricing)",
        markdown_table(flip_table(work, **options)),
        "### Every device (attributional)",
        markdown_table(edge_vs_cloud(work, **attributional)),
        "### Sensitivity: edge/cloud CO2e by edge device lifetime and edge grid intensity (attributional)",
        markdown_table(sensitivity(work, **attributional)),
        "### Assumptions",
        "\n".join(f"- {a}" for a in assumptions(**options)),
    ])
