"""The units mode at the seed's scale: TinyLlama-1.1B, OPT-1.3B and Llama-2-7B shapes on 64 to 4,096 phones,
laptops or a mixed fleet, against a pipeline + data-parallel schedule (DTFM's manner) on the same devices and
links and against one cloud GPU (A5000, H100).

    python benchmarks/units_scale.py [--models ...] [--fleets ...] [--devices 64 256 1024 4096] [--out ...]

Every device is a catalog tier (``fedfusion/catalog/devices.yaml``) through ``units.from_catalog``: phones at
10 MB/s down and 2 MB/s up (the seed paper's; the catalog's phone with its uplink set to 16 Mb/s), laptops at the
catalog's 10 MB/s each way, a mixed fleet of half phones, 30 % laptops and 20 % desktops; 50 ms RTT and 5 ms per
message. Batch 8 x 1024 tokens, every linear layer offloaded, float32 on the wire, on-device accumulation, devices
that take their next message while they compute (``lanes=0``, the seed paper's runtime), the server
``cloud-a100`` (10 Gb/s each way: ``units.server_device``'s default), its own compute and checks between phases and
AdamW after the last (``ledger.server_timeline``).

The units step is the timeline's (``fedfusion.units.timeline``, the model ``fedfusion plan`` and every run's
``virtual_s`` use), the micro-batch count the one ``timeline.choose_micro_batches`` picks over the batch's divisors.
A whole model's phases are too many to simulate on thousands of devices on two cores, so each setting runs the
model cut to one and to two decoder layers (the lm_head and the server's work kept) and extends the difference to
every layer: exact where every layer's phases take the same time (one micro-batch: the phases run one after another
and every layer's are alike), and checked against the whole model on 64 devices (the table's last section). Bytes,
busy times and energy are sums over phases, so linear in the layers; the lower bound is the largest of such sums,
so its extension stays a lower bound. Energy: each device's compute and transfers priced with ``price_work`` on its
tier, as every ledger row, plus the server's (``ledger.price_server``).

Baselines: ``fedfusion.units.baselines.plan_pipeline`` (its docstring says what it models and leaves out) on the
same devices; the A5000 as ``ledger.price_server``'s cloud step (the catalog's ``cloud-a5000``, 20 TFLOP/s
sustained, below the datasheet's 27.8 fp32 peak); the H100 at the rate measured for a whole step in
``benchmarks/results/cuda_step.json`` (the 168M target in float32), both on the units step's FLOPs (the GEMMs once
and the server's compute), each with whether float32 AdamW training of the model fits its memory. Writes
``units_scale.json`` and ``units_scale.md`` (rewritten after every setting, so a stopped run leaves its rows).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_files import run_facts, write_pair  # noqa: E402

from fedfusion.devices.catalog import Device, load_catalog  # noqa: E402
from fedfusion.devices.energy import price_work  # noqa: E402
from fedfusion.units.baselines import ModelShape, PipelineCost, gpu_step, plan_pipeline  # noqa: E402
from fedfusion.units.devices import UnitDevice, from_catalog, server_from_catalog  # noqa: E402
from fedfusion.units.ledger import price_server, server_timeline  # noqa: E402
from fedfusion.units.phases import WEIGHT_GRADIENT, Phase, llama_phases, server_flops  # noqa: E402
from fedfusion.units.timeline import StepTiming, choose_micro_batches, simulate  # noqa: E402
from fedfusion.units.verify import check_flops  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BATCH, SEQ = 8, 1024
MODELS = {m.name: m for m in (
    ModelShape("TinyLlama-1.1B", hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab=32000),
    ModelShape("OPT-1.3B", hidden=2048, intermediate=8192, layers=24, heads=32, kv_heads=32, vocab=50272, gated=False),
    ModelShape("Llama-2-7B", hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32, vocab=32000))}
FLEETS = {"phones": {"phone": 1.0}, "laptops": {"laptop": 1.0}, "mixed": {"phone": 0.5, "laptop": 0.3, "desktop": 0.2}}
PHONE_UP_MBPS = 16.0  # 2 MB/s: the seed paper's phone uplink
SERVER, CLOUD, H100 = "cloud-a100", "cloud-a5000", "cloud-h100"
CUDA_STEP = RESULTS / "cuda_step.json"


def tiers() -> dict[str, Device]:
    """The catalog, its phone with the seed paper's 2 MB/s uplink."""
    catalog = load_catalog()
    return {**catalog, "phone": replace(catalog["phone"], up_mbps=PHONE_UP_MBPS)}


