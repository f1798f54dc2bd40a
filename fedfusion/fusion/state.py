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


def optimizer_state(opt: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An optimizer's state split for a checkpoint: its parameter groups (JSON, for ``strategy``) and its
    per-parameter tensors (for ``tensors``, keyed ``<parameter index>/<name>``; entries that are not tensors, such
    as SGD's absent momentum, are left out and come back absent)."""
    sd = opt.state_dict()
    tensors = {f"{i}/{name}": v for i, s in sd["state"].items() for name, v in s.items() if isinstance(v, torch.Tensor)}
    return {"param_groups": sd["param_groups"]}, tensors


def load_optimizer_state(opt: torch.optim.Optimizer, groups: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Restore what :func:`optimizer_state` split."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        index, name = key.split("/", 1)
        state.setdefault(int(index), {})[name] = value
    opt.load_state_dict({"state": state, "param_groups": groups["param_groups"]})
