"""Churn in the units mode, in process (no Flower): devices leave at a stated rate and come back, over many steps.

    python benchmarks/units_churn.py [--steps 20] [--devices 16] [--rates 0 0.05 0.1 0.25] [--rejoin-after 2]
                                     [--seeds 0 1 2]

The quickstart's target shape (hidden 128, 4 layers, 8 heads, MLP 512, vocab 100; batch 8 x 128, every linear layer
offloaded, float64 so that exactness is visible far below any training effect) trains ``--steps`` AdamW steps
through :class:`fedfusion.units.UnitEngine` on ``--devices`` phones (10 MB/s down, 2 MB/s up, 50 ms RTT; the
prototype of ``benchmarks/units.py``). Before each step every live device leaves with probability ``rate``
(:class:`fedfusion.units.workers.Away`: it misses its next message, so the engine takes it offline and re-dispatches
its tiles, and it comes back restarted, its weight cache gone); a device offline for ``--rejoin-after`` steps gets
units again (:class:`fedfusion.units.engine.Returns`, its weight blocks sent anew), as ``units.rejoin_after`` does under
``fedfusion run``. Per step: the bytes the engine moved (measured), the tiles it re-dispatched, and the step's
virtual seconds under the devices' links (:func:`fedfusion.units.timeline.simulate` over the devices live at the
step's start, each leaver killed at time 0: it costs its phase one deadline). Rate 0 is the same run without churn
(same data, same seed). Exactness: the largest difference between the trained weights and the same steps of plain
torch on one machine (float64), churn or not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch
from results_files import run_facts, write_pair
from transformers import LlamaForCausalLM
from units import BATCH, RESULTS, SEQ, TARGETS, fleets

from fedfusion.units import UnitEngine, install
from fedfusion.units.engine import Returns
from fedfusion.units.timeline import Kill, chains_from_trace, simulate
from fedfusion.units.verify import Freivalds
from fedfusion.units.workers import Away

LR = 1e-3


def batches(steps: int, vocab: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (BATCH, SEQ), generator=gen) for _ in range(steps)]


def train_local(data: list[torch.Tensor]) -> LlamaForCausalLM:
    """The same steps in plain torch: the reference the units run must equal."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(TARGETS[0].config()).double()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for ids in data:
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    return model


def run(rate: float, seed: int, a: argparse.Namespace, data: list[torch.Tensor], local: LlamaForCausalLM) -> dict:
    """One run of ``a.steps`` steps at churn ``rate`` (draws seeded by ``seed``): per-step bytes, re-dispatches,
    virtual seconds; the weights' largest difference from ``local``."""
    proto = fleets()["phones 10/2 MB/s"][0]
    workers = [Away(after=0, missed=0) for _ in range(a.devices)]
    engine = UnitEngine([proto] * a.devices, workers=workers, verifier=Freivalds(seed=seed))  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = LlamaForCausalLM(TARGETS[0].config()).double()
    install(model, engine, "all")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    draw = torch.Generator().manual_seed(1000 + seed)
    returns = Returns(a.rejoin_after)
    steps = []
    for step, ids in enumerate(data):
        back = returns.start(engine, step)
        live = engine.live()
        leavers = [d for d in live if float(torch.rand((), generator=draw)) < rate]
        for d in leavers:
            workers[d].leave()
        before = len(engine.trace)
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        trace = engine.trace[before:]
        returns.end(engine, step)
        kills = tuple(Kill(live.index(d), 0.0) for d in leavers)
        timing = simulate([proto] * len(live), chains_from_trace(trace), kills=kills, accumulate=True)
        steps.append({"step": step, "live": len(live), "left": len(leavers), "rejoined": len(back),
                      "down_mb": sum(sum(r.down_bytes.values()) for r in trace) / 1e6,
                      "up_mb": sum(sum(r.up_bytes.values()) for r in trace) / 1e6,
                      "redispatched": sum(r.redispatched for r in trace), "virtual_s": timing.step_s})
    diff = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), local.parameters()))
    scale = max(float(q.detach().abs().max()) for q in local.parameters())
    return {"rate": rate, "seed": seed, "steps": steps, "max_abs_diff": diff, "max_rel_diff": diff / scale,
            "server_fallback": engine.server_fallback, "offline_at_end": sorted(engine.offline)}