def fleet(mix: dict[str, float], n: int) -> list[str]:
    """``n`` tier names in the shares of ``mix`` (largest remainders)."""
    exact = {t: share * n for t, share in mix.items()}
    counts = {t: int(x) for t, x in exact.items()}
    for t in sorted(exact, key=lambda t: counts[t] - exact[t])[:n - sum(counts.values())]:
        counts[t] += 1
    return [t for t, c in counts.items() for _ in range(c)]


def phases(shape: ModelShape, layers: int, micro: int) -> list[Phase]:
    """One micro-batch's phases of ``shape`` cut to ``layers`` decoder layers."""
    return llama_phases(hidden=shape.hidden, intermediate=shape.intermediate, layers=layers, heads=shape.heads,
                        kv_heads=shape.kv_heads, vocab=shape.vocab, tokens=BATCH * SEQ // micro, mode="all",
                        gated=shape.gated)


def server_work(shape: ModelShape, micro: int, server: Device) -> dict[str, Any]:
    """The whole model's server work at ``micro`` micro-batches: its own FLOPs, its checks' (a summed weight
    gradient checked once per step, as ``analysis.units_plan.units_work``), the GEMMs' FLOPs, the seconds between
    phases and of the optimizer."""
    full = phases(shape, shape.layers, micro)
    own = server_flops(hidden=shape.hidden, intermediate=shape.intermediate, layers=shape.layers, heads=shape.heads,
                       kv_heads=shape.kv_heads, vocab=shape.vocab, tokens=BATCH * SEQ, seq=SEQ, params=shape.params,
                       gated=shape.gated)
    verify = 0.0
    for shapes, specs in full:
        for g, spec in zip(shapes, specs):
            summed = micro > 1 and spec == WEIGHT_GRADIENT
            verify += check_flops(g.m, g.n, g.k * micro) if summed else micro * check_flops(g.m, g.n, g.k)
    gap_s, optimizer_s = server_timeline(server, own, verify, len(full) * micro)
    return {"own": own, "verify": verify, "gap_s": gap_s, "optimizer_s": optimizer_s,
            "unit_flops": float(micro * sum(g.flops for shapes, _ in full for g in shapes))}


def device_energy(timing: StepTiming, devices: list[UnitDevice], names: list[str], catalog: dict[str, Device]) -> float:
    """Wall joules of the devices' compute and transfers, ``price_work`` on each tier (sums per tier: it is linear)."""
    total = 0.0
    for tier in set(names):
        idx = [i for i, t in enumerate(names) if t == tier]
        flops = sum(float(timing.compute_s[i]) * devices[i].flops for i in idx)
        down, up = (int(sum(float(a[i]) for i in idx)) for a in (timing.down_bytes, timing.up_bytes))
        total += price_work(catalog[tier], flops, down, up).wall_j
    return total


def extend(one: float, two: float, layers: int) -> float:
    """A quantity at one and two layers extended linearly to ``layers``."""
    return one + (layers - 1) * (two - one)


