"""What a benchmark writes beside its numbers: the facts of the run (command, machine, torch, load before) and
its ``<stem>.json`` + ``<stem>.md`` pair under the results folder.

The results' convention (tests/test_results_commands.py checks every file of benchmarks/results/ against it): the
markdown holds the command that wrote it on a line of its own, ``Command: `python benchmarks/x.py ...` ``, and the
JSON the same text as ``"command"``; the command runs on today's code (its script and flags exist, its recipes
and overrides load) and names no path of one machine."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

import torch


def command_line(command: str) -> str:
    """The markdown line that names the command that wrote a result."""
    return f"Command: `{command}`"


def run_facts(script: str, argv: list[str] | None) -> dict[str, Any]:
    """The command as run (``script`` and its arguments, quoted as a shell reads them), the machine, torch's version
    and the load average before."""
    return {"command": shlex.join(["python", script, *(argv if argv is not None else sys.argv[1:])]),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "torch": torch.__version__,
            "load_before": " / ".join(f"{x:.2f}" for x in os.getloadavg())}


def with_command(markdown: str, command: str | None) -> str:
    """``markdown`` with ``command``'s line below its title, unless it already holds that line."""
    if not command or command_line(command) in markdown.splitlines():
        return markdown
    title, _, rest = markdown.partition("\n\n")
    return f"{title}\n\n{command_line(command)}\n\n{rest}"


def write_pair(out: Path, stem: str, data: dict[str, Any], markdown: str, quiet: bool = False) -> None:
    """Write ``data`` as JSON and ``markdown`` beside it (with ``data["command"]``'s line: :func:`with_command`),
    and print the markdown (``quiet``: not; a benchmark that rewrites its results as it goes)."""
    markdown = with_command(markdown, data.get("command"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    (out / f"{stem}.md").write_text(markdown)
    if not quiet:
        print(markdown)
