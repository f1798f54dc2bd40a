"""How long each command the README shows takes, timed as a user runs it (whole command, from a shell).

Each command runs once, one at a time, in a scratch directory (so `runs/` of the checkout is untouched; `deploy`,
which needs the source tree, runs from the checkout and writes its run into the scratch directory), in the
environment this script runs in (`fedfusion` and `flwr` on its PATH). Before each, the 1-minute load average is
recorded: times are only comparable where it was low. The README quotes these seconds and cites this file.

    python benchmarks/readme_commands.py [--only NAME ...] [--out benchmarks/results]

writes ``readme_commands.{json,md}`` (a rerun with ``--only`` keeps the other commands' earlier rows).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FLWR = ('flwr run {root} --stream --federation-config "num-supernodes=32 client-resources-num-cpus=1" '
        "-c \"recipe='quickstart' overrides='rounds=5' out='{work}/runs/flwr'\"")
# name -> the README's command (as shown; {root} is the checkout, {work} the scratch directory)
COMMANDS = {
    "quickstart": "fedfusion run quickstart",
    "flwr_run": FLWR,
    "plan": "fedfusion plan quickstart fusion.auto_widths=true",
    "static_4_rounds": "fedfusion run rolling fusion.policy=static rounds=4 --out runs/static",
    "report": "fedfusion report runs/static",
    "devices": "fedfusion devices",
    "facts": "fedfusion facts my-facts",
    "certs": "fedfusion certs certificates",
    "edge_cloud": "fedfusion edge-cloud",
    "deploy": "fedfusion deploy quickstart population.num_clients=3 selection.clients_per_round=3 rounds=5",
}
FROM_SOURCE = {"deploy": " --out {work}/runs/deploy"}  # run from the checkout (flwr needs its pyproject.toml)


def time_command(name: str, work: Path) -> dict:
    """One command's wall time (or its failure: exit status and the end of its stderr)."""
    command, extra = COMMANDS[name], FROM_SOURCE.get(name)
    env = {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run((command + (extra or "")).format(root=ROOT, work=work), shell=True,
                          cwd=ROOT if extra else work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    row = {"command": command.format(root=".", work="."), "seconds": round(seconds, 1), "load_at_start": round(load, 2)}
    return row if done.returncode == 0 else {**row, "failed": done.returncode, "stderr": done.stderr[-2000:]}


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(COMMANDS), default=list(COMMANDS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if shutil.which("fedfusion") is None:
        raise SystemExit("fedfusion is not on PATH: activate the project's venv first")
    path = args.out / "readme_commands.json"
    rows = json.loads(path.read_text())["commands"] if path.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in COMMANDS:  # in order: report reads the static run
            if name in args.only or (name == "static_4_rounds" and "report" in args.only):
                print(f"[{time.strftime('%H:%M:%S')}] {name}", flush=True)
                rows[name] = time_command(name, work)
                print(f"  {rows[name]['seconds']} s (load {rows[name]['load_at_start']})"
                      f"{' FAILED: ' + rows[name]['stderr'] if 'failed' in rows[name] else ''}", flush=True)
                write(args.out, rows)
    return 1 if any("failed" in r for r in rows.values()) else 0


def seconds_cell(row: dict) -> str:
    return f"failed (exit {row['failed']})" if "failed" in row else f"{row['seconds']:.1f}"


def write(out: Path, rows: dict[str, dict]) -> None:
    """The results so far (after every command: an interrupted or failing run keeps what it measured)."""
    machine = f"{platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/readme_commands.py"  # every row (--only NAME re-times one of them in place)
    (out / "readme_commands.json").write_text(json.dumps({"command": command, "machine": machine, "commands": rows},
                                                         indent=1) + "\n")
    lines = ["# The README's commands, timed", "", f"Machine: {machine}. Each command alone, whole (Python start-up, "
             "imports, Ray), from a scratch directory; `load` is the 1-minute load average as it started (2 CPUs: "
             "below ~0.5 the machine was quiet).", "", f"Command: `{command}`", "",
             "| command | seconds | load |", "|---|---|---|"]
    lines += [f"| `{r['command']}` | {seconds_cell(r)} | {r['load_at_start']} |" for r in rows.values()]
    (out / "readme_commands.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