def units_step(shape: ModelShape, names: list[str], catalog: dict[str, Device]) -> dict[str, Any]:
    """The units mode's step of ``shape`` on devices of tiers ``names`` (the module's docstring)."""
    devices = [from_catalog(catalog[t], name=t) for t in names]
    server = catalog[SERVER]
    link = server_from_catalog(server)
    works: dict[int, dict[str, Any]] = {}

    def work(m: int) -> dict[str, Any]:
        if m not in works:
            works[m] = server_work(shape, m, server)
        return works[m]

    common: dict[str, Any] = dict(accumulate=True, lanes=0, server=link)
    micro, timings = choose_micro_batches(devices, lambda m: phases(shape, 2, m), BATCH,
                                          kwargs_for=lambda m: {"server_gap_s": work(m)["gap_s"]}, **common)
    two = timings[micro]
    one = simulate(devices, [phases(shape, 1, micro)] * micro, server_gap_s=work(micro)["gap_s"], **common)
    w, layers = work(micro), shape.layers
    opt = w["optimizer_s"]
    step = extend(one.step_s, two.step_s, layers) + opt
    down = extend(float(one.down_bytes.sum()), float(two.down_bytes.sum()), layers)
    up = extend(float(one.up_bytes.sum()), float(two.up_bytes.sum()), layers)
    priced = price_server(server, catalog[CLOUD], w["own"], w["verify"], int(down), int(up), w["unit_flops"])
    busy = max(extend(one.server_send_busy_s, two.server_send_busy_s, layers),
               extend(one.server_recv_busy_s, two.server_recv_busy_s, layers))
    return {"micro_batches": micro, "step_s": step,
            "lower_bound_s": extend(one.lower_bound_s, two.lower_bound_s, layers) + opt,
            "bound_by": two.bound_by, "down_gb": down / 1e9, "up_gb": up / 1e9, "server_link_utilisation": busy / step,
            "devices_used": two.devices_used,
            "device_energy_j": extend(device_energy(one, devices, names, catalog),
                                      device_energy(two, devices, names, catalog), layers),
            "server_energy_j": priced.energy_j, "cloud_step_s": priced.cloud_step.compute_s,
            "cloud_energy_j": priced.cloud_step.wall_j, "step_flops": w["unit_flops"] + sum(w["own"].values()),
            "chosen_among": {m: t.step_s for m, t in timings.items()}}


def whole(shape: ModelShape, names: list[str], catalog: dict[str, Device], micro: int) -> float:
    """The whole model's units step at ``micro`` micro-batches, every layer simulated (to check the extension)."""
    devices = [from_catalog(catalog[t], name=t) for t in names]
    server = catalog[SERVER]
    w = server_work(shape, micro, server)
    timing = simulate(devices, [phases(shape, shape.layers, micro)] * micro, server_gap_s=w["gap_s"],
                      optimizer_s=w["optimizer_s"], accumulate=True, lanes=0, server=server_from_catalog(server))
    return timing.step_s


def pipeline(shape: ModelShape, names: list[str], catalog: dict[str, Device]) -> dict[str, Any]:
    """The pipeline + data-parallel baseline on the same devices: its plan, step, bytes and energy."""
    cost: PipelineCost | None = plan_pipeline(shape, [from_catalog(catalog[t], name=t) for t in names],
                                              batch=BATCH, seq=SEQ)
    if cost is None:
        return {"fits": False}
    energy = sum(price_work(catalog[d.name], f, int(down), int(up)).wall_j
                 for holders, f, down, up in zip(cost.holders, cost.flops, cost.bytes_down, cost.bytes_up)
                 for d in holders)
    return {"fits": True, "step_s": cost.step_s, "stages": cost.stages, "replicas": cost.replicas,
            "micro_batches": cost.micro_batches, "micro_tokens": cost.micro_tokens, "checkpoint": cost.checkpoint,
            "layers": list(cost.layers), "devices_used": cost.devices_used, "forward_s": cost.forward_s,
            "backward_s": cost.backward_s, "sync_s": cost.sync_s,
            "gb_moved": sum(cost.replicas * (d + u) for d, u in zip(cost.bytes_down, cost.bytes_up)) / 2e9,
            "energy_j": energy}


