"""The local disk cache: tokenised client data and converted base models, kept between processes.

A deployed SuperNode starts a fresh ClientApp process for every message, so anything built from
scratch (tokenised partitions, a GGUF base converted to safetensors) is written here once and read back.
Location: ``$FEDFUSION_CACHE``, else ``~/.cache/fedfusion``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def cache_dir() -> Path:
    """The cache root (created on first use)."""
    path = Path(os.environ.get("FEDFUSION_CACHE") or Path.home() / ".cache" / "fedfusion")
    path.mkdir(parents=True, exist_ok=True)
    return path


def cached_tensor(kind: str, key: str, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``build()``'s tensor, stored as ``<cache>/<kind>/<sha256(key)>.safetensors``, reused while ``key`` is the same."""
    path = cache_dir() / kind / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"
    if path.is_file():
        try:
            return load_file(str(path))["value"]
        except Exception:  # an unreadable entry (torn write, disk error) is rebuilt, never fatal
            path.unlink(missing_ok=True)
    value = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    save_file({"value": value.contiguous()}, str(tmp))
    os.replace(tmp, path)  # atomic: readers see the old entry or the whole new one
    return value