def summarise(runs: list[dict]) -> list[dict]:
    """Per rate, over seeds: mean per-step virtual seconds, MB down / up, re-dispatched tiles, departures, rejoins;
    each against rate 0 of the same seed (paired); the worst weight difference."""
    base = {r["seed"]: r for r in runs if r["rate"] == 0}
    out = []
    for rate in sorted({r["rate"] for r in runs}):
        mine = [r for r in runs if r["rate"] == rate]

        def mean(r: dict, key: str) -> float:
            return statistics.fmean(s[key] for s in r["steps"])

        row: dict[str, Any] = {"rate": rate, "seeds": len(mine)}
        for key in ("virtual_s", "down_mb", "up_mb", "redispatched", "live"):
            row[key] = statistics.fmean(mean(r, key) for r in mine)
            if key in ("virtual_s", "down_mb", "up_mb") and base:
                ratios = [mean(r, key) / mean(base[r["seed"]], key) for r in mine]
                row[f"{key}_ratio"] = statistics.fmean(ratios)
                row[f"{key}_ratio_sd"] = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
        row["left"] = statistics.fmean(sum(s["left"] for s in r["steps"]) for r in mine)
        row["rejoined"] = statistics.fmean(sum(s["rejoined"] for s in r["steps"]) for r in mine)
        row["max_rel_diff"] = max(r["max_rel_diff"] for r in mine)
        row["server_fallback"] = sum(r["server_fallback"] for r in mine)
        out.append(row)
    return out


def markdown(data: dict) -> str:
    a = data["settings"]
    lines = [
        "# Units mode under churn: devices that leave and come back",
        "",
        f"Machine: {data['machine']}, torch {data['torch']}, load before {data['load_before']}. In process (no Flower): "
        f"the quickstart's target shape in float64, {a['steps']} AdamW steps (lr {LR}) of batch {BATCH} x {SEQ}, every "
        f"linear layer on {a['devices']} phones (10 MB/s down, 2 MB/s up, 50 ms RTT) behind a 10 Gb/s server; before "
        f"each step every live device leaves with probability `rate` (it misses its next message, then comes back "
        f"restarted, its cache gone) and a device offline for {a['rejoin_after']} steps gets units again, its weights "
        f"sent anew; seeds {', '.join(map(str, a['seeds']))} (the churn draws; the data and the model are the same).",
        "",
        "| rate / device / step | departures | rejoins | live devices | virtual s / step | vs no churn | MB down / step "
        "| vs no churn | MB up / step | vs no churn | re-dispatched tiles / step | max rel. weight diff vs torch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["summary"]:
        def ratio(key: str, r: dict = r) -> str:
            return f"{r[key + '_ratio']:.3f} ± {r[key + '_ratio_sd']:.3f}" if key + "_ratio" in r else ""

        lines.append(f"| {r['rate']:g} | {r['left']:.1f} | {r['rejoined']:.1f} | {r['live']:.1f} | {r['virtual_s']:.2f} "
                     f"| {ratio('virtual_s')} | {r['down_mb']:.2f} | {ratio('down_mb')} | {r['up_mb']:.2f} "
                     f"| {ratio('up_mb')} | {r['redispatched']:.1f} | {r['max_rel_diff']:.2e} |")
    lines += [
        "",
        "Departures and rejoins: per run (mean over seeds). vs no churn: the mean per-step value over the same seed's "
        "run at rate 0 (the same data and model; mean ± sd over seeds). Virtual seconds: "
        "`fedfusion.units.timeline.simulate` over the devices live at the step's start, each leaver killed at 0 (its "
        "first message of the step costs its phase one deadline, 3x the message's predicted time); bytes: what the "
        "engine's messages measured. Max rel. weight diff: the largest |w - w_torch| over the final weights, over the "
        "largest |w_torch|, against the same steps in plain torch (float64).",
    ]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--devices", type=int, default=16)
    p.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.25])
    p.add_argument("--rejoin-after", type=int, default=2)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--name", default="units_churn")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if 0.0 not in a.rates:
        raise SystemExit("--rates must include 0 (the run without churn every rate is measured against)")
    torch.set_num_threads(1)
    data = batches(a.steps, TARGETS[0].vocab, 0)
    local = train_local(data)
    runs = []
    for seed in a.seeds:
        for rate in a.rates:
            runs.append(run(rate, seed, a, data, local))
            r = runs[-1]
            print(f"rate {rate:g} seed {seed}: {sum(s['left'] for s in r['steps'])} left, "
                  f"{statistics.fmean(s['virtual_s'] for s in r['steps']):.2f} virtual s/step, "
                  f"max rel diff {r['max_rel_diff']:.2e}", file=sys.stderr, flush=True)
    data_out = {**run_facts("benchmarks/units_churn.py", argv),
                "settings": {"steps": a.steps, "devices": a.devices, "rates": a.rates,
                             "rejoin_after": a.rejoin_after, "seeds": a.seeds},
                "summary": summarise(runs), "runs": runs}
    write_pair(RESULTS, a.name, data_out, markdown(data_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
