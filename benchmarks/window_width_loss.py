"""How far one client's local training gets with a full-forward window of each width, against the whole target.

Every arm is one round of `fedfusion run finetune` with the same two sampled clients, their data, 8 local AdamW steps
and learning rate (the recipe's); only what a client trains differs: the whole target in its own float32 copy (the
compare oracle's way), or a window of the heads and MLP neurons plus the embeddings and norms
(`fusion.window_shared=true`) on the int8 frozen target, at widths 1, 1/2, 1/4 and 1/8 (and 1/8 on a float32 frozen
target, to separate the window's width from the frozen target's rounding), and the windows again at a learning
rate scaled by their width (``fusion.window_lr_power``: lr x f^-p for a window of a fraction f). The table gives
each client's mean training loss over its local steps (from `clients.jsonl`) and the target's probe answer loss
after the round: the question is whether a narrow window makes less progress per step, which the fold cannot then
make up, and whether a faster rate gives it back.

    python benchmarks/window_width_loss.py [--seeds 1] [--work runs/bench-window-width] [--reuse]

writes ``benchmarks/results/window_width_loss.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from results_files import run_facts, write_pair
from secure_aggregation import RESULTS, jsonl, run

COMMON = ["rounds=1", "selection.clients_per_round=2", "engine.cpus_per_client=1"]
EVERY_TIER = "{{phone-lowend: {w}, phone: {w}, laptop: {w}}}"
# name -> (what a client trains, the arm's overrides)
ARMS: dict[str, tuple[str, list[str]]] = {
    "whole": ("the whole target, float32 (the oracle's way)",
              ["fusion.policy=static", "fusion.forward=slice", "fusion.widths=" + EVERY_TIER.format(w=1.0)]),
    **{f"window-{w}": (f"a window of {w} of the units + embeddings and norms, int8 frozen target",
                       ["fusion.window_shared=true", "fusion.widths=" + EVERY_TIER.format(w=w)])
       for w in (1.0, 0.5, 0.25, 0.125)},
    "window-0.125-float32": ("a window of 0.125 of the units + embeddings and norms, float32 frozen target",
                             ["fusion.window_shared=true", "fusion.frozen_dtype=float32",
                              "fusion.widths=" + EVERY_TIER.format(w=0.125)]),
    # the window's lr scaled by its width (fusion.window_lr_power): lr x f^-p
    **{f"window-{w}-lr-power-{p}": (f"a window of {w} of the units + embeddings and norms, int8 frozen target, "
                                    f"at lr x {w}^-{p} = {w ** -p:.3g} x lr",
                                    ["fusion.window_shared=true", f"fusion.window_lr_power={p}",
                                     "fusion.widths=" + EVERY_TIER.format(w=w)])
       for w, p in ((0.5, 0.5), (0.25, 0.5), (0.125, 0.5), (0.125, 1.0))},
}


def measure(work: Path, arm: str, seed: int, reuse: bool) -> dict:
    """One arm's run (kept with ``reuse``) and what its clients and the round's evaluation recorded."""
    out = work / f"{arm}-s{seed}"
    wall = run("finetune", [*COMMON, *ARMS[arm][1], f"seed={seed}"], out, reuse=reuse)
    clients = [r for r in jsonl(out / "clients.jsonl") if r["status"] == "ok"]
    scored = {int(r["round"]): r for r in jsonl(out / "metrics.jsonl")}
    return {"arm": arm, "seed": seed, "wall_s": wall,
            "clients": [{"partition": r["partition"], "device": r["device"], "train_loss": r["train_loss"],
                         "train_s": r["train_s"], "trained_params": r.get("trained_params", r["params"])}
                        for r in sorted(clients, key=lambda r: r["partition"])],
            "eval_loss_before": scored[0]["eval_loss"], "eval_loss": scored[1]["eval_loss"],
            "probe_acc": scored[1]["probe_acc"]}


def report(data: dict) -> str:
    """The markdown table, one row per (arm, seed)."""
    lines = ["# Local progress per step: a full-forward window of each width against the whole target (finetune)", "",
             f"Machine: {data['machine']}, torch {data['torch']}, load before {data['load_before']}. One round of "
             f"`fedfusion run finetune {' '.join(COMMON)}` per arm and seed: the same two clients, data, 8 local AdamW "
             "steps at the recipe's lr (the lr-power arms at the scaled lr their row names); only what a client trains "
             "differs.", "",
             "| arm | a client trains | trained parameters | mean local training loss per client (partition: loss) "
             "| mean | target's probe answer loss after the round | client train s (mean) |", "|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        losses = [c["train_loss"] for c in row["clients"]]
        per = ", ".join(f"{c['partition']}: {c['train_loss']:.3f}" for c in row["clients"])
        lines.append(f"| {row['arm']} (seed {row['seed']}) | {ARMS[row['arm']][0]} | "
                     f"{row['clients'][0]['trained_params']:,} | {per} | {statistics.mean(losses):.3f} | "
                     f"{row['eval_loss']:.3f} | {statistics.mean(c['train_s'] for c in row['clients']):.1f} |")
    lines += ["", "Mean local training loss: the mean of a client's 8 steps' batch losses (lower: it learned its own "
              "data faster). Probe answer loss: the target's loss on the probes' answer tokens after the round's fold (nats/token; "
              f"{data['rows'][0]['eval_loss_before']:.3f} before it)."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--work", default="runs/bench-window-width", help="where the runs go")
    parser.add_argument("--reuse", action="store_true", help="keep the finished runs already in --work")
    parser.add_argument("--out", default="window_width_loss", help="results file stem under benchmarks/results")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="which arms (default: all)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    facts = run_facts("benchmarks/window_width_loss.py", argv)
    rows = [measure(Path(args.work), arm, seed, args.reuse) for seed in args.seeds for arm in args.arms]
    data = {**facts, "rows": rows}
    write_pair(RESULTS, args.out, data, report(data))


if __name__ == "__main__":
    main()