def gpus(shape: ModelShape, catalog: dict[str, Device], step_flops: float) -> dict[str, Any]:
    """The step on the A5000 (catalog rate) and the H100 (the rate measured in cuda_step.json), priced and
    checked for memory."""
    measured = next(r for r in json.loads(CUDA_STEP.read_text())["rows"]
                    if r["target"] == "hidden1024" and r["dtype"] == "float32")
    out = {}
    for key, tier in ((CLOUD, catalog[CLOUD]), (H100, replace(catalog[H100], tflops=measured["achieved_tflops"]))):
        fit = gpu_step(shape, key, tier.tflops * 1e12, tier.memory_gb * 1e9, batch=BATCH, seq=SEQ,
                       step_flops=step_flops)
        cost = price_work(tier, step_flops, 0, 0)
        out[key] = {"step_s": cost.compute_s, "energy_j": cost.wall_j, "tflops": tier.tflops,
                    "needs_gb": fit.needs_bytes / 1e9, "memory_gb": tier.memory_gb, "fits": fit.fits}
    return out


def measure(models: list[str], fleets: list[str], counts: list[int], out: Path, facts: dict[str, Any]) -> dict:
    """Every setting, smallest first; the results rewritten after each."""
    catalog, start = tiers(), time.time()
    data: dict[str, Any] = {**facts, "batch": BATCH, "seq": SEQ, "rows": [], "gpus": {}, "checks": [],
                            "complete": False}
    for n in counts:
        for name in models:
            shape = MODELS[name]
            for fl in fleets:
                names = fleet(FLEETS[fl], n)
                t0 = time.time()
                units = units_step(shape, names, catalog)
                row = {"model": name, "params": shape.params, "fleet": fl, "devices": n, "units": units,
                       "pipeline": pipeline(shape, names, catalog), "sim_s": time.time() - t0}
                data["gpus"].setdefault(name, gpus(shape, catalog, units["step_flops"]))
                data["rows"].append(row)
                if n == min(counts):  # the extension against every layer simulated
                    full = whole(shape, names, catalog, units["micro_batches"])
                    data["checks"].append({"model": name, "fleet": fl, "devices": n,
                                           "micro_batches": units["micro_batches"], "extended_s": units["step_s"],
                                           "whole_s": full})
                print(json.dumps({k: v for k, v in row.items() if k != "units"} | {
                    "step_s": units["step_s"], "micro": units["micro_batches"]}), flush=True)
                data["seconds"] = time.time() - start
                write_pair(out, "units_scale", data, markdown(data), quiet=True)
    data["complete"] = True
    return data


