"""Device catalog and the seeded assignment of device tiers to virtual clients."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import yaml


@dataclass(frozen=True)
class Device:
    """One device tier: what it can hold, how fast it trains and talks, what it draws and what it cost to make."""

    name: str
    description: str
    memory_gb: float
    tflops: float
    train_w: float
    idle_w: float
    battery_wh: float | None  # None: on mains power
    up_mbps: float
    down_mbps: float
    radio_w: float
    embodied_kg: float  # lifecycle kgCO2e
    lifetime_years: float
    zone: str  # default grid zone, a key of fedfusion.devices.energy.GRID_G_PER_KWH
    sources: str  # where each number comes from, or "assumed"
    runtime: str = "torch"  # what it trains with: torch, or executorch (a phone's training program; docs/devices.md)
    bfloat16: bool = False  # computes in bfloat16 at speed, so may train in it (the planner's bfloat16 ways)


_TEXT = ("description", "zone", "sources")
_POSITIVE = ("memory_gb", "tflops", "train_w", "idle_w", "up_mbps", "down_mbps", "radio_w",
             "embodied_kg", "lifetime_years")
_FIELDS = _TEXT + _POSITIVE + ("battery_wh",)
RUNTIMES = ("torch", "executorch")


def _positive(value: Any) -> bool:
    """A finite number above zero (YAML booleans are not numbers here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _device(name: str, fields: Any) -> Device:
    """One tier's fields checked and typed; a ValueError names the offending field."""
    if not isinstance(fields, dict):
        raise ValueError(f"tier {name!r}: expected a mapping of fields")
    missing = [f for f in _FIELDS if f not in fields]
    if missing:
        raise ValueError(f"tier {name!r} lacks {', '.join(missing)}")
    unknown = sorted(set(fields) - set(_FIELDS) - {"runtime", "bfloat16"})
    if unknown:
        raise ValueError(f"tier {name!r}: unknown field {', '.join(map(str, unknown))}")
    for f in _TEXT:
        if not isinstance(fields[f], str) or not fields[f].strip():
            raise ValueError(f"tier {name!r}: {f} must be a non-empty string, got {fields[f]!r}")
    for f in _POSITIVE:
        if not _positive(fields[f]):
            raise ValueError(f"tier {name!r}: {f} must be a positive number, got {fields[f]!r}")
    battery = fields["battery_wh"]
    if battery is not None and not _positive(battery):
        raise ValueError(f"tier {name!r}: battery_wh must be a positive number or null, got {battery!r}")
    runtime = fields.get("runtime", "torch")
    if runtime not in RUNTIMES:
        raise ValueError(f"tier {name!r}: runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    bf16 = fields.get("bfloat16", False)
    if not isinstance(bf16, bool):
        raise ValueError(f"tier {name!r}: bfloat16 must be true or false, got {bf16!r}")
    values: dict[str, Any] = {f: fields[f].strip() for f in _TEXT} | {f: float(fields[f]) for f in _POSITIVE}
    return Device(name=name, **values, battery_wh=None if battery is None else float(battery), runtime=runtime,
                  bfloat16=bf16)


def load_catalog(path: str | Path | None = None) -> dict[str, Device]:
    """The built-in catalog, or a user YAML file of the same shape (tier -> fields), validated."""
    return dict(_builtin_catalog()) if not path else _read_catalog(Path(path))


class CatalogChoice(Protocol):
    """What names a population's devices (the recipe's ``population`` section): the catalog file and the memory
    emulation."""

    catalog: str | None
    memory_scale: float


def population_catalog(population: CatalogChoice) -> dict[str, Device]:
    """The catalog a population's tiers come from, each tier's ``memory_gb`` times ``population.memory_scale``: a small
    built-in target standing for a larger one sees the memory its devices would have for that target
    (``fedfusion plan`` says so when the scale is not 1). Every fit to memory reads tiers through here."""
    catalog = load_catalog(population.catalog)
    scale = population.memory_scale
    if scale == 1:
        return catalog
    return {name: replace(d, memory_gb=d.memory_gb * scale) for name, d in catalog.items()}


def memory_note(population: CatalogChoice) -> str | None:
    """The plan's line saying the tiers' memory is emulated (None when it is not)."""
    if population.memory_scale == 1:
        return None
    return (f"memory emulated: each tier's memory is {population.memory_scale:g} of the catalog's "
            "(population.memory_scale), what its devices would have for the larger target this one stands for")


@lru_cache(maxsize=1)
def _builtin_catalog() -> dict[str, Device]:
    """The packaged catalog, parsed once: pure-Python YAML took ~0.3 s a time and every recipe check reads it. Its
    devices are frozen; :func:`load_catalog` hands out a copy of the mapping."""
    return _read_catalog(Path(str(resources.files("fedfusion.catalog").joinpath("devices.yaml"))))


def _read_catalog(src: Path) -> dict[str, Device]:
    """A catalog file (tier -> fields), validated."""
    try:
        raw = yaml.safe_load(src.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"device catalog {src}: cannot read: {exc}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"device catalog {src}: expected a mapping of tier name -> fields")
    catalog = {}
    for name, fields in raw.items():
        try:
            catalog[str(name)] = _device(str(name), fields)
        except ValueError as exc:
            raise ValueError(f"device catalog {src}: {exc}") from None
    return catalog


def catalog_rows(catalog: dict[str, Device]) -> list[dict[str, Any]]:
    """One row per tier, in catalog order, for a table of the catalog."""
    keys = ("name", "description", "memory_gb", "tflops", "train_w", "idle_w", "battery_wh",
            "up_mbps", "down_mbps", "embodied_kg", "lifetime_years", "zone")
    return [{k: getattr(device, k) for k in keys} for device in catalog.values()]


def assign_tiers(mix: dict[str, float], num_clients: int, seed: int) -> list[str]:
    """Tier of each client: counts proportional to ``mix`` (largest remainder), order shuffled by ``seed``.

    The same (mix, num_clients, seed) always gives the same list, on the server and on every client.
    """
    names = sorted(mix)
    shares = np.array([mix[n] for n in names], dtype=float)
    exact = shares / shares.sum() * num_clients
    counts = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - counts), kind="stable")[: num_clients - counts.sum()]:
        counts[i] += 1
    tiers = [n for n, c in zip(names, counts) for _ in range(c)]
    order = np.random.default_rng(seed).permutation(num_clients)
    return [tiers[i] for i in order]
