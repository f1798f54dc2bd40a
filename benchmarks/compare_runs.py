"""Compare two run directories' ledgers field by field, ignoring host wall-clock fields.

For refactors that must not change behaviour: run the same recipe and overrides on the old and the new code,
then ``python benchmarks/compare_runs.py OLD_RUN NEW_RUN``. Fix the server's torch threads on both sides
(``engine.server_threads=N``): the default chooses them each round by the machine's load, and the count can
change the last bits of a server-side distillation. Exit status 0 when ``metrics.jsonl`` and
``clients.jsonl`` agree on every field both rows have (values and types, exactly); fields present on one side
only are listed (a new ledger field is not a difference in behaviour, but it is shown).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# host timings and measurements: they differ between any two runs of the same code
WALL_CLOCK = {"wall_s", "elapsed_s", "eval_s", "aggregate_s", "server_s", "train_s", "node", "measured_j", "measured_source",
              "transport_s", "verify_s"}  # the last two: the units mode's host timings


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compare(old: Path, new: Path, name: str) -> tuple[list[str], set[str], set[str]]:
    """Differences of ledger ``name`` between two runs, and the fields only the old / only the new rows have."""
    a, b = rows(old / name), rows(new / name)
    diffs = [] if len(a) == len(b) else [f"{name}: {len(a)} rows vs {len(b)}"]
    only_old, only_new = set(), set()
    for i, (x, y) in enumerate(zip(a, b)):
        only_old |= set(x) - set(y)
        only_new |= set(y) - set(x)
        for key in sorted((set(x) & set(y)) - WALL_CLOCK):
            if x[key] != y[key] or type(x[key]) is not type(y[key]):
                diffs.append(f"{name} row {i} (round {x.get('round')}): {key}: {x[key]!r} vs {y[key]!r}")
    return diffs, only_old, only_new


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    failed = False
    for name in ("metrics.jsonl", "clients.jsonl"):
        diffs, only_old, only_new = compare(args.old, args.new, name)
        print(f"{name}: {'identical' if not diffs else f'{len(diffs)} differences'} "
              f"(ignoring {', '.join(sorted(WALL_CLOCK))}); only old: {sorted(only_old)}; only new: {sorted(only_new)}")
        for line in diffs[:20]:
            print("  " + line)
        failed |= bool(diffs) or bool(only_old)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
