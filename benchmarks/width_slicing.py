"""Benchmark: width-slicing arms against smallest-only, exclusive-largest and oracle training.

Tasks: Fashion-MNIST (Debian ``dataset-fashion-mnist``, 14x14, GroupNorm CNN) with IID and label-skew
(two classes per client) partitions, and Shakespeare by speaker (character Llama). Capacity regimes:
``uniform`` (clients at 1, 1/2, 1/4, 1/8), ``small_to_large`` (1/2, 1/4, 1/8: no client holds the target)
and ``skewed`` (10% at 1, 20% at 1/2, 70% at 1/8). Arms: smallest-only FedAvg, exclusive-largest (only
clients that hold the target), static (HeteroFL), rolling (FedRolex window, staggered as fedfusion's
default), random (Federated Dropout), ordered (FjORD, nested widths per local step) and oracle (every
client trains the target).

Every arm runs the library's width-slicing method (``fedfusion.fusion.submodel.method.SubModelMethod``) through the
in-process driver (``fedfusion.fusion.inprocess.run_rounds``: the Flower strategy's payloads, checks and fold, without
Flower or Ray), so every arm sees the same clients, samples and seeds and the run fits a laptop; the Flower path
is measured by ``quickstart_policies.py``.
Client training runs one after another here, so the systems figures also give the server's share of a
round whose clients run in parallel (server time / (server time + slowest client)).

    python benchmarks/width_slicing.py --seeds 0 1 2 [--tasks lm fmnist-iid fmnist-skew] [--regimes ...]
        [--arms ...] [--rounds 20 --per-round 6 --steps 5] [--out width_slicing] [--skip-systems]

Finished (task, regime, arm) runs are kept (``results/<out>.partial.json`` while running, then
``results/<out>.json``), so an interrupted run resumes and extra arms can be added to a finished one.

Writes ``benchmarks/results/width_slicing.{json,md}``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import random
import resource
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig

from fedfusion.data.text import build_char_tokenizer, encode_text, lm_windows, load_shakespeare_roles, split_text
from fedfusion.fusion.base import Payload
from fedfusion.fusion.inprocess import Rounds, run_rounds
from fedfusion.fusion.submodel.method import SubModelMethod
from fedfusion.models.cnn import FedCNNConfig
from fedfusion.models.families import family_of
from fedfusion.models.slicing import extract, plan_slice, sub_config, sub_scales
from fedfusion.train.ordered import OrderedDropout, ordered_fractions

RESULTS = Path(__file__).resolve().parent / "results"
FMNIST = Path("/usr/share/datasets/fashion-mnist")
REGIMES = {  # name -> (widths, share of clients at each width)
    "uniform": ((1.0, 0.5, 0.25, 0.125), (0.25, 0.25, 0.25, 0.25)),
    "small_to_large": ((0.5, 0.25, 0.125), (1 / 3, 1 / 3, 1 / 3)),
    "skewed": ((1.0, 0.5, 0.125), (0.1, 0.2, 0.7)),
}
ARMS = ("smallest_only", "exclusive_largest", "static", "rolling", "random", "ordered", "oracle")
# The same policies with the folded scaler off, or with HeteroFL's step sizes restored on the folded tensors.
EXTRA_ARMS = ("static_unscaled", "rolling_unscaled", "static_lrscaled", "rolling_lrscaled")
POLICY = {"static": "static", "rolling": "rolling", "random": "random", "ordered": "ordered",
          "static_unscaled": "static", "rolling_unscaled": "rolling", "static_lrscaled": "static",
          "rolling_lrscaled": "rolling"}


@dataclass
class Task:
    """A federated task: model config, per-client training tensors, an evaluation set, and its loss."""

    name: str
    config: object
    clients: list[tuple[torch.Tensor, ...]]
    test: tuple[torch.Tensor, ...]
    metric: str  # accuracy (higher is better) or loss (lower is better)
    rounds: int
    per_round: int
    steps: int
    batch: int
    lr: float
    stride: float

    def batch_of(self, client: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        data = self.clients[client]
        rows = torch.randint(len(data[0]), (self.batch,), generator=gen)
        return tuple(t[rows] for t in data)

    def forward_loss(self, forward: Callable, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss, logits) of ``forward`` (a model or a nested-width call) on ``batch``."""
        if self.metric == "accuracy":
            x, y = batch
            logits = forward(pixel_values=x).logits
            return torch.nn.functional.cross_entropy(logits, y), logits
        ids = batch[0]
        logits = forward(input_ids=ids[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()), logits

    @torch.no_grad()
    def evaluate(self, model) -> float:
        model.eval()
        if self.metric == "accuracy":
            x, y = self.test
            return float((model(pixel_values=x).logits.argmax(-1) == y).float().mean())
        loss, _ = self.forward_loss(model, self.test)
        return float(loss)


def _idx(path: Path) -> np.ndarray:
    with gzip.open(path) as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def fmnist_task(skew: bool, rounds: int, per_round: int, steps: int, clients: int = 20, per_client: int = 250) -> Task:
    """Fashion-MNIST at 14x14; IID shards, or label skew: each client gets two shards of one class each."""
    images = torch.tensor(_idx(FMNIST / "train-images-idx3-ubyte.gz"), dtype=torch.float32).unsqueeze(1) / 255
    labels = torch.tensor(_idx(FMNIST / "train-labels-idx1-ubyte.gz"), dtype=torch.long)
    test_x = torch.tensor(_idx(FMNIST / "t10k-images-idx3-ubyte.gz"), dtype=torch.float32).unsqueeze(1) / 255
    test_y = torch.tensor(_idx(FMNIST / "t10k-labels-idx1-ubyte.gz"), dtype=torch.long)
    pool = lambda x: (torch.nn.functional.avg_pool2d(x, 2) - 0.286) / 0.353  # noqa: E731
    gen = torch.Generator().manual_seed(1234)  # the data split is fixed; seeds vary the training
    pick = torch.randperm(len(labels), generator=gen)[: clients * per_client]
    x, y = pool(images[pick]), labels[pick]
    if skew:
        order = torch.argsort(y, stable=True)
        shards = order.view(2 * clients, per_client // 2)
        assign = torch.randperm(2 * clients, generator=gen).view(clients, 2)
        parts = [shards[a].flatten() for a in assign]
    else:
        parts = list(torch.arange(len(y)).view(clients, per_client))
    cfg = FedCNNConfig(channels=[16, 32, 64], groups=8, image_size=14)
    return Task(f"fmnist-{'skew' if skew else 'iid'}", cfg, [(x[p], y[p]) for p in parts],
                (pool(test_x[:2000]), test_y[:2000]), "accuracy", rounds, per_round, steps, 32, 3e-3, 0.125)


def lm_task(rounds: int, per_round: int, steps: int, clients: int = 16, seq: int = 32) -> Task:
    """Shakespeare by speaker (roles with >= 4000 characters), character Llama; held-out = each role's tail."""
    tok = build_char_tokenizer()
    roles = load_shakespeare_roles(min_chars=4000)
    picked = np.random.default_rng(0).choice(len(roles), size=clients, replace=False)
    train, held = [], []
    for i in sorted(picked):
        a, b = split_text(roles[i].text, 0.1)
        train.append((lm_windows(encode_text(tok, a), seq),))
        held.append(lm_windows(encode_text(tok, b), seq)[:16])
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=8, head_dim=8, max_position_embeddings=seq + 1,
                      tie_word_embeddings=False)
    return Task("lm", cfg, train, (torch.cat(held),), "loss", rounds, per_round, steps, 16, 3e-3, 0.125)


def client_widths(regime: str, n: int, seed: int) -> list[float]:
    """Each client's capacity: the regime's widths in their shares, shuffled by ``seed``."""
    widths, shares = REGIMES[regime]
    counts = [round(s * n) for s in shares]
    counts[-1] = n - sum(counts[:-1])
    out = [w for w, c in zip(widths, counts) for _ in range(c)]
    random.Random(seed).shuffle(out)
    return out


def local_train(task: Task, model, client: int, seed: int, fractions: tuple[float, ...] | None,
                scales: dict[str, float] | None = None) -> float:
    """``task.steps`` AdamW steps on one client; with ``fractions`` each step trains one sampled nested width;
    ``scales`` multiplies the learning rate of the tensors that carry the folded scaler (see ``sub_scales``)."""
    gen = torch.Generator().manual_seed(seed)
    scales = scales or {}
    opt = torch.optim.AdamW([{"params": [p], "lr": task.lr * scales.get(n, 1.0)} for n, p in model.named_parameters()],
                            lr=task.lr)
    od = OrderedDropout(model, fractions, seed=seed) if fractions else None
    model.train()
    start = time.perf_counter()
    for _ in range(task.steps):
        batch = task.batch_of(client, gen)
        forward = model if od is None else partial(od, od.sample())
        loss, _ = task.forward_loss(forward, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return time.perf_counter() - start


def run_arm(task: Task, arm: str, regime: str, seed: int) -> dict:
    """One federated run of the library's width-slicing method through the in-process driver
    (:func:`fedfusion.fusion.inprocess.run_rounds`); returns the final metric (mean of the last 3 rounds) and timings."""
    cfg = task.config
    family = family_of(cfg)
    widths = client_widths(regime, len(task.clients), seed)
    smallest, ladder = min(widths), sorted(set(widths))
    if arm == "exclusive_largest" and max(widths) < 1.0:
        return {"metric": None, "note": "no client holds the target"}
    torch.manual_seed(seed)
    state = family.build(cfg).state_dict()
    held = [{"smallest_only": smallest, "oracle": 1.0}.get(arm, w) for w in widths]
    tiers = [None if arm == "exclusive_largest" and w < 1.0 else f"w{w:g}" for w in held]
    method = SubModelMethod(cfg, {f"w{w:g}": w for w in set(held)}, state, policy=POLICY.get(arm, "static"),
                            stride=task.stride, stagger=arm.startswith("rolling"), run_seed=seed,
                            scale=not arm.endswith("_unscaled"))
    slowest: dict[int, float] = {}  # round -> its slowest client's training seconds

    def train(rnd: int, payload: Payload) -> tuple[dict, dict]:
        plan, sliced_from = payload.context[:2]  # (plan, the target it was cut from, low-rank flag)
        sub = family.build(sub_config(cfg, plan))
        sub.load_state_dict(payload.arrays)
        c, w = payload.client.partition, payload.width
        fractions = ordered_fractions(w, ladder) if arm == "ordered" else None
        scales = sub_scales(cfg, plan, sliced_from) if arm.endswith("_lrscaled") else None
        took = local_train(task, sub, c, seed * 7919 + rnd * 31 + c, fractions if fractions != (1.0,) else None, scales)
        slowest[rnd] = max(slowest.get(rnd, 0.0), took)
        reply = {k: v.detach() for k, v in sub.state_dict().items()}
        return reply, {"train_s": took, "train_tokens": 0, "num-examples": len(task.clients[c][0])}

    def evaluate(state: dict, rnd: int) -> dict | None:
        if rnd <= task.rounds - 3:
            return None
        if arm == "smallest_only":  # the global model of smallest-only is the small model itself
            plan = plan_slice(cfg, smallest, "static")
            model = family.build(sub_config(cfg, plan))
            model.load_state_dict(extract(state, cfg, plan))
        else:
            model = family.build(cfg)
            model.load_state_dict(state)
        return {"metric": task.evaluate(model)}

    _, stats = run_rounds({t: method for t in set(tiers) if t is not None}, tiers, state, train,
                          Rounds(rounds=task.rounds, per_round=task.per_round, seed=seed), evaluate)
    return {"metric": statistics.mean(r["metric"] for r in stats.history), "server_s": stats.server_s,
            "client_s": stats.client_s, "slowest_s": sum(slowest.values())}


def systems_bytes() -> list[dict]:
    """Bytes a client receives (Flower ArrayRecord) vs its sub-model's parameter bytes, fp32 and fp16."""
    from flwr.app import ArrayRecord

    cfg = LlamaConfig(vocab_size=100, hidden_size=128, intermediate_size=512, num_hidden_layers=4,  # the quickstart target
                      num_attention_heads=8, num_key_value_heads=8, head_dim=16, tie_word_embeddings=False)
    family = family_of(cfg)
    torch.manual_seed(0)
    state = family.build(cfg).state_dict()
    rows = []
    for w in (1.0, 0.5, 0.25, 0.125):
        plan = plan_slice(cfg, w, "rolling", 3)
        sub = extract(state, cfg, plan)
        params = family.param_count(sub_config(cfg, plan))
        rows.append({"width": w, "param_bytes": 4 * params, "sent_fp32": ArrayRecord(sub).count_bytes(),
                     "sent_fp16": ArrayRecord({k: v.half() for k, v in sub.items()}).count_bytes()})
    return rows


def memory_probe(clients: int, rule: str) -> dict[str, int]:
    """Peak RSS (bytes) of a fresh process before (target built) and after it folds ``clients`` width-1/2 updates of a 6.5M-parameter
    Llama target into a SelectiveAverager (each update built, added and dropped in turn, as replies stream in).
    Read from ``VmHWM``: a child's ``ru_maxrss`` starts at its parent's peak on Linux, so it cannot measure this."""
    code = (
        "import re, torch; torch.set_num_threads(1)\n"
        "def hwm():\n"
        "    return int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)) * 1024\n"
        "from transformers import LlamaConfig\n"
        "from fedfusion.models.slicing import SelectiveAverager, extract, plan_slice\n"
        "from fedfusion.models.families import family_of\n"
        "cfg = LlamaConfig(vocab_size=100, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,"
        " num_attention_heads=8, num_key_value_heads=8, head_dim=32)\n"
        "state = {k: v.clone() for k, v in family_of(cfg).build(cfg).state_dict().items()}\n"
        "before = hwm()\n"
        f"avg = SelectiveAverager(state, cfg, {rule!r})\n"
        f"for i in range({clients}):\n"
        "    plan = plan_slice(cfg, 0.5, 'random', seed=i)\n"
        "    avg.add(extract(state, cfg, plan), plan)\n"
        "new = avg.result()\n"
        "print(before, hwm())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    before, after = map(int, out.stdout.strip().splitlines()[-1].split())
    return {"before": before, "peak": after, "added": after - before}


def _fmt(values: list[float]) -> str:
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} ± {sd:.4f}"


def report(results: dict, systems: dict, args: argparse.Namespace, commands: list[str] | tuple[str, ...] = ()) -> str:
    """Markdown tables and the three claims of the issue, computed from ``results``; ``commands``: the command that
    wrote the results, then any earlier ones whose runs they kept."""
    lines = ["# Width slicing: arms x regimes x tasks", "", *(f"Command: `{c}`\n" for c in commands),
             f"Seeds {args.seeds}; {args.rounds} rounds x {args.per_round} clients x {args.steps} local steps; "
             f"machine: {platform.machine()}, {platform.python_version()}, torch {torch.__version__}, "
             "1 thread. Final metric = mean of the last 3 rounds' evaluations of the global model "
             "(smallest-only: the small model). Fashion-MNIST: test accuracy (higher is better); "
             "LM: held-out next-character loss (lower is better).", ""]
    claims = []
    for task, regimes in results.items():
        better = max if task.startswith("fmnist") else min
        lines += [f"## {task}", "", "| arm | " + " | ".join(regimes) + " |", "|---" * (len(regimes) + 1) + "|"]
        for arm in (a for a in (*ARMS, *EXTRA_ARMS) if any(a in runs for runs in regimes.values())):
            cells = [_fmt([r["metric"] for r in regimes[g].get(arm, []) if r["metric"] is not None]) for g in regimes]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        lines.append("")
        mean = {g: {a: statistics.mean([r["metric"] for r in runs]) for a, runs in regimes[g].items()
                    if runs and all(r["metric"] is not None for r in runs)} for g in regimes}
        complete = {"smallest_only", "static", "rolling", "random", "ordered", "oracle"}
        if not complete <= set(mean.get("uniform", mean.get("small_to_large", {}))):
            continue  # a partial set of arms: tables only
        if "small_to_large" in mean:
            m = mean["small_to_large"]
            claims.append(f"- (a) {task}, small-to-large: static {m['static']:.4f}, rolling {m['rolling']:.4f}, "
                          f"random {m['random']:.4f}, ordered {m['ordered']:.4f}")
        if "uniform" in mean:
            m = mean["uniform"]
            beat = [a for a in ("static", "rolling", "random", "ordered") if better(m[a], m["smallest_only"]) == m[a]]
            listed = ", ".join(f"{a} {m[a]:.4f}" for a in ("static", "rolling", "random", "ordered"))
            claims.append(f"- (b) {task}, uniform: smallest-only {m['smallest_only']:.4f}; methods beating it: "
                          f"{', '.join(beat) or 'none'} ({listed})")
        if task == "lm":
            for g, m in mean.items():
                closure = {a: (m["smallest_only"] - m[a]) / (m["smallest_only"] - m["oracle"])
                           for a in ("static", "rolling", "random", "ordered")}
                best = max(closure, key=closure.get)
                claims.append(f"- (c) lm, {g}: gap closure (loss) " + ", ".join(f"{a} {c:.2f}" for a, c in closure.items())
                              + f"; best {best} {closure[best]:.2f}")
    lines += ["## Claims", "", *claims, "", "## Systems", ""]
    lines += ["Server share of a round = (extraction + aggregation) / (that + slowest client), from the rolling arm:", ""]
    for task, share in systems["server_share"].items():
        lines.append(f"- {task}: {share:.3f}")
    lines += ["", "| width | sub-model param bytes | sent fp32 | sent fp16 |", "|---|---|---|---|"]
    for row in systems["bytes"]:
        lines.append(f"| {row['width']} | {row['param_bytes']} | {row['sent_fp32']} | {row['sent_fp16']} |")
    lines += ["", "Server peak RSS (whole process) folding width-1/2 updates of a 6.5M-parameter (26 MB) target:", ""]
    for key, value in systems["memory"].items():
        lines.append(f"- {key}: peak {value['peak'] / 2**20:.0f} MiB, of which {value['added'] / 2**20:.0f} MiB "
                     "added by aggregation (process with target built: "
                     f"{value['before'] / 2**20:.0f} MiB)")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tasks", nargs="+", default=["lm", "fmnist-iid", "fmnist-skew"])
    parser.add_argument("--regimes", nargs="+", default=list(REGIMES))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=6, help="clients sampled per round")
    parser.add_argument("--steps", type=int, default=5, help="local steps per client and round")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=[*ARMS, *EXTRA_ARMS])
    parser.add_argument("--out", default="width_slicing", help="results/<out>.{json,md}")
    parser.add_argument("--skip-systems", action="store_true", help="keep the systems figures of an earlier run")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = {"rounds": args.rounds, "per_round": args.per_round, "steps": args.steps}
    builders = {"lm": lambda: lm_task(**sizes), "fmnist-iid": lambda: fmnist_task(False, **sizes),
                "fmnist-skew": lambda: fmnist_task(True, **sizes)}
    partial_path, final_path = RESULTS / f"{args.out}.partial.json", RESULTS / f"{args.out}.json"
    earlier = json.loads(final_path.read_text()) if final_path.is_file() else {}
    results: dict = json.loads(partial_path.read_text()) if partial_path.is_file() else earlier.get("results", {})
    shares: dict = {}
    for name in args.tasks:
        task = builders[name]()
        for regime in args.regimes:
            runs = results.setdefault(name, {}).setdefault(regime, {})
            for arm in args.arms:
                if len(runs.get(arm, [])) == len(args.seeds):
                    continue  # finished in an earlier invocation
                runs[arm] = []
                for seed in args.seeds:
                    start = time.perf_counter()
                    out = run_arm(task, arm, regime, seed)
                    runs[arm].append(out)
                    print(f"{name} {regime} {arm} seed {seed}: {out['metric']} ({time.perf_counter() - start:.1f}s)",
                          flush=True)
                RESULTS.mkdir(exist_ok=True)
                partial_path.write_text(json.dumps(results))
    for name, regimes in results.items():
        rolling = [r for g in regimes.values() for r in g.get("rolling", [])]
        if rolling:
            shares[name] = sum(r["server_s"] for r in rolling) / sum(r["server_s"] + r["slowest_s"] for r in rolling)
    systems = {**earlier.get("systems", {"bytes": [], "memory": {}}), "server_share": shares}
    if not args.skip_systems:
        systems["bytes"] = systems_bytes()
        systems["memory"] = {f"{rule}, {n} clients": memory_probe(n, rule) for rule, n in
                             (("mean", 10), ("mean", 50), ("median", 10), ("median", 20))}
    RESULTS.mkdir(exist_ok=True)
    command = shlex.join(["python", "benchmarks/width_slicing.py", *sys.argv[1:]])
    payload = {"command": command, "args": vars(args), "results": results, "systems": systems,
               "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}
    final_path.write_text(json.dumps(payload, indent=1))
    (RESULTS / f"{args.out}.md").write_text(report(results, systems, args, [command]))
    partial_path.unlink(missing_ok=True)
    print((RESULTS / f"{args.out}.md").read_text())


if __name__ == "__main__":
    main()
