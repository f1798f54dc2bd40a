"""The units mode's busiest-link utilisation against the micro-batch count (1, 2, 4, 8: the divisors of batch 8),
in the same 20 settings as ``benchmarks/units.py`` (virtual time, ``fedfusion.units.timeline``, on-device
accumulation), and what a per-step choice of the count could reach, on a device runtime that takes its next message while it works
(the timeline's default), on one that holds 1 or 2 messages at a time (``simulate(lanes=...)``; Flower 1.42's
SuperNode holds one: it pulls, computes, replies, then pulls again), and on devices that each run 2 or 4 SuperNodes
(``simulate(supernodes=k)``, ``units.supernodes`` on Flower: micro-batch c goes to node c mod k, each keeps its own
weight blocks and sums).

    python benchmarks/units_microbatches.py [--markdown-only] [--out benchmarks/results]

Per setting it reports the busiest link's busy seconds B (bytes / bandwidth, the larger of down and up, the server's
10 Gb/s links included: ``units.DEFAULT_SERVER``) and the
latency chain L = phases x (RTT + per-message overhead): a micro-batch's phases are dependent, so no step is shorter
than L whatever the count, and utilisation is at most B / L. Where B < 0.70 L no count reaches 0.70 (more
micro-batches only add bytes and per-message overhead). "auto" is ``timeline.choose_micro_batches``: the smallest
count whose simulated utilisation reaches 0.70 without a slower step than 1, else the one with the shortest step.
Writes ``units_microbatches.json`` and ``units_microbatches.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from units import BATCH, RESULTS, SEQ, TARGETS, Target, fleets  # noqa: E402

from fedfusion.units.timeline import choose_micro_batches  # noqa: E402

COUNTS = [m for m in range(1, BATCH + 1) if BATCH % m == 0]  # what choose_micro_batches tries
# beside the default's no limit: messages a device holds at once, or SuperNodes per device (label -> simulate's kwargs)
VARIANTS: dict[str, dict[str, int]] = {"2 lanes": {"lanes": 2}, "1 lane": {"lanes": 1},
                                       "2 SuperNodes": {"supernodes": 2},
                                       "4 SuperNodes": {"supernodes": 4}}


def summary(timings: dict) -> dict[str, dict[str, float]]:
    """Per count: the step, its lower bound, the busiest link's utilisation and busy seconds (the server's links
    included), and the server's links' utilisation."""
    return {str(m): {"step_s": r.step_s, "lower_bound_s": r.lower_bound_s, "link_utilisation": r.link_utilisation,
                     "server_link_utilisation": r.server_link_utilisation,
                     "busiest_link_s": float(max(r.down_busy_s.max(), r.up_busy_s.max(), r.server_send_busy_s,
                                                 r.server_recv_busy_s))}
            for m, r in timings.items()}


def measure() -> dict:
    """Every setting's timings at each count, for the default runtime and each variant."""
    t_start, rows = time.perf_counter(), []
    for target in TARGETS:
        for fleet, (proto, _) in fleets().items():
            for n in [4, 16, 64, 256, 1024]:
                def phases_for(m: int, t: Target = target) -> list:
                    return t.phases(BATCH * SEQ // m)

                auto, timings = choose_micro_batches([proto] * n, phases_for, BATCH, accumulate=True)
                per = summary(timings)
                lat = (proto.rtt_s + proto.overhead_s) * timings[1].phases_per_chain
                variants = {}
                for label, kwargs in VARIANTS.items():
                    chosen, limited = choose_micro_batches([proto] * n, phases_for, BATCH, accumulate=True, **kwargs)
                    variants[label] = {"auto": chosen, "counts": summary(limited)}
                rows.append({"target": target.name, "fleet": fleet, "devices": n, "latency_chain_s": lat,
                             "ceiling": min(1.0, max(p["busiest_link_s"] for p in per.values()) / lat),
                             "auto": auto, "counts": per, "variants": variants})
                print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("counts", "variants")}), flush=True)
    return {"wall_s": time.perf_counter() - t_start, "rows": rows}


