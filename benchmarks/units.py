"""The units mode in process (no Flower): a step's virtual time and bytes against device count, a local torch
step and a cloud GPU, and the recovery from a device that dies mid-phase.

    python benchmarks/units.py [--quick] [--out benchmarks/results]

For each target (the quickstart's: hidden 128, 4 layers, 8 heads, MLP 512, vocab 100; a larger one: hidden 1024,
8 layers, 16 heads, MLP 2816, vocab 32000; both at batch 8 x 128 tokens, every linear layer offloaded) and each
fleet (phones at 10 MB/s down / 2 MB/s up, 50 ms RTT; laptops on a 1 Gb/s LAN, 2 ms RTT), behind a server with a
10 Gb/s link each way (``units.DEFAULT_SERVER``, the catalog's ``cloud-a100``: every device's bytes pass it), it
simulates one step with 4 ... 1,024 devices and 1 or 4 micro-batches in flight (``fedfusion.units.timeline``; with several, the
devices sum the weight-gradient tiles over the micro-batches and upload them once per step, ``units.accumulate``'s
default; 4 micro-batches are also priced without that), and the count ``units.micro_batches: 0`` takes there
(``timeline.choose_micro_batches`` over the divisors of the batch), and compares with

- one local torch step of the same model on this machine (measured; the larger model measured at fewer tokens
  and scaled linearly by tokens),
- an RTX A5000: the step's FLOPs (GEMMs + attention, x3 for forward + backward) at 27.8 TFLOP/s fp32 peak x 0.6
  sustained = 16.7 TFLOP/s (kernel launches and the optimizer ignored, so a lower bound).

The quickstart is also run for real through ``UnitEngine`` (tiles computed, serialised, Freivalds-checked) at
4, 16 and 64 devices: measured bytes against the closed form and the server's CPU time of the checks. Energy per
step uses the catalog's phone/laptop (train, radio, idle W) and ``cloud-a5000`` (train W) figures.
Writes ``units.json``, ``units.md`` and ``units.png`` (step time against device count per target and fleet).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fedfusion.devices.catalog import load_catalog
from fedfusion.units import UnitDevice, UnitEngine, install
from fedfusion.units.phases import llama_phases, server_flops
from fedfusion.units.timeline import Kill, chains_from_trace, choose_micro_batches, simulate
from fedfusion.units.verify import Freivalds

RESULTS = Path(__file__).resolve().parent / "results"
A5000_FP32_PEAK = 27.8e12
A5000_SUSTAINED = 0.6
BATCH, SEQ = 8, 128


@dataclass(frozen=True)
class Target:
    name: str
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int

    def config(self) -> LlamaConfig:
        return LlamaConfig(hidden_size=self.hidden, num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.heads, intermediate_size=self.intermediate, vocab_size=self.vocab,
                           max_position_embeddings=2 * SEQ)

    def phases(self, tokens: int) -> list:
        return llama_phases(hidden=self.hidden, intermediate=self.intermediate, layers=self.layers, heads=self.heads,
                            kv_heads=self.heads, vocab=self.vocab, tokens=tokens, mode="all")

    def flops(self, tokens: int) -> float:
        """GEMM FLOPs of the step (forward + both gradients) plus attention cores (QK^T, PV: 3x forward)."""
        gemm = sum(g.flops for shapes, _ in self.phases(tokens) for g in shapes)
        attention = server_flops(hidden=self.hidden, intermediate=self.intermediate, layers=self.layers,
                                 heads=self.heads, kv_heads=self.heads, vocab=self.vocab, tokens=tokens, seq=SEQ,
                                 params=0)["attention"]
        return float(gemm + attention)


TARGETS = [Target("quickstart", 128, 4, 8, 512, 100), Target("hidden1024", 1024, 8, 16, 2816, 32000)]


def fleets() -> dict[str, tuple[UnitDevice, str]]:
    """Fleet name -> (its device, the catalog tier its power figures come from)."""
    cat = load_catalog()
    phone = UnitDevice("phone", cat["phone"].memory_gb * 1e9, cat["phone"].tflops * 1e12, 10e6, 2e6,
                       rtt_s=0.05, overhead_s=0.005)
    laptop = UnitDevice("laptop", cat["laptop"].memory_gb * 1e9, cat["laptop"].tflops * 1e12, 125e6, 125e6,
                        rtt_s=0.002, overhead_s=0.002)
    return {"phones 10/2 MB/s": (phone, "phone"), "laptops 1 Gb/s LAN": (laptop, "laptop")}


def local_step_s(target: Target, tokens: int) -> float:
    """Best of three local AdamW steps (forward, backward, step) on this machine's CPU, one thread (CPU seconds)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(target.config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, target.vocab, (max(1, tokens // SEQ), min(SEQ, tokens)))
    best = float("inf")
    for _ in range(3):  # CPU seconds of this thread (torch runs on it alone): wall time on shared cores is noise
        t0 = time.thread_time()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        best = min(best, time.thread_time() - t0)
    return best


