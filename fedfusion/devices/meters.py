"""Measured energy of the host a client trains on, read through Zeus (optional: ``pip install "fedfusion[meter]"``).

Zeus (``zeus`` on PyPI, from the ML.ENERGY initiative) reads every meter a client machine may have: NVIDIA GPUs
through NVML, AMD GPUs through amdsmi, CPU packages and DRAM through Linux RAPL (or its ``zeusd`` daemon, without
root), Apple Silicon through ``zeus-apple-silicon`` and Jetson boards through their power rails. This module is
the project's one reader of meters: :class:`HostMeter` measures a block of work, the reply carries one metric per
meter (:data:`WIRE_PREFIX` + meter name), and :func:`read_measured` turns a reply's metrics into the ledger's
``measured_j`` / ``measured_source``. Measured joules are the host's, labelled as such and kept apart from the
priced device energy (:mod:`fedfusion.devices.energy`), which stays what simulation reports: a simulated phone does not
run on the host that simulates it. Without Zeus, or on a host without readable meters, nothing is measured.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

WIRE_PREFIX = "measured-j-"  # reply metric key of one meter's joules, e.g. measured-j-nvml
_GPU_METERS = {"NVIDIAGPUs": "nvml", "AMDGPUs": "amdsmi"}  # Zeus's GPU backends by class name
_SOC_METERS = {"AppleSilicon": "apple", "Jetson": "jetson"}
# the top-level parts of a SoC measurement (mJ) that add up to the chip without counting a part twice, where it
# gives no total: Apple Silicon's (cpu_total_mj already holds the per-core and per-cluster figures), a Jetson's
_SOC_PARTS = ("cpu_total_mj", "dram_mj", "gpu_mj", "gpu_sram_mj", "ane_mj", "cpu_energy_mj", "gpu_energy_mj")
_windows = itertools.count()


def zeus_installed() -> bool:
    """Whether Zeus can be imported (found without importing it: importing takes seconds)."""
    return importlib.util.find_spec("zeus") is not None


@lru_cache(maxsize=8)
def _monitor(gpu: int | None) -> Any:
    """One Zeus monitor per process and GPU (creating one probes every device; RAPL starts a wrap-around
    watcher), over the CPU packages, the SoC and GPU ``gpu`` (None: no GPU, the client trains elsewhere); None
    where Zeus cannot set one up."""
    from zeus.monitor import ZeusMonitor

    try:
        return ZeusMonitor(gpu_indices=[] if gpu is None else [gpu])
    except Exception as exc:  # a meter must never stop training: the priced energy is still reported
        _unread(exc)
        return None


def _unread(exc: Exception) -> None:
    logging.getLogger(__name__).warning("energy meter unreadable (%s: %s); this work reports no measured joules",
                                        type(exc).__name__, exc)


def make_monitor(gpu: int | None) -> Any | None:
    """The Zeus monitor for a client training on GPU ``gpu`` (or on no GPU), or None without Zeus."""
    return _monitor(gpu) if zeus_installed() else None


def _soc_joules(measurement: Any) -> float:
    """Joules of a Zeus SoC measurement: a Jetson's board total where it has one, else the sum of its parts."""
    total = getattr(measurement, "total_energy_mj", None)
    if total is None:
        total = sum(getattr(measurement, part, None) or 0 for part in _SOC_PARTS)
    return float(total) / 1000


def meter_joules(monitor: Any, measurement: Any) -> dict[str, float]:
    """Joules per meter of one Zeus ``Measurement`` taken by ``monitor``; meters that read nothing are left out."""
    found: dict[str, float] = {}
    if measurement.gpu_energy:
        found[_GPU_METERS.get(type(monitor.gpus).__name__, "gpu")] = float(sum(measurement.gpu_energy.values()))
    if measurement.cpu_energy:
        found["rapl"] = float(sum(measurement.cpu_energy.values()))
    if measurement.dram_energy:
        found["rapl-dram"] = float(sum(measurement.dram_energy.values()))
    if measurement.soc_energy is not None:
        found[_SOC_METERS.get(type(monitor.soc).__name__, "soc")] = _soc_joules(measurement.soc_energy)
    return found


class HostMeter:
    """Context manager measuring the host's energy during a block through Zeus, on every meter it has.

    After the block ``joules`` maps meter name -> joules (empty without Zeus or without a readable meter);
    :meth:`metrics` gives them as reply metrics. Meters count their whole device (a CPU package, a GPU), so
    other load on it is included; ``gpu`` names the one GPU the client trains on (None: count no GPU).
    """

    def __init__(self, gpu: int | None = None) -> None:
        self.gpu = gpu
        self.joules: dict[str, float] = {}
        self._monitor: Any | None = None
        self._key = ""

    def __enter__(self) -> HostMeter:
        self._monitor = make_monitor(self.gpu)
        if self._monitor is not None:
            self._key = f"fedfusion-{next(_windows)}"
            try:
                self._monitor.begin_window(self._key)
            except Exception as exc:  # a meter that fails to read must not stop the training it measures
                _unread(exc)
                self._monitor = None
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: Any) -> None:
        if self._monitor is None:
            return
        try:
            measurement = self._monitor.end_window(self._key, cancel=kind is not None)
        except Exception as error:
            _unread(error)
            return
        self.joules = {} if kind is not None else meter_joules(self._monitor, measurement)

    def metrics(self) -> dict[str, float]:
        """The readings as reply metrics, one :data:`WIRE_PREFIX` key per meter."""
        return {WIRE_PREFIX + name: joules for name, joules in self.joules.items()}


def gpu_index(device: Any) -> int | None:
    """The CUDA index a torch device (or its string) trains on, as Zeus counts GPUs; None for CPU and MPS."""
    text = str(device)
    if not text.startswith("cuda"):
        return None
    _, _, index = text.partition(":")
    if index:
        return int(index)
    import torch

    return torch.cuda.current_device()


def read_measured(metrics: Mapping[str, Any]) -> tuple[float, str] | None:
    """(joules, source) of a reply's measured meters for the ledger: their sum, and their names joined by ``+``
    (e.g. ``nvml+rapl``); None when the client measured nothing. A reading that is not a finite non-negative
    number raises ValueError naming its key."""
    found = {}
    for key in sorted(k for k in metrics if str(k).startswith(WIRE_PREFIX)):
        value = float(metrics[key])
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"{key} is {value}: a measured energy must be a finite number >= 0")
        found[key.removeprefix(WIRE_PREFIX)] = value
    if not found:
        return None
    return sum(found.values()), "+".join(found)
