"""The parameter server's links on the units mode's critical path: the 168M-parameter target (``hidden1024``) on
64 and 1,024 phones or laptops (``benchmarks/units.py``'s fleets), one step at 1 and 4 micro-batches (on-device
accumulation), behind an unlimited server (the devices' links alone, as the timeline priced it before the server had
links) and behind a 10 Gb/s link each way (``units.DEFAULT_SERVER``, the catalog's ``cloud-a100``).

    python benchmarks/units_server.py [--out benchmarks/results]

Per setting: the step, its lower bound (what no schedule of the step's messages beats under the timeline) and what
sets it, step / bound, the busiest link's and the server's links' utilisation, and the bytes the devices download in
all (every byte passes the server's send link). Virtual time only (``fedfusion.units.timeline``), a few minutes.
Writes ``units_server.json`` and ``units_server.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_files import run_facts, write_pair  # noqa: E402
from units import BATCH, RESULTS, SEQ, TARGETS, fleets  # noqa: E402

from fedfusion.units.devices import DEFAULT_SERVER, UNLIMITED_SERVER  # noqa: E402
from fedfusion.units.timeline import simulate  # noqa: E402

SERVERS = {"unlimited": UNLIMITED_SERVER, "10 Gb/s": DEFAULT_SERVER}


def measure(counts: list[int]) -> list[dict]:
    """Every fleet, device count, micro-batch count and server: the step's timing."""
    target, rows = TARGETS[1], []
    for fleet, (proto, _) in fleets().items():
        for n in counts:
            for m in (1, 4):
                for label, server in SERVERS.items():
                    r = simulate([proto] * n, [target.phases(BATCH * SEQ // m)] * m, accumulate=True, server=server)
                    rows.append({"fleet": fleet, "devices": n, "micro_batches": m, "server": label,
                                 "step_s": r.step_s, "lower_bound_s": r.lower_bound_s, "bound_by": r.bound_by,
                                 "step_over_bound": r.step_over_bound, "link_utilisation": r.link_utilisation,
                                 "server_link_utilisation": r.server_link_utilisation,
                                 "down_gb_total": float(r.down_bytes.sum()) / 1e9,
                                 "up_gb_total": float(r.up_bytes.sum()) / 1e9})
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(data: dict) -> str:
    rows = data["rows"]
    lines = ["# units mode: the server's links on the critical path", "",
             f"Machine: {data['machine']}; {data['seconds']:.0f} s in all.", "",
             "The 168M-parameter target (hidden 1024, 8 layers, vocab 32000; batch 8 x 128 tokens, every linear layer "
             "offloaded, on-device accumulation) on benchmarks/units.py's fleets (phones 10 MB/s down / 2 MB/s up, "
             "50 ms RTT; laptops on a 1 Gb/s LAN, 2 ms RTT). Server: unlimited (the devices' links alone) or a 10 Gb/s "
             "link each way, every download through its send link and every upload through its receive link. Lower "
             "bound: what no schedule of the step's messages beats under the timeline; bound by: the resource or "
             "path that sets it.", "",
             "| fleet | devices | micro-batches | server | step (s) | lower bound (s) | step / bound | bound by | "
             "link util. | server link util. | GB down | GB up |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['fleet']} | {r['devices']} | {r['micro_batches']} | {r['server']} | {r['step_s']:.2f} | "
                     f"{r['lower_bound_s']:.2f} | {r['step_over_bound']:.2f} | {r['bound_by']} | "
                     f"{r['link_utilisation']:.2f} | {r['server_link_utilisation']:.2f} | {r['down_gb_total']:.1f} | "
                     f"{r['up_gb_total']:.1f} |")
    lines += ["", "## Findings", ""]
    for r in rows:
        if r["server"] != "10 Gb/s":
            continue
        free = next(q for q in rows if q["server"] == "unlimited" and
                    (q["fleet"], q["devices"], q["micro_batches"]) == (r["fleet"], r["devices"], r["micro_batches"]))
        lines.append(f"- {r['fleet']}, {r['devices']} devices, {r['micro_batches']} micro-batch(es): "
                     f"{r['step_s']:.2f} s behind the 10 Gb/s server against {free['step_s']:.2f} s with an unlimited "
                     f"one ({r['step_s'] / free['step_s']:.2f}x); {r['down_gb_total']:.1f} GB down, the server's "
                     f"busier link {r['server_link_utilisation']:.2f} busy; step / bound {r['step_over_bound']:.2f} "
                     f"({r['bound_by']}).")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    facts = run_facts("benchmarks/units_server.py", argv)
    start = time.time()
    rows = measure([64, 1024])
    data = {**facts, "seconds": time.time() - start, "rows": rows}
    write_pair(args.out, "units_server", data, markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
