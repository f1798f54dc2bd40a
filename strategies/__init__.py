"""Flower server strategies (installed as ``fedfusion.strategies``): :class:`FusionStrategy`, the one strategy
that drives every fusion method (:mod:`fedfusion.fusion`), and the Grid wrappers it runs behind."""

from importlib import import_module
from typing import Any

__all__ = ["FusionStrategy"]


def __getattr__(name: str) -> Any:
    """``fedfusion.strategies.FusionStrategy``, imported on first use."""
    if name != "FusionStrategy":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return import_module(f"{__name__}.fusion").FusionStrategy
