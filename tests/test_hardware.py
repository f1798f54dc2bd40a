"""The client's own view of its host: accelerator choice, reported capabilities, and the disk cache."""

from __future__ import annotations

import mmap
from pathlib import Path

import psutil
import pytest
import torch

from fedfusion.data.cache import cached_tensor
from fedfusion.devices import hardware
from fedfusion.devices.hardware import capabilities, pick_accelerator, use_fastest_threads


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


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("one_s", "wide_s", "expected"), [(1.0, 0.5, 4), (1.0, 0.85, 1), (1.0, 3.0, 1)])
def test_the_server_keeps_all_threads_only_where_they_are_clearly_faster(monkeypatch, restore_threads, one_s,
                                                                          wide_s, expected):
    probes: list[tuple[int, float]] = []

    def probe(threads: int, give_up_s: float = float("inf")) -> float:
        probes.append((threads, give_up_s))
        return one_s if threads == 1 else wide_s

    monkeypatch.setattr(hardware, "_probe_s", probe)
    assert use_fastest_threads(4) == expected
    assert torch.get_num_threads() == expected
    assert probes == [(1, float("inf")), (4, one_s)]  # the wide probe gives up once it is slower than one thread


def test_one_thread_needs_no_probe(monkeypatch, restore_threads):
    monkeypatch.setattr(hardware, "_probe_s", lambda *a, **k: pytest.fail("probed"))
    assert use_fastest_threads(1) == 1 and torch.get_num_threads() == 1


def test_the_probe_really_times_and_gives_up(monkeypatch, restore_threads):
    assert hardware._probe_s(1) > 0
    monkeypatch.setattr(hardware, "PROBE_REPS", 10**6)  # minutes of products, unless it gives up after the first
    assert hardware._probe_s(2, give_up_s=0.0) < 1.0


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="/proc/self/status is Linux's")
def test_the_process_peak_is_linuxs_high_water_mark_and_grows_with_a_large_allocation() -> None:
    """peak_rss_mb reads VmHWM (never below the resident set now); touching 200 MiB more than the peak raises it by
    about that; a field /proc/self/status lacks is an error that names it."""
    resident = hardware.status_kb("VmRSS")  # read first: the peak read after is at least it
    assert hardware.status_kb("VmHWM") >= resident
    before = hardware.peak_rss_mb()
    assert before * 1024 <= hardware.status_kb("VmHWM") <= before * 1024 + 10 * 1024  # the same figure, read later
    gap = before - hardware.status_kb("VmRSS") / 1024  # what the resident set may grow by before a new peak
    # fresh anonymous pages, each written: resident on top of the set now, 200 MiB beyond the earlier peak (a malloc'd
    # tensor could reuse freed pages the resident set already counts, and then not raise the peak)
    block = mmap.mmap(-1, int(gap + 200) * 2**20)
    for page in range(0, len(block), mmap.PAGESIZE):
        block[page] = 1
    assert hardware.peak_rss_mb() >= before + 150
    block.close()
    with pytest.raises(RuntimeError, match="VmNope"):
        hardware.status_kb("VmNope")
