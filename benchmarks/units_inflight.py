"""The units mode with its micro-batches one at a time against all in flight (``units.in_flight``): how long a
device's processor waits between its messages, and the step's time.

    python benchmarks/units_inflight.py [--flower] [--out benchmarks/results]

Timeline (``fedfusion.units.timeline``, no Flower): the quickstart target (hidden 128, 4 layers, every linear layer
offloaded), a batch of 4 x 256 tokens as 4 micro-batches, 8 phones (``tests/test_units_timeline.phones``: 0.5-1.5
TFLOP/s, 5-10 MB/s down, 2-6 MB/s up, 50 ms RTT) and 20 ms of server time between phases; ``in_flight`` 1, 2 and 4 on
devices that take their next message while they compute (``lanes=0``), and 4 on devices that hold one message at a
time (``lanes=1``, Flower's SuperNode); weight-gradient tiles summed on the devices (``units.accumulate``).
With ``--flower`` also ``fedfusion run units units.steps=3 units.micro_batches=2 units.in_flight=N``
(recipes/units.yaml: 8 simulated nodes; virtual time for nodes that hold one message at a time, ``units.lanes:
1``) for N = 1 and 0 (all): per step the loss, virtual and wall seconds. Writes
``units_inflight.json`` and ``units_inflight.md``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_files import write_pair  # noqa: E402

from fedfusion.analysis.report import read_jsonl  # noqa: E402
from fedfusion.units import UnitDevice  # noqa: E402
from fedfusion.units.phases import llama_phases  # noqa: E402
from fedfusion.units.timeline import simulate  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
QUICKSTART = dict(hidden=128, intermediate=512, layers=4, heads=8, kv_heads=8, vocab=100)
GAP_S = 0.02


def phones(n: int) -> list[UnitDevice]:
    """The phones of tests/test_units_timeline.py (speeds and links vary up to 3x)."""
    return [UnitDevice(f"p{i}", 4e9, 0.5e12 * (1 + i % 3), 10e6 / (1 + i % 2), 2e6 * (1 + i % 3), rtt_s=0.05)
            for i in range(n)]


def timeline() -> list[dict]:
    chains = [llama_phases(**QUICKSTART, tokens=256, mode="all")] * 4
    rows = []
    for lanes, in_flight in ((0, 1), (0, 2), (0, 4), (1, 4)):
        t = simulate(phones(8), chains, server_gap_s=GAP_S, in_flight=in_flight, accumulate=True, lanes=lanes)
        used = t.down_bytes > 0
        rows.append({"lanes": lanes, "in_flight": in_flight, "step_s": t.step_s, "idle_gap_mean_s": float(np.mean(t.idle_gap_s[used])),
                     "idle_gap_max_s": float(np.max(t.idle_gap_s[used])), "compute_mean_s": float(np.mean(t.compute_s[used])),
                     "link_utilisation": t.link_utilisation, "lower_bound_s": t.lower_bound_s,
                     "bound_by": t.bound_by})
    return rows


def flower() -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for in_flight in (1, 0):
            out = Path(tmp) / f"in_flight{in_flight}"
            subprocess.run([sys.executable, "-m", "fedfusion.cli", "run", "units", "units.steps=3",
                            "units.micro_batches=2", f"units.in_flight={in_flight}", "--out", str(out)],
                           check=True, capture_output=True)
            for r in read_jsonl(out / "metrics.jsonl")[1:]:
                rows.append({"in_flight": in_flight, "step": r["step"], "train_loss": r["train_loss"],
                             "virtual_s": r["virtual_s"], "virtual_bound_s": r["virtual_bound_s"],
                             "wall_s": r["wall_s"]})
    return rows


def markdown(data: dict) -> str:
    lines = ["# units mode: micro-batches one at a time vs in flight", "", f"Command: `{data['command']}`", "",
             "Timeline: quickstart target, every linear layer, 4 micro-batches of 256 tokens, 8 phones, "
             f"{GAP_S * 1e3:.0f} ms of server time between phases, weight gradients summed on the devices. Idle gap: "
             "the seconds a device's processor waits between two of its messages (its downlink time included). Lanes: "
             "the messages a device holds at once (0: no limit, a runtime that receives while it computes; 1: "
             "Flower's SuperNode). The server's links: 10 Gb/s each way, queued; its time between phases on its "
             "processor. Lower bound: what no schedule of the step's messages beats under the timeline (bound by: "
             "the resource or path that sets it).", "",
             "| lanes | in flight | step (s) | lower bound (s) | step / bound | bound by | mean idle gap (s) | "
             "max idle gap (s) | mean compute (s) | link util. |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['lanes']} | {r['in_flight']} | {r['step_s']:.2f} | {r['lower_bound_s']:.2f} | "
              f"{r['step_s'] / r['lower_bound_s']:.2f} | {r['bound_by']} | {r['idle_gap_mean_s']:.2f} | "
              f"{r['idle_gap_max_s']:.2f} | {r['compute_mean_s']:.3f} | {r['link_utilisation']:.2f} |"
              for r in data["timeline"]]
    if data.get("flower"):
        lines += ["", "Flower (`fedfusion run units units.steps=3 units.micro_batches=2 units.in_flight=N`, 8 simulated "
                  "nodes; virtual seconds for devices that hold one message at a time (`units.lanes: 1`, Flower's "
                  "SuperNode), wall seconds on this machine's shared cores; in_flight 0 = all):", "",
                  "| in_flight | step | train loss | virtual (s) | step / bound | wall (s) |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['in_flight']} | {r['step']} | {r['train_loss']:.6f} | {r['virtual_s']:.2f} | "
                  f"{r['virtual_s'] / r['virtual_bound_s']:.2f} | {r['wall_s']:.1f} |" for r in data["flower"]]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flower", action="store_true", help="also run the units recipe on Flower (minutes)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    data = {"command": "python benchmarks/units_inflight.py" + (" --flower" if args.flower else ""),
            "timeline": timeline(), "flower": flower() if args.flower else []}
    write_pair(args.out, "units_inflight", data, markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
