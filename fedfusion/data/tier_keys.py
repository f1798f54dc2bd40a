"""Metrics-row keys of a score over one group of probes (``probe_acc/phone``: the facts whose holder is a phone).

One owner for the key format, and no torch import: the run report and ``fedfusion compare`` read the keys back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def group_key(metric: str, group: str) -> str:
    """The key of ``metric`` over ``group``'s probes: a slash, which TensorBoard and MLflow both accept in a
    scalar's name and group by."""
    return f"{metric}/{group}"


def grouped(row: Mapping[str, Any], metric: str) -> dict[str, float]:
    """The groups' values of ``metric`` in a metrics row (the inverse of :func:`group_key`), in the row's order."""
    prefix = group_key(metric, "")
    return {k[len(prefix):]: float(v) for k, v in row.items() if k.startswith(prefix) and v is not None}