def check_cpu_s(target: Target, tokens: int, micro: int = 1) -> float:
    """CPU seconds of the server's Freivalds checks over one step of ``micro`` micro-batches, as the engine runs
    them when every tile is honest: each forward and input-gradient product once per micro-batch (its weight's
    vectors and ``|B| 1`` kept across them), each weight gradient once per step over the micro-batches' operands
    (``dY^T`` a transposed view, as the engine's; the engine's concatenation of them not timed). In process, one
    thread, no engine around it: a lower bound of the engine's own ``verify_s`` (``benchmarks/units_checks.py``)."""
    check, gen, total = Freivalds(seed=0), torch.Generator().manual_seed(0), 0.0
    weights: dict[str, torch.Tensor] = {}
    phases = target.phases(tokens // micro)
    for chain in range(micro):
        for shapes, specs in phases:
            for g, (_, _, b_key, b_t) in zip(shapes, specs):
                if b_key == "X":  # a weight gradient: checked once, at the step's last micro-batch, over all tokens
                    if chain < micro - 1:
                        continue
                    a = torch.randn(g.k * micro, g.m, generator=gen).T
                    b, weight = torch.randn(g.k * micro, g.n, generator=gen), None
                else:
                    base = weights.setdefault(b_key, torch.randn(*((g.n, g.k) if b_t else (g.k, g.n)), generator=gen))
                    a, b, weight = torch.randn(g.m, g.k, generator=gen), (base.T if b_t else base), (b_key, b_t)
                c = a @ b
                t0 = time.thread_time()
                check.check(a, b, c, weight=weight)
                total += time.thread_time() - t0
    return total


def energy_j(timing, tier, step_s: float) -> float:  # type: ignore[no-untyped-def]
    """Devices' energy over the step: compute at train W, link busy time at radio W, the rest of the step idle."""
    used = timing.down_bytes > 0
    busy = timing.compute_s[used] * tier.train_w + (timing.down_busy_s[used] + timing.up_busy_s[used]) * tier.radio_w
    idle = (step_s - timing.compute_s[used]).clip(min=0) * tier.idle_w
    return float(busy.sum() + idle.sum())


def sweep(counts: list[int], micro: list[int]) -> list[dict]:
    cat = load_catalog()
    rows = []
    for target in TARGETS:
        tokens = BATCH * SEQ
        for fleet, (proto, tier_name) in fleets().items():
            for n in counts:
                devs = [proto] * n
                for m in micro:
                    t0 = time.perf_counter()
                    r = simulate(devs, [target.phases(tokens // m)] * m, accumulate=True)
                    plain = simulate(devs, [target.phases(tokens // m)] * m) if m > 1 else r
                    rows.append({
                        "target": target.name, "fleet": fleet, "devices": n, "micro_batches": m,
                        "step_s": r.step_s, "lower_bound_s": r.lower_bound_s, "bound_by": r.bound_by,
                        "step_over_bound": r.step_over_bound, "link_utilisation": r.link_utilisation,
                        "server_link_utilisation": r.server_link_utilisation,
                        "devices_used": r.devices_used, "phases": r.phases_per_chain,
                        "down_mb_per_device_max": r.down_bytes.max() / 1e6,
                        "up_mb_per_device_max": r.up_bytes.max() / 1e6,
                        "down_gb_total": r.down_bytes.sum() / 1e9, "up_gb_total": r.up_bytes.sum() / 1e9,
                        "device_energy_j": energy_j(r, cat[tier_name], r.step_s), "sim_s": time.perf_counter() - t0,
                        # the same without on-device accumulation (each micro-batch uploads its weight-gradient tiles)
                        "no_accumulation": {"step_s": plain.step_s, "step_over_bound": plain.step_over_bound,
                                            "link_utilisation": plain.link_utilisation,
                                            "up_mb_per_device_max": plain.up_bytes.max() / 1e6},
                    })
                    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()}),
                          flush=True)
    return rows


def chosen(counts: list[int]) -> list[dict]:
    """Per setting the count ``units.micro_batches: 0`` takes (``timeline.choose_micro_batches`` over the divisors
    of the batch, on-device accumulation) and its step, beside the sweep's fixed counts."""
    rows = []
    for target in TARGETS:
        for fleet, (proto, _) in fleets().items():
            for n in counts:
                m, timings = choose_micro_batches([proto] * n, lambda k, t=target: t.phases(BATCH * SEQ // k), BATCH,
                                                  accumulate=True)
                r = timings[m]
                rows.append({"target": target.name, "fleet": fleet, "devices": n, "micro_batches": m,
                             "step_s": r.step_s, "lower_bound_s": r.lower_bound_s, "step_over_bound": r.step_over_bound,
                             "link_utilisation": r.link_utilisation,
                             "server_link_utilisation": r.server_link_utilisation})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def fixed(data: dict, r: dict, m: int) -> dict:
    """The sweep's row of ``r``'s setting at ``m`` micro-batches."""
    return next(q for q in data["sweep"] if q["micro_batches"] == m and
                (q["target"], q["fleet"], q["devices"]) == (r["target"], r["fleet"], r["devices"]))


def recovery(counts: list[int]) -> list[dict]:
    """A device killed halfway through the step: extra time against the phase deadline and a restart."""
    rows = []
    proto = fleets()["phones 10/2 MB/s"][0]
    for target in TARGETS:
        for n in counts:
            devs = [proto] * n
            for m in (1, 4):
                chains = [target.phases(BATCH * SEQ // m)] * m
                base = simulate(devs, chains, accumulate=True)
                kill = Kill(device=n // 2, at_s=0.5 * base.step_s)
                hit = simulate(devs, chains, kills=(kill,), accumulate=True)
                without = simulate(devs[:-1], chains, accumulate=True)
                active = [dl - t for t, dl in hit.phase_deadlines if t <= kill.at_s <= dl]
                rows.append({"target": target.name, "devices": n, "micro_batches": m, "step_s": base.step_s,
                             "killed_at_s": kill.at_s, "extra_s": hit.step_s - base.step_s,
                             "phase_deadline_s": max(active), "detected_after_s": hit.detected[kill.device] - kill.at_s,
                             "restart_extra_s": kill.at_s + without.step_s - base.step_s,
                             "redispatched_units": hit.redispatched})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def scenarios(counts: list[int]) -> list[dict]:
    """Where the mode could compete: a frozen base resident on the devices (no weight traffic, no weight
    gradients), and a first-principles estimate's setting (1.1B Llama, 8 x 1024 tokens, 64 phones at 10/2 MB/s)."""
    rows = []
    phone, laptop = fleets()["phones 10/2 MB/s"][0], fleets()["laptops 1 Gb/s LAN"][0]
    big = TARGETS[1]
    frozen = llama_phases(hidden=big.hidden, intermediate=big.intermediate, layers=big.layers, heads=big.heads,
                          kv_heads=big.heads, vocab=big.vocab, tokens=BATCH * SEQ, frozen=True)
    frozen_flops = sum(g.flops for shapes, _ in frozen for g in shapes) + 2 * big.layers * 2 * 2 * BATCH * SEQ * SEQ * big.hidden
    for fleet, dev in (("phones 10/2 MB/s", phone), ("laptops 1 Gb/s LAN", laptop)):
        for n in counts:
            r = simulate([dev] * n, [frozen], resident_weights=True)
            rows.append({"scenario": "hidden1024 frozen base resident on devices", "fleet": fleet, "devices": n,
                         "step_s": r.step_s, "down_mb_per_device_max": r.down_bytes.max() / 1e6,
                         "up_mb_per_device_max": r.up_bytes.max() / 1e6,
                         "a5000_step_s": frozen_flops / (A5000_FP32_PEAK * A5000_SUSTAINED)})
            print(json.dumps(rows[-1]), flush=True)
    tiny = llama_phases(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab=32000, tokens=8 * 1024)
    flops = sum(g.flops for shapes, _ in tiny for g in shapes) + 3 * 22 * 2 * 2 * 8 * 1024 * 1024 * 2048
    r = simulate([phone] * 64, [tiny])
    rows.append({"scenario": "first-principles estimate: 1.1B Llama, 8 x 1024 tokens, all linear", "fleet": "phones 10/2 MB/s",
                 "devices": 64, "step_s": r.step_s, "down_mb_per_device_max": r.down_bytes.max() / 1e6,
                 "up_mb_per_device_max": r.up_bytes.max() / 1e6,
                 "a5000_step_s": flops / (A5000_FP32_PEAK * A5000_SUSTAINED)})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def real_runs(counts: list[int]) -> list[dict]:
    """The quickstart through the real engine: bytes measured against the formula, the check's CPU time."""
    target, rows = TARGETS[0], []
    proto = fleets()["phones 10/2 MB/s"][0]
    ids = torch.randint(0, target.vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    for n in counts:
        torch.manual_seed(0)
        model, engine = LlamaForCausalLM(target.config()), UnitEngine([proto] * n)
        install(model, engine, "all")
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        wall = time.perf_counter() - t0
        dev = [abs(rec.down_bytes[d] / rec.formula_down[d] - 1) for rec in engine.trace for d in rec.down_bytes]
        dev += [abs(rec.up_bytes[d] / rec.formula_up[d] - 1) for rec in engine.trace for d in rec.up_bytes]
        timing = simulate(engine.devices, chains_from_trace(engine.trace))
        rows.append({"devices": n, "units": sum(len(r.plan.tiles) for r in engine.trace),
                     "bytes_vs_formula_max_rel": max(dev), "check_cpu_s": sum(r.verify_s for r in engine.trace),
                     "server_wall_s": sum(r.server_s for r in engine.trace), "emulated_wall_s": wall,
                     "virtual_step_s": timing.step_s,
                     "trace_equals_analytic": chains_from_trace(engine.trace)[0] == target.phases(BATCH * SEQ)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def references() -> dict[str, dict]:
    out = {}
    for target in TARGETS:
        tokens = BATCH * SEQ
        measured_tokens = tokens if target.hidden <= 256 else 2 * SEQ
        local = local_step_s(target, measured_tokens) * tokens / measured_tokens
        flops = target.flops(tokens)
        params = sum(p.numel() for p in LlamaForCausalLM(target.config()).parameters())
        out[target.name] = {"params": params, "tokens": tokens, "step_flops": flops, "local_step_s": local,
                            "local_measured_tokens": measured_tokens,
                            "a5000_step_s": flops / (A5000_FP32_PEAK * A5000_SUSTAINED),
                            "a5000_energy_j": flops / (A5000_FP32_PEAK * A5000_SUSTAINED) * load_catalog()[
                                "cloud-a5000"].train_w,
                            "check_cpu_s": check_cpu_s(target, tokens),
                            "check_cpu_s_4": check_cpu_s(target, tokens, 4)}
        print(target.name, json.dumps(out[target.name]), flush=True)
    return out


def markdown(data: dict) -> str:
    refs = data["references"]
    lines = ["# units mode: step time and bytes vs device count (in process, no Flower)", "",
             f"Machine: {data['machine']['cpu']}, {data['machine']['threads']} torch thread(s), shared with other "
             f"jobs; torch {data['machine']['torch']}.", "", f"Command: `{data['command']}`", "",
             "Settings: batch 8 x 128 tokens, every linear layer offloaded (8 phases per layer + lm_head), float32 "
             "on the wire, deadline 3x the predicted reply; with 4 micro-batches the devices sum the weight-gradient "
             "tiles on-device and upload them once per step (`units.accumulate`, the default; the last columns: "
             "without). Phones: 0.5 TFLOP/s (catalog `phone`), 10 MB/s down, "
             "2 MB/s up, 50 ms RTT, 5 ms per message. Laptops: 3 TFLOP/s (catalog `laptop`), 125 MB/s both ways, "
             "2 ms RTT, 2 ms per message. A5000: FLOPs / (27.8 TFLOP/s x 0.6), launches ignored. Local CPU step: "
             "CPU seconds of one thread (best of 3; hidden1024 measured at 2 x 128 tokens, scaled x4). Check CPU: the "
             "server's Freivalds checks (2 vectors) over the step in process with 1 and 4 micro-batches, as the engine "
             "orders them (forward and input-gradient products per micro-batch, a weight's check vectors kept across "
             "them; each weight gradient once, summed), one thread: a lower bound of the engine's own time. "
             "Server: a 10 Gb/s link each way (catalog `cloud-a100`), every message's download through its send "
             "link and every reply through its receive link (shared queues of the timeline). Lower bound: what no "
             "schedule of the step's messages beats under the timeline: the largest of every resource's busy time "
             "(a device's downlink with its message overheads, its uplink, its compute; the server's links) and a "
             "chain's phases x (RTT + overhead); 'bound by' names it. Step times are virtual (the timeline); only the "
             "real engine runs compute tiles.", "",
             "| target | params | step GFLOP | local CPU step (s) | A5000 step | A5000 energy (J) | check CPU (s) | "
             "check CPU, 4 micro-batches (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in refs.items():
        lines.append(f"| {name} | {r['params'] / 1e6:.2f} M | {r['step_flops'] / 1e9:.1f} | {r['local_step_s']:.2f}"
                     f" | {r['a5000_step_s'] * 1e3:.2f} ms | {r['a5000_energy_j']:.2f} | {r['check_cpu_s']:.3f} | "
                     f"{r['check_cpu_s_4']:.3f} |")
    lines += ["", "| target | fleet | devices | micro-batches | step (s) | lower bound (s) | step / bound | bound by | "
              "link util. | server link util. | down MB/device | up MB/device | down GB in all | vs local | vs A5000 | "
              "device energy (J) | no accum.: step (s) | link util. | up MB/device |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["sweep"]:
        ref, plain = refs[r["target"]], r["no_accumulation"]
        lines.append(f"| {r['target']} | {r['fleet']} | {r['devices']} | {r['micro_batches']} | {r['step_s']:.2f} | "
                     f"{r['lower_bound_s']:.2f} | {r['step_over_bound']:.2f} | {r['bound_by']} | "
                     f"{r['link_utilisation']:.2f} | {r['server_link_utilisation']:.2f} | "
                     f"{r['down_mb_per_device_max']:.1f} | {r['up_mb_per_device_max']:.1f} | {r['down_gb_total']:.1f} | "
                     f"{r['step_s'] / ref['local_step_s']:.2f}x | {r['step_s'] / ref['a5000_step_s']:.0f}x | "
                     f"{r['device_energy_j']:.0f} | " + ("| | |" if r["micro_batches"] == 1 else
                     f"{plain['step_s']:.2f} | {plain['link_utilisation']:.2f} | {plain['up_mb_per_device_max']:.1f} |"))
    lines += ["", "Chosen count (`units.micro_batches: 0`: `timeline.choose_micro_batches` over 1/2/4/8 micro-batches, "
              "the smallest at >= 0.70 link utilisation without a slower step than 1, else the fastest; with "
              "accumulation) beside the fixed counts above:", "",
              "| target | fleet | devices | chosen | step (s) | step / bound | link util. | server link util. | "
              "step at 1 (s) | step at 4 (s) | link util. at 4 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["chosen"]:
        one, four = fixed(data, r, 1), fixed(data, r, 4)
        lines.append(f"| {r['target']} | {r['fleet']} | {r['devices']} | {r['micro_batches']} | {r['step_s']:.2f} | "
                     f"{r['step_over_bound']:.2f} | {r['link_utilisation']:.2f} | {r['server_link_utilisation']:.2f} | "
                     f"{one['step_s']:.2f} | "
                     f"{four['step_s']:.2f} | {four['link_utilisation']:.2f} |")
    lines += ["", "Recovery (phones, a device killed at half the step):", "",
              "| target | devices | micro-batches | step (s) | extra (s) | phase deadline (s) | detected after (s) | "
              "restart instead (s) | units re-dispatched |", "|---|---|---|---|---|---|---|---|---|"]
    for r in data["recovery"]:
        lines.append(f"| {r['target']} | {r['devices']} | {r['micro_batches']} | {r['step_s']:.2f} | {r['extra_s']:.2f} | "
                     f"{r['phase_deadline_s']:.2f} | {r['detected_after_s']:.2f} | {r['restart_extra_s']:.2f} | "
                     f"{r['redispatched_units']} |")
    lines += ["", "Scenarios:", "", "| scenario | fleet | devices | step (s) | down MB/device | up MB/device | "
              "A5000 step (s) |", "|---|---|---|---|---|---|---|"]
    for r in data["scenarios"]:
        lines.append(f"| {r['scenario']} | {r['fleet']} | {r['devices']} | {r['step_s']:.2f} | "
                     f"{r['down_mb_per_device_max']:.1f} | {r['up_mb_per_device_max']:.1f} | {r['a5000_step_s']:.3f} |")
    lines += ["", "Real engine runs (quickstart, phones; tiles computed, serialised and checked in process):", "",
              "| devices | units | bytes vs formula (max rel.) | check CPU (s) | server wall (s) | check / server wall "
              "| virtual step (s) | trace = analytic |", "|---|---|---|---|---|---|---|---|"]
    for r in data["real"]:
        lines.append(f"| {r['devices']} | {r['units']} | {r['bytes_vs_formula_max_rel']:.4f} | {r['check_cpu_s']:.3f} | "
                     f"{r['server_wall_s']:.2f} | {r['check_cpu_s'] / r['server_wall_s']:.1%} | "
                     f"{r['virtual_step_s']:.2f} | {r['trace_equals_analytic']} |")
    return "\n".join(lines + ["", "## Where the mode is faster or cheaper", ""] + findings(data)) + "\n"


def findings(data: dict) -> list[str]:
    """Plain statements computed from the numbers above."""
    refs, out = data["references"], []
    for target in refs:
        rows = [r for r in data["sweep"] if r["target"] == target]
        ref = refs[target]
        beat_local = [r for r in rows if r["step_s"] < ref["local_step_s"]]
        best = min(rows, key=lambda r: r["step_s"])
        out.append(f"- {target}: faster than the local CPU step ({ref['local_step_s']:.2f} s) in {len(beat_local)} of "
                   f"{len(rows)} settings" + (f", from {min(r['devices'] for r in beat_local)} devices" if beat_local
                                              else "") + f"; best {best['step_s']:.2f} s ({best['devices']} devices, "
                   f"{best['fleet']}, {best['micro_batches']} micro-batch(es)) = {best['step_s'] / ref['a5000_step_s']:.0f}x "
                   f"the A5000's {ref['a5000_step_s'] * 1e3:.1f} ms; faster than the A5000 in "
                   f"{sum(r['step_s'] < ref['a5000_step_s'] for r in rows)} settings; device energy per step "
                   f"{min(r['device_energy_j'] for r in rows):.0f}-{max(r['device_energy_j'] for r in rows):.0f} J "
                   f"against the A5000's {ref['a5000_energy_j']:.2f} J.")
    def one(r: dict) -> float:
        return float(fixed(data, r, 1)["step_s"])

    several = [r for r in data["sweep"] if r["micro_batches"] > 1]
    beat = [r for r in several if r["step_s"] < one(r)]
    lose = [r for r in several if r["step_s"] > one(r)]
    lan = sum("LAN" in r["fleet"] for r in lose)
    slower = [r for r in several if r["step_s"] > r["no_accumulation"]["step_s"]]
    out.append(f"- 4 micro-batches in flight beat 1 in {len(beat)} of {len(several)} settings with on-device "
               f"accumulation ({sum(r['no_accumulation']['step_s'] < one(r) for r in several)} without); they lose in "
               f"{len(lose)} ({lan} of them on the LAN, where each micro-batch's extra messages and their overhead "
               f"outweigh the overlap). With accumulation 4 micro-batches' step is "
               f"{min(r['step_s'] / r['no_accumulation']['step_s'] for r in several):.2f}-"
               f"{max(r['step_s'] / r['no_accumulation']['step_s'] for r in several):.5f}x the step without it; "
               f"slower in {len(slower)} settings, by at most "
               f"{max([(r['step_s'] - r['no_accumulation']['step_s']) * 1e6 for r in slower] or [0.0]):.0f} us "
               "(the units' running-sum fields on the downlink, where the saved uploads are off the critical path).")
    for m in (1, 4):
        rows = [r for r in data["sweep"] if r["micro_batches"] == m]
        server = [r for r in rows if r["bound_by"].startswith("server")]
        out.append(f"- {m} micro-batch(es): step / lower bound {min(r['step_over_bound'] for r in rows):.2f}-"
                   f"{max(r['step_over_bound'] for r in rows):.2f} ({sum(r['step_over_bound'] > 1.5 for r in rows)} of "
                   f"{len(rows)} above 1.5); the server's link sets the bound in {len(server)} of {len(rows)}"
                   + (f" (from {min(r['devices'] for r in server)} devices, its busier link "
                      f"{min(r['server_link_utilisation'] for r in server):.2f}-"
                      f"{max(r['server_link_utilisation'] for r in server):.2f} busy)" if server else "") +
                   f"; busiest-link utilisation {min(r['link_utilisation'] for r in rows):.2f}-"
                   f"{max(r['link_utilisation'] for r in rows):.2f} ({sum(r['link_utilisation'] >= 0.7 for r in rows)} "
                   "at >= 0.70; the rest are held by phases x (RTT + message overhead), see the micro-batch line below)" +
                   ("." if m == 1 else f"; without accumulation step / lower bound "
                    f"{min(r['no_accumulation']['step_over_bound'] for r in rows):.2f}-"
                    f"{max(r['no_accumulation']['step_over_bound'] for r in rows):.2f}, "
                    f"{sum(r['no_accumulation']['link_utilisation'] >= 0.7 for r in rows)} at >= 0.70 utilisation."))
    per_count = RESULTS / "units_microbatches.json"  # benchmarks/units_microbatches.py: every divisor of the batch
    if per_count.exists():
        pc = json.loads(per_count.read_text())["rows"]
        auto = [r["counts"][str(r["auto"])] for r in pc]
        out.append(f"- Per-step count (`timeline.choose_micro_batches`, units_microbatches.md, counts 1/2/4/8): "
                   f"{sum(a['link_utilisation'] >= 0.7 for a in auto)} of {len(pc)} settings at >= 0.70 utilisation, "
                   f"step / lower bound {min(a['step_s'] / a['lower_bound_s'] for a in auto):.2f}-"
                   f"{max(a['step_s'] / a['lower_bound_s'] for a in auto):.2f}; {sum(r['ceiling'] < 0.7 for r in pc)} are "
                   "latency-bound at every count (the busiest link's busy seconds < 0.70 x phases x (RTT + overhead)), "
                   f"{sum(r['ceiling'] >= 0.7 and max(p['link_utilisation'] for p in r['counts'].values()) < 0.7 for r in pc)}"
                   " more stay below 0.70 from per-message overhead and the phases' dependency.")
    picked = data["chosen"]
    vs_one = [r["step_s"] / one(r) for r in picked]
    vs_four = [r["step_s"] / fixed(data, r, 4)["step_s"] for r in picked]
    out.append("- The chosen count (`units.micro_batches: 0`, table above): "
               + ", ".join(f"{m} in {sum(r['micro_batches'] == m for r in picked)}"
                           for m in sorted({r["micro_batches"] for r in picked})) +
               f" of {len(picked)} settings; {sum(r['link_utilisation'] >= 0.7 for r in picked)} at >= 0.70 "
               f"utilisation (fixed 4: {sum(fixed(data, r, 4)['link_utilisation'] >= 0.7 for r in picked)}), step / "
               f"lower bound {min(r['step_over_bound'] for r in picked):.2f}-"
               f"{max(r['step_over_bound'] for r in picked):.2f}; "
               f"its step {min(vs_one):.2f}-{max(vs_one):.2f}x the step at 1 and {min(vs_four):.2f}-{max(vs_four):.2f}x "
               f"the step at 4 (faster than 4 in {sum(x < 1 for x in vs_four)}).")
    for target, ref in refs.items():
        ratios = [ref["check_cpu_s" if r["micro_batches"] == 1 else "check_cpu_s_4"] / r["step_s"]
                  for r in data["sweep"] if r["target"] == target]
        out.append(f"- {target}: the server's Freivalds checks take {ref['check_cpu_s']:.3f} CPU s per step with 1 "
                   f"micro-batch and {ref['check_cpu_s_4']:.3f} with 4 (one thread): "
                   f"{ref['check_cpu_s'] / ref['local_step_s']:.1%} and {ref['check_cpu_s_4'] / ref['local_step_s']:.1%} "
                   f"of the local CPU step, {min(ratios):.1%}-{max(ratios):.1%} of the virtual step "
                   f"({sum(x <= 0.02 for x in ratios)} of {len(ratios)} settings at <= 2%; above that the server needs "
                   "more cores for checking, or fewer vectors).")
    real = data["real"]
    out.append(f"- In the real engine runs the checks are {min(r['check_cpu_s'] / r['server_wall_s'] for r in real):.1%}-"
               f"{max(r['check_cpu_s'] / r['server_wall_s'] for r in real):.1%} of the server's own time in the phases "
               "(plan, encode, decode, check, assemble).")
    rec = data["recovery"]
    out.append(f"- A device killed mid-step costs {min(r['extra_s'] for r in rec):.2f}-{max(r['extra_s'] for r in rec):.2f} s "
               f"(at most {max(r['extra_s'] / r['phase_deadline_s'] for r in rec):.2f} of the phase deadline), against "
               f"{min(r['restart_extra_s'] for r in rec):.2f}-{max(r['restart_extra_s'] for r in rec):.2f} s for "
               "restarting the step; never Flower's ~60 s offline detection.")
    return out


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 and 64 devices only")
    parser.add_argument("--markdown-only", action="store_true", help="rewrite units.md from units.json")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.markdown_only:
        (args.out / "units.md").write_text(markdown(json.loads((args.out / "units.json").read_text())))
        return 0
    torch.set_num_threads(1)
    counts = [4, 64] if args.quick else [4, 16, 64, 256, 1024]
    data = {"command": "python benchmarks/units.py" + (" --quick" if args.quick else ""),
            "machine": {"cpu": _cpu(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                        "python": platform.python_version(), "cores": os.cpu_count()},
            "settings": {"batch": BATCH, "seq": SEQ, "a5000_fp32_peak": A5000_FP32_PEAK,
                         "a5000_sustained": A5000_SUSTAINED, "deadline_factor": 3.0},
            "references": references(), "real": real_runs([4, 16, 64]),
            "recovery": recovery([16, 64, 256]), "scenarios": scenarios(counts), "sweep": sweep(counts, [1, 4]),
            "chosen": chosen(counts)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "units.json").write_text(json.dumps(data, indent=1))
    (args.out / "units.md").write_text(markdown(data))
    plot(data, args.out / "units.png")
    print(markdown(data))
    return 0


def plot(data: dict, path: Path) -> None:
    """Step time against device count, one panel per target and fleet: 1 micro-batch, 4 with on-device
    accumulation, 4 without, the lower bound of the first two, and the chosen count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["target"], r["fleet"]) for r in data["sweep"]})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (target, fleet) in zip(axes[0], panels):
        rows = [r for r in data["sweep"] if (r["target"], r["fleet"]) == (target, fleet)]
        for m, style in ((1, "o-"), (4, "s-")):
            mine = [r for r in rows if r["micro_batches"] == m]
            n = [r["devices"] for r in mine]
            ax.plot(n, [r["step_s"] for r in mine], style, label=f"{m} micro-batch" + ("es, accumulated" if m > 1 else ""))
            ax.plot(n, [r["lower_bound_s"] for r in mine], style[0] + ":", alpha=0.5, label=f"lower bound, {m}")
            if m > 1:
                ax.plot(n, [r["no_accumulation"]["step_s"] for r in mine], "x--", label=f"{m} micro-batches, no accumulation")
        picked = [r for r in data["chosen"] if (r["target"], r["fleet"]) == (target, fleet)]
        ax.plot([r["devices"] for r in picked], [r["step_s"] for r in picked], "d-.", label="chosen count (0)")
        ax.set(xscale="log", yscale="log", xlabel="devices", ylabel="virtual step (s)", title=f"{target}, {fleet}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
