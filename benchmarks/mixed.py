"""Benchmark: a mixed-method federation against each single method at the same device mix.

Language-model task (``--task lm``, the default), all arms on the quickstart's population (phones 50%, laptops 30%,
desktops 20%) and target: ``submodel`` (``RECIPE``, recipes/rolling.yaml: every tier trains a width slice: phones
1/8, laptops 1/4, desktops 1/2, rolling and staggered), ``distill`` (every tier trains a small family model: phones
the 40K ``tiny`` Llama, laptops and desktops the ``small`` GPT-2 with its own BPE, as recipes/distill.yaml) and
``mixed`` (recipes/mixed.yaml: phones distil ``tiny``, laptops and desktops train the same slices as ``submodel``).
Each arm runs the recipe through the ServerApp's own code (``fedfusion.run.federation.run_federation``:
FusionStrategy, the method objects, the real ClientApp handlers and client roles), with the messages delivered
in-process instead of by Flower's Ray simulation (no process start-up, so the arms fit a shared 2-core machine; the
round, its payloads, checks, folds and ledgers are the ones ``fedfusion run`` writes). Reported: the target's final
held-out loss per character, its best, and the priced client and server energy, per seed and as mean +- std.

Knowledge task (``--task knowledge``): recipes/knowledge.yaml's private facts over 16 clients, half phones (width
1/8) and half laptops (width 1/4): ``submodel`` (every tier trains its slice of the target, rolling and
staggered), ``generative`` (every tier trains a small model of its own of that width and sends samples of it)
and ``mixed`` (phones generative, laptops slices). Reported: the share of all clients' facts the target recalls
(``probe_acc``), final and best.

    python benchmarks/mixed.py --seeds 0 1 2 [--rounds 6] [--arms mixed submodel distill] [overrides ...]
    python benchmarks/mixed.py --task knowledge --out mixed_knowledge [--rounds 30] [overrides ...]

Writes ``benchmarks/results/<out>.{json,md}`` (default ``mixed``).
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

# the lm submodel arm: results measured on the rolling slices (the quickstart's recipe until it switched to growth)
RECIPE = "rolling"
RESULTS = Path(__file__).resolve().parent / "results"
KNOWLEDGE_MIX = ["population.mix={phone: 0.5, laptop: 0.5}", "fusion.widths={phone: 0.125, laptop: 0.25}",
                 "fusion.policy=rolling", "fusion.stagger=true"]
TASKS = {  # task -> (primary metric, lower is better, arm -> (recipe, overrides that put it on the common device mix))
    "lm": ("eval_loss", True, {
        "submodel": (RECIPE, []),
        "distill": ("distill", []),
        "mixed": ("mixed", []),
    }),
    "knowledge": ("probe_acc", False, {
        "submodel": ("knowledge", [*KNOWLEDGE_MIX, "fusion.method=submodel"]),
        "generative": ("knowledge", [*KNOWLEDGE_MIX, "fusion.method=generative"]),
        "mixed": ("knowledge", [*KNOWLEDGE_MIX, "fusion.method=mixed",
                                "fusion.tiers={phone: generative, laptop: submodel}"]),
    }),
}


class LocalGrid:
    """A Grid whose nodes are the ClientApp's own handlers, called in-process (one node per partition)."""

    def __init__(self, num_nodes: int) -> None:
        self.ids = [7000 + 13 * p for p in range(num_nodes)]  # node ids unrelated to partitions, as in Flower

    def get_node_ids(self) -> list[int]:
        return list(self.ids)

    def send_and_receive(self, messages, timeout=None):
        from flwr.app import Context, Error, Message, RecordDict

        from fedfusion import client_app

        replies = []
        for m in messages:
            node = m.metadata.dst_node_id
            context = Context(run_id=1, node_id=node, state=RecordDict(), run_config={},
                              node_config={"partition-id": self.ids.index(node), "num-partitions": len(self.ids)})
            try:  # the ClientApp routes the message to its handler by type, its mods included, as a SuperNode does
                replies.append(client_app.app(m, context))
            except Exception as exc:  # a failing client is an error reply, as Flower delivers it
                replies.append(Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"), reply_to=m))
        return replies


def run_arm(task: str, arm: str, seed: int, rounds: int, overrides: list[str], work: Path) -> dict:
    """One run of ``arm``; its per-round metrics and totals."""
    from flwr.supercore.task_identity import TaskIdentity

    from fedfusion.analysis.report import read_jsonl
    from fedfusion.config.recipe import load_recipe
    from fedfusion.fusion.submodel.plan import fit_widths
    from fedfusion.run.federation import run_federation
    from fedfusion.run.run_dir import RunDir

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # messages outside a Flower runtime
    metric, lower, arms = TASKS[task]
    name, extra = arms[arm]
    recipe = load_recipe(name, [*extra, f"seed={seed}", f"rounds={rounds}", "output.save_model=false", *overrides])
    fit_widths(recipe.fusion, recipe.train, recipe.population, recipe.model, recipe.data_source())
    out = work / f"{arm}-s{seed}"
    start = time.perf_counter()
    summary = run_federation(LocalGrid(recipe.population.num_clients), recipe, RunDir(out, recipe), lambda row: None)
    rows = read_jsonl(out / "metrics.jsonl")
    clients = read_jsonl(out / "clients.jsonl")
    best = min if lower else max
    return {"arm": arm, "seed": seed, "metric": metric, "final": rows[-1][metric], "best": best(r[metric] for r in rows),
            "initial": rows[0][metric], "curve": [r[metric] for r in rows],
            "client_j": sum(r["energy_j"] - r["server_energy_j"] for r in rows),
            "server_j": sum(r["server_energy_j"] for r in rows), "bytes": summary["bytes_down"] + summary["bytes_up"],
            "methods": sorted({c["method"] for c in clients}), "wall_s": time.perf_counter() - start}


def _stat(values: list[float]) -> str:
    return f"{statistics.mean(values):.4f} +- {statistics.stdev(values):.4f}" if len(values) > 1 else f"{values[0]:.4f}"


METRIC_TEXT = {
    "eval_loss": ("final loss (nats/char)", "best loss", "Loss: the target's held-out loss per character (the "
                  "rolling recipe's pooled held-out text), lower is better"),
    "probe_acc": ("final probe_acc", "best probe_acc", "probe_acc: the share of all clients' private facts the target "
                  "recalls by greedy exact match, higher is better"),
}


def markdown(report: dict) -> str:
    metric = TASKS[report["settings"].get("task", "lm")][0]
    final, best, meaning = METRIC_TEXT[metric]
    lines = ["# Mixed-method federation vs each single method (same device mix)", "",
             f"Command: `{report['command']}`  ", f"Machine: {report['machine']}  ",
             f"Settings: {report['settings']}", "",
             f"| arm | methods | {final} | {best} | client J | server J | MB moved | seeds |",
             "|---|---|---|---|---|---|---|---|"]
    for arm in report["settings"]["arms"]:
        runs = [r for r in report["runs"] if r["arm"] == arm]
        if not runs:
            continue
        lines.append(f"| {arm} | {', '.join(runs[0]['methods'])} | {_stat([r['final'] for r in runs])} | "
                     f"{_stat([r['best'] for r in runs])} | {_stat([r['client_j'] for r in runs])} | "
                     f"{_stat([r['server_j'] for r in runs])} | {statistics.mean(r['bytes'] for r in runs) / 1e6:.1f} | "
                     f"{len(runs)} |")
    lines += ["", f"{meaning}; mean +- standard deviation over seeds. Energy: the ledger's priced device work "
              "(fedfusion.devices.energy.price_work), server = the server's own training (distillation, or learning from the "
              "generated text) priced on its server device.", ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--task", default="lm", choices=list(TASKS))
    parser.add_argument("--arms", nargs="+", help="default: every arm of the task")
    parser.add_argument("--out", default="mixed", help="results/<out>.{json,md}")
    parser.add_argument("overrides", nargs="*", help="key=value overrides applied to every arm")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    arms = TASKS[args.task][2]
    args.arms = args.arms or list(arms)
    if unknown := set(args.arms) - set(arms):
        parser.error(f"--arms {sorted(unknown)}: task {args.task} has arms {', '.join(arms)}")
    import torch

    torch.set_num_threads(1)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for arm in args.arms:
                run = run_arm(args.task, arm, seed, args.rounds, args.overrides, Path(tmp))
                runs.append(run)
                print(f"{arm} seed {seed}: {run['metric']} {run['initial']:.4f} -> {run['final']:.4f} "
                      f"({run['wall_s']:.0f}s)", flush=True)
    report = {"benchmark": "mixed", "command": "python benchmarks/mixed.py " + shlex.join(sys.argv[1:]),
              "machine": f"{platform.platform()}, python {platform.python_version()}, torch {torch.__version__}",
              "settings": {"task": args.task, "seeds": args.seeds, "rounds": args.rounds, "arms": args.arms, "overrides": args.overrides},
              "runs": runs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(report, indent=1))
    (RESULTS / f"{args.out}.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
