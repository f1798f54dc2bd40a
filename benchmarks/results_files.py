"""What a benchmark writes beside its numbers: the facts of the run (command, machine, torch, load before) and
its ``<stem>.json`` + ``<stem>.md`` pair under the results folder."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch


def run_facts(script: str, argv: list[str] | None) -> dict[str, Any]:
    """The command as run (``script`` and its arguments), the machine, torch's version and the load average before."""
    return {"command": " ".join([f"python {script}", *(argv if argv is not None else sys.argv[1:])]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "torch": torch.__version__,
            "load_before": " / ".join(f"{x:.2f}" for x in os.getloadavg())}


def write_pair(out: Path, stem: str, data: dict[str, Any], markdown: str) -> None:
    """Write ``data`` as JSON and ``markdown`` beside it, and print the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)
