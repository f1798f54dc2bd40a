"""What the machine a client runs on can do: accelerator choice and the capabilities it reports.

A deployed SuperNode answers the server's capability query with these real numbers (memory, the
accelerator torch can use, CPU count, battery and charging state where the OS reports them), next to
the device tier it was started as, so the server's ledger shows what the fleet actually is.
"""

from __future__ import annotations

import os
import platform
import resource
import sys
import time
from pathlib import Path

import psutil
import torch

ACCELERATORS = ("cuda", "mps", "cpu")
TORCH_THREADS = torch.get_num_threads()  # torch's own choice for this host (its physical cores), before anyone narrows it
PROBE_REPS = 20  # short products per probe: ~2-5 ms of work on a quiet laptop core


def pick_accelerator(preferred: str | None = None) -> str:
    """``preferred`` if given (and usable), else the best available: cuda, then Apple mps, then cpu."""
    if preferred is not None:
        if preferred not in ACCELERATORS:
            raise ValueError(f"accelerator {preferred!r}: expected one of {', '.join(ACCELERATORS)}")
        if preferred == "cuda" and not torch.cuda.is_available():
            raise ValueError("accelerator 'cuda' requested but torch sees no CUDA device")
        if preferred == "mps" and not torch.backends.mps.is_available():
            raise ValueError("accelerator 'mps' requested but torch's MPS backend is not available")
        return preferred
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def capabilities(accelerator: str) -> dict[str, str | int | float | bool]:
    """Measured facts about this host for the QUERY reply (only scalar values: they travel in a ConfigRecord)."""
    mem = psutil.virtual_memory()
    caps: dict[str, str | int | float | bool] = {
        "accelerator": accelerator,
        "os": f"{platform.system()} {platform.machine()}",
        "cpu_count": os.cpu_count() or 1,
        "memory_gb": round(mem.total / 2**30, 2),
        "memory_free_gb": round(mem.available / 2**30, 2),
    }
    if accelerator == "cuda":
        props = torch.cuda.get_device_properties(0)
        caps["accelerator_name"] = props.name
        caps["accelerator_memory_gb"] = round(props.total_memory / 2**30, 2)
    battery = psutil.sensors_battery() if hasattr(psutil, "sensors_battery") else None
    if battery is not None:
        caps["battery_percent"] = float(battery.percent)
        caps["charging"] = bool(battery.power_plugged)
    return caps


def status_kb(field: str, pid: int | str = "self") -> int:
    """A field of Linux's ``/proc/PID/status`` (default this process), in kB: ``VmRSS`` (resident now), ``VmHWM``
    (its peak), ``RssAnon``, ``RssShmem``, ... A missing field or process (another OS, one that has exited) raises
    RuntimeError naming it."""
    status = Path(f"/proc/{pid}/status")
    try:
        lines = status.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{status} has no {field} (Linux only, a running process)")


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB: Linux's ``VmHWM`` (the process's own, where ``ru_maxrss`` of a
    child would start at its parent's peak), else ``getrusage``'s ``ru_maxrss`` (bytes on macOS, kB elsewhere)."""
    try:
        return status_kb("VmHWM") / 1024
    except RuntimeError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def _probe_s(threads: int, give_up_s: float = float("inf")) -> float:
    """Seconds for :data:`PROBE_REPS` small matrix products on ``threads`` torch threads (stopping early once
    ``give_up_s`` is passed). They are as short as a small model's operations, so each one waits for its
    slowest thread the way those do when another process holds one of the cores."""
    torch.set_num_threads(threads)
    x, w = torch.ones(64, 256), torch.full((256, 256), 1e-3)
    start = time.perf_counter()
    for _ in range(PROBE_REPS):
        x = torch.tanh(x @ w)
        if time.perf_counter() - start > give_up_s:
            break
    return time.perf_counter() - start


def use_fastest_threads(most: int | None = None) -> int:
    """Set torch's threads to ``most`` (default :data:`TORCH_THREADS`) if that many are measurably faster than
    one right now, else to one; return the count.

    Torch computes with one thread per physical core and each operation waits for all of them, so a core busy
    with another process (a browser, a second run, the simulation's client actors) makes every operation wait
    for a descheduled thread: on 2 cores beside other jobs, 2 threads measured 12-130x slower than 1. The server
    calls this before each round's own work (the fold, distillation, central evaluation), so it takes its cores
    back when they are free. The probe costs ~2x a one-thread probe (a few ms); it gives up on the wider count
    as soon as that is slower. The count can change the last bits of float sums (the distill recipe's round-2
    client losses moved by ~1e-8 between 1 and 2 server threads), so bit-for-bit reruns fix it
    (``engine.server_threads``)."""
    most = TORCH_THREADS if most is None else most
    if most <= 1:
        torch.set_num_threads(1)
        return 1
    one = _probe_s(1)
    wide = _probe_s(most, give_up_s=one)
    threads = most if wide < 0.8 * one else 1  # a clear gain only: a tie keeps the one thread that cannot stall
    torch.set_num_threads(threads)
    return threads
