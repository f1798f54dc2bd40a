"""What the machine a client runs on can do: accelerator choice and the capabilities it reports.

A deployed SuperNode answers the server's capability query with these real numbers (memory, the
accelerator torch can use, CPU count, battery and charging state where the OS reports them), next to
the device tier it was started as, so the server's ledger shows what the fleet actually is.
"""

from __future__ import annotations

import os
import platform

import psutil
import torch

ACCELERATORS = ("cuda", "mps", "cpu")


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
