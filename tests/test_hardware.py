"""The client's own view of its host: accelerator choice, reported capabilities, and the disk cache."""

from __future__ import annotations

import psutil
import pytest
import torch

from fedfusion.data.cache import cached_tensor
from fedfusion.devices.hardware import capabilities, pick_accelerator


def test_accelerator_is_picked_or_checked():
    assert pick_accelerator() in ("cuda", "mps", "cpu")
    assert pick_accelerator("cpu") == "cpu"
    with pytest.raises(ValueError, match="'tpu'"):
        pick_accelerator("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            pick_accelerator("cuda")


def test_capabilities_report_real_memory_as_scalars():
    caps = capabilities("cpu")
    assert caps["accelerator"] == "cpu" and caps["cpu_count"] >= 1
    assert caps["memory_gb"] == pytest.approx(psutil.virtual_memory().total / 2**30, abs=0.01)
    assert all(isinstance(v, (str, int, float, bool)) for v in caps.values())
    assert ("battery_percent" in caps) == (psutil.sensors_battery() is not None)


def test_cached_tensor_builds_once_and_survives_a_torn_file(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDFUSION_CACHE", str(tmp_path))
    calls = []

    def build() -> torch.Tensor:
        calls.append(1)
        return torch.arange(6).reshape(2, 3)

    first = cached_tensor("windows", "spec|0", build)
    again = cached_tensor("windows", "spec|0", build)
    assert torch.equal(first, again) and len(calls) == 1
    (stored,) = (tmp_path / "windows").iterdir()
    stored.write_bytes(b"half a file")
    assert torch.equal(cached_tensor("windows", "spec|0", build), first) and len(calls) == 2
    cached_tensor("windows", "spec|1", build)
    assert len(calls) == 3  # another key, another entry
