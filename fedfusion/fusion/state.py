"""Method and strategy state as JSON-ready values, for the checkpoints a run writes (``fedfusion.run.checkpoint``)."""

from __future__ import annotations

import base64
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors


def pack_tensors(tensors: dict[str, torch.Tensor]) -> str:
    """Tensors as one JSON-able string (safetensors, base64), for strategy state inside a checkpoint."""
    return base64.b64encode(save_tensors({k: v.contiguous() for k, v in tensors.items()})).decode()


def unpack_tensors(text: str) -> dict[str, torch.Tensor]:
    """The tensors :func:`pack_tensors` wrote."""
    return load_tensors(base64.b64decode(text))


def rng_state(rng) -> list[Any]:
    """A ``random.Random`` state as JSON-ready lists."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_rng_state(rng, state: list[Any]) -> None:
    """Restore a state saved by :func:`rng_state`."""
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))
