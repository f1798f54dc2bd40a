"""Device catalog and the seeded assignment of device tiers to virtual clients."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import yaml


@dataclass(frozen=True)
class Device:
    """What one device tier can hold and how fast it trains."""

    name: str
    description: str
    memory_gb: float
    tflops: float
    train_w: float


_FIELDS = ("description", "memory_gb", "tflops", "train_w")


def load_catalog(path: str | Path | None = None) -> dict[str, Device]:
    """The built-in catalog, or a user YAML file of the same shape (tier -> fields)."""
    src = Path(path) if path else Path(str(resources.files("fedfusion.catalog").joinpath("devices.yaml")))
    try:
        raw = yaml.safe_load(src.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"device catalog {src}: cannot read: {exc}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"device catalog {src}: expected a mapping of tier name -> fields")
    catalog = {}
    for name, fields in raw.items():
        missing = [f for f in _FIELDS if not isinstance(fields, dict) or f not in fields]
        if missing:
            raise ValueError(f"device catalog {src}: tier {name!r} lacks {', '.join(missing)}")
        catalog[name] = Device(name=name, **{f: fields[f] for f in _FIELDS})
    return catalog


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
