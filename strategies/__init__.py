"""Flower server strategies (installed as ``fedfusion.strategies``).

Each class is imported on first use, so a server loads only the strategy its recipe runs.
"""

from importlib import import_module
from typing import Any

_MODULES = {"DistillationFusion": "distillation", "GenerativeFusion": "generative", "LoRAFusion": "lora",
            "SubModelFusion": "submodel"}
__all__ = list(_MODULES)


def __getattr__(name: str) -> Any:
    """``fedfusion.strategies.X``: the class from its own module, imported now."""
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_MODULES[name]}"), name)
