"""Benchmark: the server's FlexLoRA fold on a pretrained base's adapted modules, its SVDs on the clients' stacked
factors (what the fold runs) against the same SVDs on each module's dense (out, in) update (what secure
aggregation's sum leaves the server, and what every fold ran before).

One round of the finetune recipe's LoRA arm: four clients at ranks 8, 8, 16 and 32 (finetune.yaml's phone-lowend,
phone-lowend, phone, laptop) on every linear layer of the base, alpha 16, random adapters. A round's server work is
the fold (``aggregate_lora`` and ``global_factors``) and the next round's payloads (``from_global`` and what each
rank is served, ``serve``); both arms run that same library code, the dense arm from an aggregate that holds only
the dense updates. Each arm is timed ``--repeats`` times on one torch thread (median), and the two arms' served
updates are compared.

    python benchmarks/lora_fold.py [--base NAME] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from results_files import run_facts, write_pair

from fedfusion.config.recipe import load_recipe
from fedfusion.fusion.lora.aggregate import (
    ClientLoRA,
    LoRAAggregate,
    aggregate_lora,
    from_global,
    global_factors,
    serve,
)
from fedfusion.fusion.lora.method import adapted_modules
from fedfusion.models.pretrained import load_base

RESULTS = Path(__file__).resolve().parent / "results"
RANKS = (8, 8, 16, 32)
ALPHA = 16.0


def clients(shapes: dict[str, tuple[int, int]], seed: int) -> list[ClientLoRA]:
    """Random adapters of RANKS on every module (B nonzero, as after a round of training)."""
    g = torch.Generator().manual_seed(seed)
    return [ClientLoRA({m: 0.02 * torch.randn(r, i, generator=g) for m, (_, i) in shapes.items()},
                       {m: 0.02 * torch.randn(o, r, generator=g) for m, (o, _) in shapes.items()}, ALPHA, 10.0 + k)
            for k, r in enumerate(RANKS)]


def dense(agg: LoRAAggregate) -> LoRAAggregate:
    """The same aggregate holding only its dense updates: its SVDs run on them."""
    return LoRAAggregate("flexlora", agg.delta, False)


def server_round(trained: list[ClientLoRA], arm: str) -> dict[int, dict[str, torch.Tensor]]:
    """One round of the server's work on the clients' adapters: the fold's global factors and the next round's
    served update per rank, ``(alpha / r) B @ A``; ``arm`` dense: every SVD on the dense updates."""
    agg = aggregate_lora(trained, "flexlora")
    A, B = global_factors(dense(agg) if arm == "dense" else agg)
    served = from_global("flexlora", A, B)
    if arm == "dense":
        served = dense(served)
    out = {}
    for rank in sorted(set(RANKS)):
        a, b = serve(served, rank, ALPHA)
        out[rank] = {m: ALPHA / rank * (b[m] @ a[m]) for m in a}
    return out


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="", help="lora.base: the base whose modules are adapted (default: "
                        "the finetune recipe's)")
    parser.add_argument("--repeats", type=int, default=3)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    facts = run_facts("benchmarks/lora_fold.py", argv)
    torch.set_num_threads(1)
    lora = load_recipe("finetune", [f"lora.base={args.base}"] if args.base else []).lora
    shapes = adapted_modules(load_base(lora.base), list(lora.target_modules))
    times: dict[str, list[float]] = {"factored": [], "dense": []}
    served: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for repeat in range(args.repeats):
        trained = clients(shapes, repeat)
        for arm in times:
            start = time.perf_counter()
            served[arm] = server_round(trained, arm)
            times[arm].append(time.perf_counter() - start)
    worst = max(float((served["factored"][r][m].double() - served["dense"][r][m].double()).abs().max()
                      / served["dense"][r][m].double().abs().max()) for r in served["dense"] for m in shapes)
    params = sum(o * i for o, i in shapes.values())
    rows = {arm: statistics.median(t) for arm, t in times.items()}
    payload = {**facts, "base": lora.base, "modules": len(shapes), "adapted_params": params, "ranks": list(RANKS),
               "seconds": times, "median_s": rows, "speedup": rows["dense"] / rows["factored"],
               "worst_relative_difference": worst}
    md = "\n".join([
        "# The server's FlexLoRA round: SVDs on the stacked factors against SVDs on the dense updates", "",
        f"Machine: {facts['machine']}; torch {facts['torch']}; 1 thread; load before {facts['load_before']}.", "",
        f"Base {lora.base}: {len(shapes)} adapted modules ({', '.join(lora.target_modules)}), {params:,} weights; "
        f"four clients at ranks {', '.join(map(str, RANKS))}, alpha {ALPHA:g}. One round of server work: the fold "
        "(aggregate_lora, global_factors) and the next round's payloads (from_global, serve at each rank). Median "
        f"of {args.repeats}.", "",
        "| SVDs run on | seconds per round (median) | each repeat |", "|---|---|---|",
        *(f"| {'the stacked factors (the fold)' if arm == 'factored' else 'the dense (out, in) updates'} | "
          f"{rows[arm]:.2f} | {' / '.join(f'{t:.2f}' for t in times[arm])} |" for arm in times), "",
        f"Speed-up {rows['dense'] / rows['factored']:.1f}x. The two arms' served updates differ by at most "
        f"{worst:.1e} of the update's largest entry (float32 results of float64 SVDs: rounding).", ""])
    write_pair(RESULTS, "lora_fold", payload, md)


if __name__ == "__main__":
    main()