def markdown(data: dict) -> str:
    """The report: the counts' table, the findings, the variants' table and summary."""
    wall, rows = data["wall_s"], data["rows"]
    lines = ["# units mode: busiest-link utilisation against the micro-batch count", "",
             f"Command: `{data.get('command', 'python benchmarks/units_microbatches.py')}` ({wall:.0f} s). Settings as in "
             "units.md (batch 8 x 128 "
             "tokens, on-device accumulation, the server's 10 Gb/s links queued). B: the busiest link's busy seconds "
             "(the server's included) at 1 micro-batch; L: phases x (RTT + "
             "per-message overhead), the chain no count shortens; ceiling: max B over the counts / L (capped at 1). "
             "auto: `timeline.choose_micro_batches`, the smallest count at >= 0.70 utilisation without a slower step "
             "than 1, else the one with the shortest step.", "",
             "| target | fleet | devices | B (s) | L (s) | ceiling | " +
             " | ".join(f"util. / step (s) at {m}" for m in COUNTS) + " | auto |",
             "|---|---|---|---|---|---|" + "---|" * len(COUNTS) + "---|"]
    for r in rows:
        c = r["counts"]
        lines.append(f"| {r['target']} | {r['fleet']} | {r['devices']} | {c['1']['busiest_link_s']:.2f} | "
                     f"{r['latency_chain_s']:.2f} | {r['ceiling']:.2f} | " +
                     " | ".join(f"{c[str(m)]['link_utilisation']:.2f} / {c[str(m)]['step_s']:.2f}" for m in COUNTS) +
                     f" | {r['auto']} |")
    auto = [r["counts"][str(r["auto"])] for r in rows]
    four = [r["counts"]["4"] for r in rows]
    bound = [r for r in rows if r["ceiling"] < 0.7]
    lines += ["", "## Findings", "",
              f"- 4 micro-batches: {sum(p['link_utilisation'] >= 0.7 for p in four)} of {len(rows)} settings at >= 0.70 "
              f"utilisation; the auto count: {sum(p['link_utilisation'] >= 0.7 for p in auto)} of {len(rows)}, step / lower "
              f"bound {min(p['step_s'] / p['lower_bound_s'] for p in auto):.2f}-"
              f"{max(p['step_s'] / p['lower_bound_s'] for p in auto):.2f}; "
              f"auto's step vs 1 micro-batch: {min(a['step_s'] / r['counts']['1']['step_s'] for a, r in zip(auto, rows)):.2f}-"
              f"{max(a['step_s'] / r['counts']['1']['step_s'] for a, r in zip(auto, rows)):.2f}x.",
              f"- {len(bound)} settings are latency-bound: the busiest link carries less than 0.70 x L over the whole step "
              "for every count (" + ", ".join(f"{r['target']} {r['fleet'].split()[0]} {r['devices']}: "
                                               f"{r['ceiling']:.2f}" for r in bound) +
              "); no micro-batch count can lift them to 0.70, only fewer phases, a shorter RTT or bigger tiles "
              "(fewer devices)."]
    never = [r for r in rows if r["ceiling"] >= 0.7 and
             max(p["link_utilisation"] for p in r["counts"].values()) < 0.7]
    if never:
        lines.append(f"- {len(never)} more stay below 0.70 at every count although B >= 0.70 L (" +
                     ", ".join(f"{r['target']} {r['fleet'].split()[0]} {r['devices']}: best "
                               f"{max(p['link_utilisation'] for p in r['counts'].values()):.2f}" for r in never) +
                     "): each micro-batch adds phases x per-message overhead on every device's downlink "
                     "(not link bytes), and a chain's phases wait on each other.")
    lines += ["", "## A device that holds fewer messages at once", "",
              "The same settings when a device holds at most k messages (`timeline.simulate(lanes=k)`): a message "
              "starts its download only when the reply of the message k before it on that device is back. 1 lane is "
              "Flower 1.42's SuperNode (pull, compute, reply, then pull the next); no limit is the table above. "
              "k SuperNodes (`simulate(supernodes=k)`, `units.supernodes` on Flower): each device runs k, micro-batch "
              "c goes to node c mod k, each node holds one message and its own weight blocks and sums (weights travel "
              "k times a step; more bytes also raise utilisation, so compare the steps). "
              "Per variant: the auto count, its utilisation / step "
              "(s), and the best utilisation at any count.", "",
              "| target | fleet | devices | step at 1 (s) | no limit: auto, util. / step | " +
              " | ".join(f"{k}: auto, util. / step, best util." for k in VARIANTS) + " |",
              "|---|---|---|---|---|" + "---|" * len(VARIANTS)]
    for r in rows:
        cells = [f"{r['auto']}, {r['counts'][str(r['auto'])]['link_utilisation']:.2f} / "
                 f"{r['counts'][str(r['auto'])]['step_s']:.2f}"]
        for k in VARIANTS:
            lane = r["variants"][k]
            pick = lane["counts"][str(lane["auto"])]
            cells.append(f"{lane['auto']}, {pick['link_utilisation']:.2f} / {pick['step_s']:.2f}, "
                         f"{max(p['link_utilisation'] for p in lane['counts'].values()):.2f}")
        lines.append(f"| {r['target']} | {r['fleet']} | {r['devices']} | {r['counts']['1']['step_s']:.2f} | " +
                     " | ".join(cells) + " |")
    lines += [""]
    for k in VARIANTS:
        picks = [(r, r["variants"][k]) for r in rows]
        reach = sum(lane["counts"][str(lane["auto"])]["link_utilisation"] >= 0.7 for _, lane in picks)
        one = sum(lane["auto"] == 1 for _, lane in picks)
        ratio = [lane["counts"][str(lane["auto"])]["step_s"] / r["counts"][str(r["auto"])]["step_s"] for r, lane in picks]
        bound = [lane["counts"][str(lane["auto"])]["step_s"] / lane["counts"][str(lane["auto"])]["lower_bound_s"]
                 for _, lane in picks]
        vs_one = [lane["counts"][str(lane["auto"])]["step_s"] /
                  r["variants"]["1 lane"]["counts"][str(r["variants"]["1 lane"]["auto"])]["step_s"] for r, lane in picks]
        than_one = "" if k == "1 lane" else (f" and {min(vs_one):.2f}-{max(vs_one):.2f}x 1 lane's "
                                              f"({sum(x < 1 for x in vs_one)} faster)")
        lines.append(f"- {k}: the auto count reaches >= 0.70 utilisation in {reach} of {len(rows)} settings and "
                     f"is 1 in {one}; its step is {min(ratio):.2f}-{max(ratio):.2f}x the no-limit runtime's{than_one}, "
                     f"step / lower bound {min(bound):.2f}-{max(bound):.2f} ({sum(b > 1.5 for b in bound)} above 1.5).")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--markdown-only", action="store_true",
                        help="rewrite units_microbatches.md from units_microbatches.json")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    path = args.out / "units_microbatches.json"
    if args.markdown_only:
        data = json.loads(path.read_text())
    else:
        data = {"command": "python benchmarks/units_microbatches.py", **measure()}
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
    (args.out / "units_microbatches.md").write_text(markdown(data))


if __name__ == "__main__":
    main()
