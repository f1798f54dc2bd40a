"""Benchmark: a mixed-method federation against each single method at the same device mix.

Arms, all on the quickstart's population (phones 50%, laptops 30%, desktops 20%) and target:
``submodel`` (every tier trains a width slice: phones 1/8, laptops 1/4, desktops 1/2, rolling and staggered),
``distill`` (every tier trains a small family model: phones the 40K ``tiny`` Llama, laptops and desktops the
``small`` GPT-2 with its own BPE, as recipes/distill.yaml) and ``mixed`` (recipes/mixed.yaml: phones distil
``tiny``, laptops and desktops train the same slices as ``submodel``). Each arm runs the recipe through the
ServerApp's own code (``fedfusion.server_app.run_federation``: FusionStrategy, the method objects, the real
ClientApp handlers and client roles), with the messages delivered in-process instead of by Flower's Ray
simulation (no process start-up, so the arms fit a shared 2-core machine; the round, its payloads, checks, folds
and ledgers are the ones ``fedfusion run`` writes). Reported: the target's final held-out loss per character,
its best, and the priced client and server energy, per seed and as mean +- std.

    python benchmarks/mixed.py --seeds 0 1 2 [--rounds 6] [--arms mixed submodel distill] [overrides ...]

Writes ``benchmarks/results/mixed.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ARMS = {  # arm -> (recipe, overrides that put it on the common device mix)
    "submodel": ("quickstart", []),
    "distill": ("distill", []),
    "mixed": ("mixed", []),
}


class LocalGrid:
    """A Grid whose nodes are the ClientApp's own handlers, called in-process (one node per partition)."""

    def __init__(self, num_nodes: int) -> None:
        self.ids = [7000 + 13 * p for p in range(num_nodes)]  # node ids unrelated to partitions, as in Flower

    def get_node_ids(self) -> list[int]:
        return list(self.ids)

    def send_and_receive(self, messages, timeout=None):
        from flwr.app import Context, Error, Message, MessageType, RecordDict

        from fedfusion import client_app

        kinds = {MessageType.QUERY: "query", MessageType.TRAIN: "train", MessageType.EVALUATE: "evaluate"}
        replies = []
        for m in messages:
            node = m.metadata.dst_node_id
            context = Context(run_id=1, node_id=node, state=RecordDict(), run_config={},
                              node_config={"partition-id": self.ids.index(node), "num-partitions": len(self.ids)})
            handler = next(f for k, f in client_app.app._registered_funcs.items()
                           if k.split(".")[0] == kinds[m.metadata.message_type])
            try:
                replies.append(handler(m, context))
            except Exception as exc:  # a failing client is an error reply, as Flower delivers it
                replies.append(Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"), reply_to=m))
        return replies


def run_arm(arm: str, seed: int, rounds: int, overrides: list[str], work: Path) -> dict:
    """One run of ``arm``; its per-round metrics and totals."""
    from flwr.supercore.task_identity import TaskIdentity

    from fedfusion.planner import fit_widths
    from fedfusion.recipe import load_recipe
    from fedfusion.run_dir import RunDir, read_jsonl
    from fedfusion.server_app import run_federation

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # messages outside a Flower runtime
    name, extra = ARMS[arm]
    recipe = load_recipe(name, [*extra, f"seed={seed}", f"rounds={rounds}", "output.save_model=false", *overrides])
    fit_widths(recipe)
    out = work / f"{arm}-s{seed}"
    start = time.perf_counter()
    summary = run_federation(LocalGrid(recipe.population.num_clients), recipe, RunDir(out, recipe), lambda row: None)
    rows = read_jsonl(out / "metrics.jsonl")
    clients = read_jsonl(out / "clients.jsonl")
    return {"arm": arm, "seed": seed, "final_loss": rows[-1]["eval_loss"], "best_loss": min(r["eval_loss"] for r in rows),
            "initial_loss": rows[0]["eval_loss"], "curve": [r["eval_loss"] for r in rows],
            "client_j": sum(r["energy_j"] - r["server_energy_j"] for r in rows),
            "server_j": sum(r["server_energy_j"] for r in rows), "bytes": summary["bytes_down"] + summary["bytes_up"],
            "methods": sorted({c["method"] for c in clients}), "wall_s": time.perf_counter() - start}


def _stat(values: list[float]) -> str:
    return f"{statistics.mean(values):.4f} +- {statistics.stdev(values):.4f}" if len(values) > 1 else f"{values[0]:.4f}"


def markdown(report: dict) -> str:
    lines = ["# Mixed-method federation vs each single method (same device mix)", "",
             f"Command: `{report['command']}`  ", f"Machine: {report['machine']}  ",
             f"Settings: {report['settings']}", "",
             "| arm | methods | final loss (nats/char) | best loss | client J | server J | MB moved | seeds |",
             "|---|---|---|---|---|---|---|---|"]
    for arm in report["settings"]["arms"]:
        runs = [r for r in report["runs"] if r["arm"] == arm]
        if not runs:
            continue
        lines.append(f"| {arm} | {', '.join(runs[0]['methods'])} | {_stat([r['final_loss'] for r in runs])} | "
                     f"{_stat([r['best_loss'] for r in runs])} | {_stat([r['client_j'] for r in runs])} | "
                     f"{_stat([r['server_j'] for r in runs])} | {statistics.mean(r['bytes'] for r in runs) / 1e6:.1f} | "
                     f"{len(runs)} |")
    lines += ["", "Loss: the target's held-out loss per character (the quickstart's pooled held-out text), lower is "
              "better; mean +- standard deviation over seeds. Energy: the ledger's priced device work "
              "(fedfusion.energy.price_work), server = distillation priced on its server device.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--out", default="mixed", help="results/<out>.{json,md}")
    parser.add_argument("overrides", nargs="*", help="key=value overrides applied to every arm")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for arm in args.arms:
                run = run_arm(arm, seed, args.rounds, args.overrides, Path(tmp))
                runs.append(run)
                print(f"{arm} seed {seed}: loss {run['initial_loss']:.4f} -> {run['final_loss']:.4f} "
                      f"({run['wall_s']:.0f}s)", flush=True)
    report = {"benchmark": "mixed", "command": "python benchmarks/mixed.py " + shlex.join(sys.argv[1:]),
              "machine": f"{platform.platform()}, python {platform.python_version()}, torch {torch.__version__}",
              "settings": {"seeds": args.seeds, "rounds": args.rounds, "arms": args.arms, "overrides": args.overrides},
              "runs": runs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(report, indent=1))
    (RESULTS / f"{args.out}.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