def markdown(data: dict) -> str:
    rows, gpu = data["rows"], data["gpus"]
    lines = ["# units mode at the seed's scale, against a pipeline and one cloud GPU", "",
             f"Machine: {data['machine']}; {data['seconds']:.0f} s in all" +
             ("" if data["complete"] else " (stopped before every setting ran)") + ".", "",
             f"Batch {data['batch']} x {data['seq']} tokens, float32, every linear layer offloaded; phones 10 MB/s "
             "down / 2 MB/s up, laptops 10 MB/s each way, the mixed fleet half phones, 30 % laptops, 20 % desktops "
             "(the catalog's tiers), 50 ms RTT, 5 ms per message; the server `cloud-a100`, 10 Gb/s each way. Units: "
             "the timeline's step (the micro-batch count `choose_micro_batches` picks on the two-layer model), its "
             "lower bound and what sets it, the bytes the devices download and upload, the server's busier link's "
             "utilisation, the devices' and the server's energy; devices that take their next message while they "
             "compute (the seed paper's runtime; SuperNodes, which approach it on Flower, are not swept). The "
             "timeline runs the model cut to one and two layers and extends the difference to every layer (the last "
             "table checks it). Pipeline: `fedfusion.units.baselines.plan_pipeline` on the same devices and links "
             "(stages x replicas x micro-batches per replica, ckpt: activation checkpointing; 'does not fit': no "
             "stage count fits the devices' memory). GPUs: the same step's FLOPs on one A5000 (catalog, 20 TFLOP/s) "
             "and one H100 at the rate measured for the 168M target's whole step in cuda_step.md (larger GEMMs run "
             "faster, so this overstates the H100's step). Ratios above 1: the units mode is slower.", "",
             "| model | fleet | devices | micro-batches | step (s) | lower bound (s) | step / bound | bound by | "
             "GB down | GB up | server link util. | energy (kJ) | pipeline step (s) | S x D x M | devices used | "
             "pipeline energy (kJ) | units / pipeline | units / A5000 | units / H100 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        u, p, g = r["units"], r["pipeline"], gpu[r["model"]]
        pipe = (f"{p['step_s']:.1f} | {p['stages']} x {p['replicas']} x {p['micro_batches']}"
                f"{' (ckpt)' if p['checkpoint'] else ''} | {p['devices_used']} | {p['energy_j'] / 1e3:.1f} | "
                f"{u['step_s'] / p['step_s']:.2f}" if p["fits"] else "does not fit | | | |")
        lines.append(f"| {r['model']} | {r['fleet']} | {r['devices']} | {u['micro_batches']} | {u['step_s']:.1f} | "
                     f"{u['lower_bound_s']:.1f} | {u['step_s'] / u['lower_bound_s']:.2f} | {u['bound_by']} | "
                     f"{u['down_gb']:.0f} | {u['up_gb']:.0f} | {u['server_link_utilisation']:.2f} | "
                     f"{(u['device_energy_j'] + u['server_energy_j']) / 1e3:.1f} | {pipe} | "
                     f"{u['step_s'] / g[CLOUD]['step_s']:.0f} | {u['step_s'] / g[H100]['step_s']:.0f} |")
    lines += ["", "One GPU, the same step (FLOPs at the rate; memory: float32 AdamW training with activation "
              "checkpointing, `estimate_memory`):", "",
              "| model | params | step TFLOP | A5000 step (s) | A5000 energy (kJ) | A5000 fits (needs / has GB) | "
              "H100 step (s) | H100 TFLOP/s (measured) | H100 fits (needs / has GB) |",
              "|---|---|---|---|---|---|---|---|---|"]
    flops = {r["model"]: (r["params"], r["units"]["step_flops"]) for r in rows}
    for name, g in gpu.items():
        a, h = g[CLOUD], g[H100]
        lines.append(f"| {name} | {flops[name][0] / 1e9:.2f} B | {flops[name][1] / 1e12:.1f} | {a['step_s']:.2f} | "
                     f"{a['energy_j'] / 1e3:.2f} | {'yes' if a['fits'] else 'no'} ({a['needs_gb']:.0f} / "
                     f"{a['memory_gb']:.0f}) | {h['step_s']:.2f} | {h['tflops']:.1f} | "
                     f"{'yes' if h['fits'] else 'no'} ({h['needs_gb']:.0f} / {h['memory_gb']:.0f}) |")
    if data["checks"]:
        lines += ["", "The layer extension against the whole model simulated (smallest device count):", "",
                  "| model | fleet | devices | micro-batches | extended step (s) | whole model (s) | difference |",
                  "|---|---|---|---|---|---|---|"]
        for c in data["checks"]:
            lines.append(f"| {c['model']} | {c['fleet']} | {c['devices']} | {c['micro_batches']} | "
                         f"{c['extended_s']:.2f} | {c['whole_s']:.2f} | "
                         f"{c['extended_s'] / c['whole_s'] - 1:+.2%} |")
    return "\n".join(lines + ["", "## Against Cleave's claims", ""] + verdict(data)) + "\n"


def verdict(data: dict) -> list[str]:
    """Plain statements computed from the rows: each claim, whether it holds under the model, and why."""
    rows, gpu = data["rows"], data["gpus"]
    if not rows:
        return []
    both = [r for r in rows if r["pipeline"]["fits"]]
    ratio = {id(r): r["units"]["step_s"] / r["pipeline"]["step_s"] for r in both}  # < 1: the units mode is faster
    faster = [r for r in both if ratio[id(r)] < 1]
    claim = [r for r in both if ratio[id(r)] <= 1 / 4]
    out = [f"- 4-10x faster than an edge baseline: does not hold. The units step beats the pipeline in {len(faster)} "
           f"of {len(both)} settings where a pipeline fits, by 4x or more in {len(claim)}; the units step is "
           f"{min(ratio.values()):.2f}-{max(ratio.values()):.2f}x the pipeline's." if both else
           "- 4-10x faster than an edge baseline: no pipeline fits any setting."]
    nofit = [r for r in rows if not r["pipeline"]["fits"]]
    if nofit:
        out.append(f"- In {len(nofit)} settings no pipeline fits ("
                   + ", ".join(sorted({f"{r['model']} on {r['fleet']}" for r in nofit}))
                   + "): one layer's float32 weights, gradients and AdamW state with its activations exceed the "
                   "device's memory, while the units mode's tiles fit it; there the units mode trains and the "
                   "baseline cannot (without offloading its state), which is the one place it wins.")
    for key, label in ((CLOUD, "A5000"), (H100, "H100")):
        r = [q["units"]["step_s"] / gpu[q["model"]][key]["step_s"] for q in rows]
        fits = sorted(m for m, g in gpu.items() if g[key]["fits"])
        out.append(f"- Runtime equal to a cloud GPU ({label}): does not hold. The units step is {min(r):.0f}-"
                   f"{max(r):.0f}x the {label}'s; float32 AdamW training of " +
                   (", ".join(fits) if fits else "none of the models") + f" fits the {label}'s memory.")
    server = [r for r in rows if r["units"]["bound_by"].startswith("server")]
    moved = [r["units"]["down_gb"] + r["units"]["up_gb"] for r in rows]
    piped = [r["pipeline"]["gb_moved"] for r in both]
    out.append(f"- Why: each phase sends every device its rows of the activations (and each step every weight block "
               f"once), so the units mode moves {min(moved):.0f}-{max(moved):.0f} GB a step, and more with more "
               f"devices, against {min(piped):.2f}-{max(piped):.2f} GB for the pipeline, whose weights stay on the "
               f"devices and only activations cross between stages. On {min(r['devices'] for r in rows)} devices the "
               f"devices' downlinks bound the step; {len(server)} of {len(rows)} settings are bound by the server's "
               f"10 Gb/s send link, which every byte crosses. The step is "
               f"{min(r['units']['step_s'] / r['units']['lower_bound_s'] for r in rows):.2f}-"
               f"{max(r['units']['step_s'] / r['units']['lower_bound_s'] for r in rows):.2f}x its lower bound: no "
               "schedule of the same messages closes the gap; only fewer bytes would.")
    gain = [min(r["units"]["chosen_among"].values()) / r["units"]["chosen_among"][str(r["units"]["micro_batches"])]
            for r in rows if str(r["units"]["micro_batches"]) in r["units"]["chosen_among"]]
    if gain:
        out.append(f"- The planner's micro-batch count (the smallest at >= 0.70 busiest-link utilisation without a "
                   f"slower step than one micro-batch's) is not always the fastest: on the two-layer model it is "
                   f"chosen on, the fastest count's step is {min(gain):.2f}-{max(gain):.2f}x the chosen one's, far "
                   "from the gaps above.")
    energy = [(r["units"]["device_energy_j"] + r["units"]["server_energy_j"]) / r["pipeline"]["energy_j"]
              for r in both]
    if energy:
        out.append(f"- Energy: the units step takes {min(energy):.0f}-{max(energy):.0f}x the pipeline's joules "
                   "(both priced with price_work: compute and radio time, no idle power; the units mode's with the "
                   "server's own work).")
    for name in gpu:
        mine = [r for r in rows if r["model"] == name]
        top = min(mine, key=lambda r: r["units"]["step_s"])
        most = max(r["devices"] for r in mine)
        out.append(f"- {name}: fastest units step {top['units']['step_s']:.1f} s on {top['devices']} "
                   f"{top['fleet']}; on {most} devices: " +
                   ", ".join(f"{r['fleet']} {r['units']['step_s']:.0f} s" for r in mine if r["devices"] == most) + ".")
    return out


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--fleets", nargs="+", choices=list(FLEETS), default=list(FLEETS))
    parser.add_argument("--devices", nargs="+", type=int, default=[64, 256, 1024, 4096])
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    facts = run_facts("benchmarks/units_scale.py", argv)
    data = measure(args.models, args.fleets, sorted(args.devices), args.out, facts)
    write_pair(args.out, "units_scale", data, markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
