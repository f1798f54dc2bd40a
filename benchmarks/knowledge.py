"""Benchmark: federated knowledge. Does the target recall more of all clients' private facts than the small
model the devices could train alone?

Task (``fedfusion.data.facts``): seeded synthetic biographies (bioS-style: first/middle/last names, six random
attributes, three paraphrases), each client owning a disjoint, Zipf-skewed set of people; a word-level
tokenizer; probes = one prompt per (person, attribute), scored by greedy exact match (``probe_acc``), nats per
answer token (``answer_loss``) and knowledge bits. The data and training both follow the seed.

Every arm runs the library's in-process round loop (``fedfusion.fusion.inprocess``: the Flower strategy's planning,
extraction, client training step and fold), so arms see the same clients, samples and seeds:

- ``smallest_only``: every client trains the smallest width (FedAvg), as the static slice of a target silenced
  around it (``fedfusion.models.growth``), so the scored target *is* that small model (``smallest_only_hetero``:
  the same with HeteroFL's scaler, scored as the extracted small model: earlier results' arm);
- ``grow_*``: the smallest_only run for ``--grow-round`` rounds, then the grown target trains on: ``grow_oracle``
  every client the whole target (a reference no device of the regime holds), ``grow_rolling`` rolling slices in
  their own forward pass, ``grow_ff`` full-forward windows of ``--window-width`` of the units (one window per
  round), ``grow_ffst`` such windows laid end to end, ``grow_ff_shared`` / ``grow_ffst_shared`` with embeddings and norms
  in every window; ``ff``: full-forward windows from round 1 (no growth). Equal budget: the same rounds, clients, local
  steps, optimizer and data as every other arm;
- ``oracle``: every client trains the whole target;
- ``static`` / ``rolling`` / ``random`` / ``owned``: width slicing at each client's own width (``owned``: a
  window fixed per client, see ``fedfusion.models.slicing``); ``*_nesterov`` / ``*_avgm``: the same with a server-side
  outer optimizer on the aggregated change (``fedfusion.fusion.outer``);
- ``generative``: each client keeps a small model of its own and sends samples of it; the server trains the target
  on them (``fedfusion.fusion.generative.reply``). Also reported: what the devices' own models know at the end (the ceiling of
  what their samples can carry) and the best single device's recall; ``generative_grow``: the smallest_only run
  for ``--grow-round`` rounds, then generative distillation whose devices start from their slices of the grown
  target and whose server trains the grown target (``fusion.grow_round`` with ``fusion.method=generative``), to
  ``--gen-rounds`` rounds in all;
- ``feddf_public``: FedDF on a public transfer set (biographies of as many people again, owned by nobody): the
  smallest_only federation, with the target distilled from its model's logits on the public text with the
  generative arm's server budget (``fedfusion.fusion.inprocess.run_transfer``). Public text cannot carry private facts:
  this arm measures how much of the target's recall that leaves.

Regimes: ``phones`` (every client at width 1/8 of attention heads and MLP neurons: ~1/4 of the target's
parameters with the embeddings it keeps whole), ``tiny`` (width 1/4 of heads, neurons and hidden dims: a
genuinely smaller Llama, ~1/11 of the target; only the arms that do not fold slices, since slicing hidden dims
apart between clients breaks the target), ``mixed`` (half at 1/8, half at 1/4; adds ``tier_<w>`` arms, each
tier's own model trained by that tier's clients alone; their partitions are renumbered, so their seeds differ).

    python benchmarks/knowledge.py [--seeds 0 1 2] [--regimes phones tiny] [--arms ...] [--people 400]
        [--rounds 600 --per-round 6 --steps 1] [--gen-rounds 60] [--task facts|lm] [--jobs 2] [--out knowledge]
    python benchmarks/knowledge.py --capacity --people 100 200 400 800 [--capacity-steps 1500]
    python benchmarks/knowledge.py --report-only [--out knowledge]

``--capacity`` trains each regime's client model and the full target centrally (one device holding every fact,
the same number of AdamW steps) on growing fact counts: the curve that shows whether capacity binds
(``results/knowledge_capacity.{json,md}``). The federated run writes ``benchmarks/results/<out>.{json,md,png}``;
finished (regime, arm, seed) runs are kept in ``<out>.partial.json`` so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig

from fedfusion.config.choices import POLICIES
from fedfusion.data.facts import (
    encode_documents,
    encode_probes,
    facts_tokenizer,
    load_facts,
    probe_hits,
    probe_metrics,
    write_facts,
)
from fedfusion.data.text import (
    build_char_tokenizer,
    encode_text,
    lm_windows,
    load_shakespeare_roles,
    read_jsonl,
    split_text,
)
from fedfusion.devices.catalog import load_catalog
from fedfusion.devices.energy import price_work
from fedfusion.devices.memory import FROZEN_BITS, estimate_memory
from fedfusion.fusion.generative.config import DEVICE_STATES, GenerativeConfig
from fedfusion.fusion.generative.inprocess import GenerativeRun, run_generative
from fedfusion.fusion.inprocess import SubModelRun, TransferRun, run_submodel, run_transfer
from fedfusion.fusion.outer import OuterConfig
from fedfusion.models.build import model_from_state
from fedfusion.models.families import family_of
from fedfusion.models.slicing import extract, plan_slice, sub_config
from fedfusion.train.loop import evaluate_lm, train_steps
from fedfusion.wire.quantize import Wire

RESULTS = Path(__file__).resolve().parent / "results"
PRIMARY = {"facts": ("probe_acc", "answer_loss"), "lm": ("eval_loss", "eval_acc")}  # task -> (gap-closure metric, other)
HIGHER_IS_BETTER = {"facts": True, "lm": False}  # the primary metric's direction
# regime -> (client widths, dealt in equal shares; sliced axes). "tiny": clients hold a genuinely smaller Llama
# (a quarter of the heads, MLP neurons and hidden dims: ~1/11 of the target's parameters); "tiny8": an eighth of
# each (with --hidden 128 --intermediate 512 the same client model as "tiny" at the defaults, under a target 4x
# larger). Slicing the hidden dims apart between clients breaks the target, so those regimes run the methods that
# do not fold slices.
REGIMES = {"phones": ((0.125,), ("heads", "neurons")), "mixed": ((0.125, 0.25), ("heads", "neurons")),
           "tiny": ((0.25,), ("heads", "neurons", "hidden")), "tiny8": ((0.125,), ("heads", "neurons", "hidden"))}
OUTER = {"nesterov": OuterConfig("nesterov", lr=0.7, momentum=0.9), "avgm": OuterConfig("avgm", lr=1.0, momentum=0.5),
         "sum": OuterConfig("avgm", lr=6.0, momentum=0.0)}
ARMS = ("smallest_only", "oracle", "static", "rolling", "random", "owned", "generative", "feddf_public")


def target_config(vocab: int, seq_len: int, hidden: int, intermediate: int, layers: int) -> LlamaConfig:
    """The target: a small Llama with heads of 8 dims and tied embeddings."""
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=hidden // 8, num_key_value_heads=hidden // 8, head_dim=8,
                       max_position_embeddings=seq_len + 1, tie_word_embeddings=True)


@dataclass
class Task:
    """What every arm of one seed shares: the target config, each client's training windows, the scorer, and for
    facts the public transfer windows and each probe's owner (its index into ``windows``)."""

    config: LlamaConfig
    windows: list[torch.Tensor]
    score: Callable[[torch.nn.Module], dict[str, float]]
    transfer: torch.Tensor | None = None
    hits: Callable[[torch.nn.Module], torch.Tensor] | None = None
    owner: torch.Tensor | None = None


def build_lm_task(clients: int, seed: int, a: dict) -> Task:
    """Shakespeare by speaker (roles with >= 4000 characters, drawn by the seed), character tokens; scored on
    every role's held-out tail (loss in nats/char, next-character accuracy)."""
    tok = build_char_tokenizer()
    roles = load_shakespeare_roles(min_chars=4000)
    picked = np.random.default_rng(seed).choice(len(roles), size=clients, replace=False)
    windows, held = [], []
    for i in sorted(picked):
        train, tail = split_text(roles[i].text, 0.1)
        windows.append(lm_windows(encode_text(tok, train), a["seq_len"]))
        held.append(lm_windows(encode_text(tok, tail), a["seq_len"])[:16])
    cfg = target_config(len(tok), a["seq_len"], a["hidden"], a["intermediate"], a["layers"])
    pooled = torch.cat(held)
    return Task(cfg, windows, lambda model: {k: v for k, v in evaluate_lm(model, pooled).items() if k != "eval_ppl"})


def build_task(people: int, clients: int, seed: int, a: dict, workdir: Path) -> Task:
    """The benchmark's task: a fresh facts dataset (and as many public people, owned by nobody, for the transfer
    set) written to and read from files, scored by its probes; or with ``a["task"] == "lm"`` Shakespeare
    (:func:`build_lm_task`)."""
    if a.get("task") == "lm":
        return build_lm_task(clients, seed, a)
    paths = write_facts(workdir / f"facts-{people}-{clients}-{seed}", clients, people, seed, public=people)
    facts = load_facts(paths["train"], paths["probes"])
    tok = facts_tokenizer(facts)
    windows = [encode_documents(tok, docs, a["seq_len"]) for docs in facts.documents]
    cfg = target_config(len(tok), a["seq_len"], a["hidden"], a["intermediate"], a["layers"])
    probes = encode_probes(tok, facts.probes)
    public = [str(r["text"]) for r in read_jsonl(paths["public"], ("client", "text"))]
    owner = torch.tensor([facts.clients.index(p.client) for p in facts.probes])
    return Task(cfg, windows, lambda model: probe_metrics(model, probes), encode_documents(tok, public, a["seq_len"]),
                lambda model: probe_hits(model, probes), owner)


def without_outer(arm: str, default: OuterConfig) -> tuple[str, OuterConfig]:
    """An arm's base name and server optimizer: its ``_<outer>`` suffix's (:data:`OUTER`), else ``default``."""
    for name, config in OUTER.items():
        if arm.endswith(f"_{name}"):
            return arm[: -len(name) - 1], config
    return arm, default


def arm_setup(arm: str, ladder: tuple[float, ...], clients: int,
              default: OuterConfig) -> tuple[list[float], str, OuterConfig, float | None]:
    """(widths per partition, policy, outer optimizer, width of the model scored: None = the target).

    An arm is a base (smallest_only, oracle, tier_<w>, or a slicing policy) with an optional ``_<outer>`` suffix."""
    base, outer = without_outer(arm, default)
    widths = [ladder[i % len(ladder)] for i in range(clients)]
    if base == "smallest_only_hetero":  # the HeteroFL-scaled small model (earlier results' smallest_only)
        return [min(ladder)] * clients, "static", outer, min(ladder)
    if base == "oracle":
        return [1.0] * clients, "static", outer, None
    if base == "generative_grow":  # smallest-only rounds, then generative distillation from the grown small model
        return widths, "generative", outer, None
    if base == "feddf_public":  # the smallest_only federation, its model distilled into the target on public text
        return [min(ladder)] * clients, "feddf", outer, None
    if base.startswith("tier_"):  # one tier's clients alone, training that tier's own model
        w = float(base[5:])
        return [w if x == w else 0.0 for x in widths], "static", outer, w
    return widths, base, outer, None


# Grow-then-fuse arms (fedfusion.models.growth; SubModelMethod's grow_round and forward): the first --grow-round rounds
# train the smallest slice of a target silenced around it (smallest-only training: the target *is* that small
# model), then the whole grown target trains as the arm says. smallest_only is the same run that never grows.
GROWTH = {
    "smallest_only": dict(policy="static", grow_round=-1),
    # then every client trains the whole target (a window of every unit, embeddings and norms too): a reference no
    # device of the regime could hold
    "grow_oracle": dict(policy="static", forward="full", window_shared=True, window_width=1.0),
    "grow_rolling": dict(policy="rolling", stagger=True),  # then rolling slices in their own forward pass
    "grow_ff": dict(policy="rolling", stagger=False, forward="full"),  # then full-forward windows, one per round
    "grow_ffst": dict(policy="rolling", stagger=True, forward="full"),  # full-forward windows laid end to end
    "grow_ff_shared": dict(policy="rolling", stagger=False, forward="full", window_shared=True),  # + embeddings, norms
    # + the small model's units in every window (what the devices trained before growth keeps training every round)
    "grow_ffcore_shared": dict(policy="rolling", stagger=False, forward="full", window_shared=True, window_core=True),
    # + the small model's units, and each client's own window of the rest, the same every round (owned): what a
    # client's data teaches always lands in the same units
    # + the core trained in the small model's own forward pass (exactly smallest-only's steps) and the rest of the
    # window in the target's, with the core read as fixed: the target is the small model plus what it adds
    "grow_ffsmall_shared": dict(policy="rolling", stagger=False, forward="full", window_shared=True, window_core=True,
                                core_forward="small"),
    "grow_ffcore_owned_shared": dict(policy="owned", forward="full", window_shared=True, window_core=True),
    "grow_ffcore_owned": dict(policy="owned", forward="full", window_core=True),
    "grow_ffst_shared": dict(policy="rolling", stagger=True, forward="full", window_shared=True),
    "ff": dict(policy="rolling", stagger=False, forward="full", grow_round=0),  # full-forward from scratch
    # then every client trains a rank-r update of every matrix of the whole target (--window-rank), norms exactly
    "grow_lr": dict(policy="static", forward="full", window_rank=True),
    "grow_lr_shared": dict(policy="static", forward="full", window_rank=True, window_shared=True),  # embeddings exact
}


def growth_fields(arm: str, rounds: int, grow_round: int, rank: int) -> dict | None:
    """The SubModelRun settings of a grow-then-fuse arm (None for other arms); ``grow_round`` -1 means every round;
    a low-rank arm trains rank ``rank``."""
    if arm not in GROWTH:
        return None
    fields = dict(GROWTH[arm])
    g = fields.pop("grow_round", grow_round)
    if fields.get("window_rank"):
        fields["window_rank"] = rank
    return {"stagger": False, "scale": False, **fields, "grow_round": rounds if g == -1 else g}


def memory_ratio(cfg: LlamaConfig, a: dict, growth: dict | None, client_params: int, widths: list[float],
                 axes: tuple[str, ...]) -> float:
    """Peak training memory of the full target trained with AdamW over that of the largest client's training, both
    as the planner estimates them (:func:`fedfusion.devices.memory.estimate_memory`; batch and sequence of the run)."""
    batch, seq = a["batch"], a["seq_len"]
    full = estimate_memory(cfg, batch, seq).total
    if growth is not None and growth.get("forward") == "full":
        client = estimate_memory(cfg, batch, seq, base_bits=FROZEN_BITS[a["frozen"]], window=client_params).total
    else:
        client = estimate_memory(sub_config(cfg, plan_slice(cfg, max(widths), "static", axes=axes)), batch, seq).total
    return full / client


def scaled(arm: str) -> tuple[str, bool]:
    """An arm without its ``_unscaled`` marker, and whether the folded scaler is on."""
    return (arm.replace("_unscaled", ""), False) if "_unscaled" in arm else (arm, True)


def run_arm(job: dict) -> dict:
    """One (regime, arm, seed): the final probe metrics (mean of the last 3 rounds), their spread, and costs."""
    torch.set_num_threads(1)
    a = job["args"]
    with tempfile.TemporaryDirectory() as tmp:
        task = build_task(a["people"], a["clients"], job["seed"], a, Path(tmp))
    cfg, windows, score = task.config, task.windows, task.score
    arm, scale = scaled(job["arm"])
    widths, policy, outer, scored = arm_setup(arm, REGIMES[job["regime"]][0], a["clients"],
                                              OuterConfig(a["outer"], lr=a["outer_lr"]))
    growth = growth_fields(without_outer(arm, outer)[0], a["rounds"], a["grow_round"], a["window_rank"])
    if growth is not None:  # every client at the smallest width until growth; the target is scored throughout
        widths, scored = [min(REGIMES[job["regime"]][0])] * a["clients"], None
    keep = [i for i, w in enumerate(widths) if w > 0]
    torch.manual_seed(job["seed"])
    initial = family_of(cfg).build(cfg).state_dict()
    axes = REGIMES[job["regime"]][1]
    small = plan_slice(cfg, scored, "static", axes=axes) if scored is not None else None

    rounds = a["gen_rounds"] if arm.startswith("generative") else a["rounds"]
    primary, _ = PRIMARY[a["task"]]

    def evaluate(state: dict, rnd: int) -> dict | None:
        if rnd <= rounds - 3 and rnd % a["eval_every"]:
            return None
        model = (model_from_state(cfg, state) if small is None
                 else model_from_state(sub_config(cfg, small), extract(state, cfg, small)))
        scores = score(model)
        print(f"  {job['regime']} {job['arm']} seed {job['seed']} round {rnd}/{rounds}: {primary} {scores[primary]:.3f}",
              flush=True)
        return scores

    start, ceiling = time.perf_counter(), {}
    settings = dict(policy="static" if policy == "feddf" else policy, stagger=policy == "rolling", scale=scale)
    run = SubModelRun(cfg, [windows[i] for i in keep], [widths[i] for i in keep], rounds=a["rounds"],
                      per_round=a["per_round"], steps=a["steps"], lr=a["lr"], batch_size=a["batch"], seed=job["seed"],
                      stride=a["stride"], axes=axes, outer=outer, optimizer=a["optimizer"],
                      wire=Wire(a.get("wire_down", "float32"), a.get("wire_up", "float32"), a.get("error_feedback", True)),
                      frozen=a["frozen"], **{"window_width": a["window_width"], **settings, **(growth or {})})
    if policy == "generative":  # each client's own model: the smallest width, as smallest_only trains it
        gen_run = GenerativeRun(cfg, min(widths), windows, axes, rounds=a["gen_rounds"], per_round=a["per_round"],
                                steps=a["gen_steps"], lr=a["gen_lr"], batch_size=a["batch"], seed=job["seed"],
                                generative=GenerativeConfig(sample_fraction=a["gen_samples"], temperature=a["gen_temperature"],
                                                            server_steps=a["gen_server_steps"], server_lr=a["gen_server_lr"],
                                                            top_k=a.get("gen_top_k", 0),
                                                            device_state=a.get("gen_device_state", "server")),
                                grow_round=a["grow_round"] if arm == "generative_grow" else 0)
        _, stats, devices = run_generative(gen_run, initial, evaluate)
        if task.hits is not None:
            ceiling = device_ceiling(task, gen_run.client_config, devices)
    elif policy == "feddf":  # server budget as generative's: gen_server_steps every rounds / gen_rounds rounds
        if task.transfer is None:
            raise SystemExit("feddf_public needs the facts task's public transfer set")
        transfer = TransferRun(run, task.transfer, every=max(1, a["rounds"] // a["gen_rounds"]),
                               steps=a["gen_server_steps"], lr=a["gen_server_lr"])
        _, stats = run_transfer(transfer, initial, initial, evaluate)
    else:
        _, stats = run_submodel(run, initial, evaluate)
    last = stats.history[-3:]
    target_params = family_of(cfg).param_count(cfg)
    phone = load_catalog(None)["phone"]
    energy = price_work(phone, stats.flops, stats.bytes_down, stats.bytes_up).wall_j
    server_j = price_work(load_catalog(None)["cloud-a100"], stats.server_flops, 0, 0).wall_j
    return {
        **{key: statistics.mean(r[key] for r in last) for key in last[0] if key != "round"},
        "spread": max(r[primary] for r in last) - min(r[primary] for r in last),
        "client_params_max": stats.max_client_params, "target_params": target_params,
        "size_ratio": target_params / stats.max_client_params,
        "memory_ratio": memory_ratio(cfg, a, growth, stats.max_client_params, [widths[i] for i in keep], axes),
        "bytes": stats.bytes_down + stats.bytes_up, "bytes_down": stats.bytes_down, "bytes_up": stats.bytes_up,
        "energy_j": energy, "server_j": server_j,
        "wall_s": time.perf_counter() - start,
        "client_s": stats.client_s, "server_s": stats.server_s, "history": stats.history, **ceiling,
    }


def device_ceiling(task: Task, config: LlamaConfig, devices: dict[int, dict[str, torch.Tensor]]) -> dict[str, float]:
    """What the devices' own models know at the end of a generative run: ``devices_union_acc``, the share of all
    probes answered by the model of the client that owns them (what their samples can carry at best: the
    target's ceiling), and ``best_device_acc``, the best single device's model scored on every probe. A client
    never sampled has no model and answers nothing."""
    assert task.hits is not None and task.owner is not None
    union, best = 0, 0.0
    for client, state in devices.items():
        hits = task.hits(model_from_state(config, state))
        union += int(hits[task.owner == client].sum())
        best = max(best, float(hits.float().mean()))
    return {"devices_union_acc": union / len(task.owner), "best_device_acc": best}


def capacity_point(job: dict) -> dict:
    """Central training (AdamW, one device holding every fact) of one regime's small model or the full target on
    ``people`` people for a fixed number of steps: the probe accuracy it reaches."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        task = build_task(job["people"], 1, 0, job, Path(tmp))
    cfg, windows, score = task.config, task.windows, task.score
    torch.manual_seed(0)
    state = family_of(cfg).build(cfg).state_dict()
    widths, axes = REGIMES[job["model"]] if job["model"] in REGIMES else ((1.0,), REGIMES["phones"][1])
    plan = plan_slice(cfg, min(widths), "static", axes=axes)
    model = model_from_state(sub_config(cfg, plan), extract(state, cfg, plan))
    out = train_steps(model, windows[0], job["capacity_steps"], job["capacity_lr"], job["batch"], seed=0)
    return {"people": job["people"], "model": job["model"], "steps": job["capacity_steps"], "train_s": out.seconds,
            "params": sum(p.numel() for p in model.parameters()), **score(model)}


def _mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def summarise(results: dict, task: str = "facts") -> dict:
    """Per regime: gap closure of every arm on the task's primary metric (facts: probe accuracy; lm: held-out
    loss), from the means over seeds; the best arm overall, or None.

    The best arm is one a device of its regime can train (not an oracle, not smallest-only) that does better than
    smallest-only on the mean of its primary metric; among those, the one furthest ahead of smallest-only in units
    of the regime's |oracle - smallest-only| (its gap closure when the oracle beats smallest-only). An arm worse
    than or level with smallest-only is never the best arm, whatever its gap closure."""
    out, best = {}, None
    key, _ = PRIMARY[task]
    sign = 1.0 if HIGHER_IS_BETTER[task] else -1.0
    for regime, arms in results.items():
        mean = {arm: statistics.mean(r[key] for r in runs) for arm, runs in arms.items() if runs}
        if "smallest_only" not in mean or "oracle" not in mean:
            continue
        span = mean["oracle"] - mean["smallest_only"]
        closure = {arm: (m - mean["smallest_only"]) / span if span else float("nan") for arm, m in mean.items()}
        out[regime] = {"span": span, "gap_closure": closure}
        for arm, c in closure.items():
            # references no device of the regime could train (the oracles) are not candidates; c != c: NaN
            if arm in ("oracle", "smallest_only", "grow_oracle") or arm.startswith("tier_") or c != c:
                continue
            lead = sign * (mean[arm] - mean["smallest_only"]) / abs(span)
            if lead <= 0:  # not better than smallest-only
                continue
            ratio = statistics.mean(r["size_ratio"] for r in arms[arm])
            if best is None or lead > best["lead"]:
                best = {"regime": regime, "arm": arm, "gap_closure": c, "size_ratio": ratio, "lead": lead}
    return {"regimes": out, "best": best}


def server_optimizer_note(a: dict) -> str:
    """Runs recorded since generative v2 (their args hold ``gen_top_k``) keep the server's AdamW across rounds;
    earlier ones built a fresh one every round."""
    return ", one AdamW kept across rounds" if "gen_top_k" in a else ", a fresh AdamW every round"


def top_k_note(a: dict) -> str:
    """How the generative server fits the samples: the sampled tokens, or each position's top-k teacher tokens."""
    return f", fitting each sampled position's top-{a['gen_top_k']} teacher tokens" if a.get("gen_top_k") else ""


def _describe(a: dict) -> str:
    task = (f"{a['people']} people x 6 attributes ({6 * a['people']} facts) over {a['clients']} clients (Zipf-skewed)"
            if a["task"] == "facts" else
            f"Shakespeare by speaker: {a['clients']} roles with >= 4,000 characters, character tokens, scored on "
            "every role's held-out tail")
    return (f"Seeds {a['seeds']}; {task}. Parameter-folding arms: {a['rounds']} rounds x {a['per_round']} clients x "
            f"{a['steps']} local {a['optimizer']} step(s) (batch {a['batch']}, lr {a['lr']}, seq {a['seq_len']}), server "
            f"optimizer {a['outer']} (lr {a['outer_lr']}) on each round's fold. Generative: {a['gen_rounds']} rounds x "
            f"{a['per_round']} clients x {a['gen_steps']} local AdamW steps (lr {a['gen_lr']}) on each client's own "
            f"model, {a['gen_samples']} sampled windows per own window, {a['gen_server_steps']} server steps (lr "
            f"{a['gen_server_lr']}{server_optimizer_note(a)}) per round{top_k_note(a)}. Metrics are the mean of "
            "the last 3 rounds; `spread` is the largest "
            "round-to-round difference of the primary metric among those 3 (mean over seeds): the noise next to any "
            "difference.")


def _mean_or_dash(values: list[float | None]) -> str:
    """The mean to one decimal, or - when any run lacks the value."""
    return "-" if any(v is None for v in values) else f"{statistics.mean(v for v in values if v is not None):.1f}"


def report(payload: dict) -> str:
    a, summary = payload["args"], payload["summary"]
    primary, other = PRIMARY[a["task"]]
    title = ("# Federated knowledge: does the target recall more than any device's model could?" if a["task"] == "facts"
             else "# Shakespeare (LM): the knowledge benchmark's methods carried back to next-character prediction")
    lines = [title, "", f"Machine: {payload['machine']}. {_describe(a)}", "",
             "Command: `" + payload.get("command", " ".join(["python benchmarks/knowledge.py", *payload["argv"]])) + "`", "",
             f"Wall seconds were taken with {a['jobs']} runs in parallel, one thread each: compare them within this table "
             "only.", ""]
    if payload.get("earlier"):
        lines += ["Runs of " + ", ".join(payload["earlier"]) + " come from an earlier invocation with the same settings "
                  "on the same machine kind (resumed from `<out>.partial.json`).", ""]
    extra = " knowledge bits |" if a["task"] == "facts" else ""
    for regime, arms in payload["results"].items():
        closure = summary["regimes"].get(regime, {}).get("gap_closure", {})
        widths, axes = REGIMES[regime]
        lines += [f"## {regime} (client widths {widths} of {', '.join(axes)})", "",
                  f"| arm | {primary} | spread | {other} |{extra} gap closure | size ratio | "
                  "memory ratio | MB moved | clients' J (phone) | server J (A100) | wall s |", "|---" * (11 + bool(extra)) + "|"]
        for arm, runs in arms.items():
            if not runs:
                continue
            bits = f" {statistics.mean(r['knowledge_bits'] for r in runs):.0f} |" if extra else ""
            lines.append(
                f"| {arm} | {_mean_sd([r[primary] for r in runs])} | {statistics.mean(r['spread'] for r in runs):.3f} | "
                f"{_mean_sd([r[other] for r in runs])} |{bits} "
                f"{closure.get(arm, float('nan')):.2f} | {statistics.mean(r['size_ratio'] for r in runs):.1f} | "
                f"{_mean_or_dash([r.get('memory_ratio') for r in runs])} | {statistics.mean(r['bytes'] for r in runs) / 1e6:.1f} | "
                f"{statistics.mean(r['energy_j'] for r in runs):.2f} | "
                f"{statistics.mean(r['server_j'] for r in runs):.2f} | {statistics.mean(r['wall_s'] for r in runs):.0f} |")
        if regime in summary["regimes"]:
            lines += ["", f"Span (oracle - smallest-only {primary}): {summary['regimes'][regime]['span']:.3f}."]
        for name in ("generative", "generative_grow"):
            gen = [r for r in arms.get(name, []) if "devices_union_acc" in r]
            if gen:
                lines += ["", f"{name}'s devices at the end of the run: each owner's own model recalls "
                          f"{_mean_sd([r['devices_union_acc'] for r in gen])} of all probes (the ceiling of what their "
                          f"samples can teach the target); the best single device alone {_mean_sd([r['best_device_acc'] for r in gen])}."]
        lines.append("")
    if summary["best"]:
        b = summary["best"]
        lines += [f"**Best arm**: `{b['arm']}` ({b['regime']}): gap closure {b['gap_closure']:.2f} at size ratio "
                  f"{b['size_ratio']:.1f}.", ""]
    elif summary["regimes"]:
        lines += [f"**Best arm**: none. No arm a device can train does better than smallest-only on the mean {primary}.",
                  ""]
    lines += [f"Gap closure = (arm - smallest_only) / (oracle - smallest_only) on the mean {primary}. Size ratio = "
              "target parameters / the largest client's trained parameters; memory ratio = the full target's peak training "
              "memory with AdamW / the largest client's, both as `fedfusion plan` estimates them (runs from before it "
              "was recorded show -). Priced joules: the clients' counted "
              "work (6 x params x tokens, plus 2 x params per sampled token) and bytes on the catalog's phone "
              "profile; the server's own training (generative) on the cloud-a100 profile.", ""]
    return "\n".join(lines)


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    primary, _ = PRIMARY[payload["args"]["task"]]
    regimes = payload["results"]
    fig, axes = plt.subplots(1, len(regimes), figsize=(6 * len(regimes), 4), squeeze=False)
    for ax, (regime, arms) in zip(axes[0], regimes.items()):
        for arm, runs in arms.items():
            rounds = [h["round"] for h in runs[0]["history"]]
            values = [statistics.mean(r["history"][i][primary] for r in runs) for i in range(len(rounds))]
            ax.plot([r / rounds[-1] for r in rounds], values, marker=".", label=f"{arm} ({rounds[-1]} rounds)")
        ax.set(title=regime, xlabel="share of the arm's rounds", ylabel=f"{primary} (mean over seeds)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def capacity(args: argparse.Namespace) -> None:
    jobs = [{**vars(args), "people": n, "model": m} for n in args.people_list for m in ("tiny", "phones", "target")]
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(capacity_point, jobs))
    lines = ["# Capacity curve: probe accuracy after central training", "",
             f"Machine: {platform.platform()}, 1 thread per process, {args.jobs} processes. Each point: one model trained "
             f"alone on every fact, {args.capacity_steps} AdamW steps (batch {args.batch}, lr {args.capacity_lr}); "
             "`tiny` and `phones` are the two regimes' client models, `target` the whole target.", "",
             "Command: `python benchmarks/knowledge.py --capacity --people "
             + " ".join(str(n) for n in args.people_list) + f" --capacity-steps {args.capacity_steps}`", "",
             "| people (facts) | model | params | probe acc | knowledge bits | train s |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['people']} ({6 * r['people']}) | {r['model']} | {r['params']:,} | {r['probe_acc']:.3f} | "
                     f"{r['knowledge_bits']:.0f} | {r['train_s']:.0f} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "knowledge_capacity.json").write_text(json.dumps(rows, indent=1))
    (RESULTS / "knowledge_capacity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def arguments() -> argparse.ArgumentParser:
    """The benchmark's command line (its defaults are every run's settings; benchmarks/wire_quant.py reuses them)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--regimes", nargs="+", default=["phones", "tiny"], choices=list(REGIMES))
    parser.add_argument("--arms", nargs="+", default=list(ARMS))
    parser.add_argument("--people", type=int, nargs="+", default=[400])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--per-round", type=int, default=6)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seq-len", type=int, default=48)
    parser.add_argument("--stride", type=float, default=0.125)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--grow-round", type=int, default=300, help="grow_* arms: the last round of the small model")
    parser.add_argument("--frozen", default="int8", help="full-forward arms: the frozen target's format")
    parser.add_argument("--window-width", type=float, default=None,
                        help="full-forward arms: each window's fraction of the units (default: the regime's width)")
    parser.add_argument("--window-rank", type=int, default=4, help="grow_lr* arms: the rank of every matrix's update")
    parser.add_argument("--optimizer", default="sgd", choices=["adamw", "sgd"], help="clients' local optimizer")
    parser.add_argument("--outer", default="adam", help="server optimizer of every arm without an _<outer> suffix")
    parser.add_argument("--outer-lr", type=float, default=3e-3)
    parser.add_argument("--gen-steps", type=int, default=20, help="generative: local steps on each client's own model")
    parser.add_argument("--gen-lr", type=float, default=3e-3)
    parser.add_argument("--gen-rounds", type=int, default=60, help="generative: rounds (each with --gen-steps local steps)")
    parser.add_argument("--gen-samples", type=float, default=0.5, help="generative: windows sampled per own window per round")
    parser.add_argument("--gen-temperature", type=float, default=1.0)
    parser.add_argument("--gen-server-steps", type=int, default=30)
    parser.add_argument("--gen-server-lr", type=float, default=3e-3)
    parser.add_argument("--gen-top-k", type=int, default=0, help="generative: teacher tokens per sampled position (0: ids only)")
    parser.add_argument("--gen-device-state", choices=DEVICE_STATES, default="node",
                        help="generative: where a device's own model lives between rounds (bytes only: the same target)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=2, help="processes (1 torch thread each)")
    parser.add_argument("--capacity", action="store_true", help="the capacity curve instead of the federated arms")
    parser.add_argument("--capacity-steps", type=int, default=1500, help="--capacity: training steps per point")
    parser.add_argument("--capacity-lr", type=float, default=3e-3, help="--capacity: AdamW learning rate")
    parser.add_argument("--task", default="facts", choices=list(PRIMARY),
                        help="facts (private facts, probes) or lm (Shakespeare next-character loss)")
    parser.add_argument("--report-only", action="store_true", help="rewrite <out>.md/.png from <out>.json")
    parser.add_argument("--out", default="knowledge")
    return parser


build_parser = arguments  # the name every benchmark script gives its command line (tests/test_results_commands.py)


def known_arm(arm: str) -> bool:
    """Whether ``arm`` names an arm :func:`run_arm` runs: a base (:data:`ARMS`, a grow-then-fuse arm of
    :data:`GROWTH`, a slicing policy, ``tier_<width>``, ``smallest_only_hetero``, ``generative_grow``) with optional
    ``_unscaled`` and ``_<outer>`` markers."""
    base = without_outer(scaled(arm)[0], OuterConfig("adam"))[0]
    if base.startswith("tier_"):
        try:
            return float(base[5:]) > 0
        except ValueError:
            return False
    return base in {*ARMS, *GROWTH, *POLICIES, "smallest_only_hetero", "generative_grow"}


def check_args(args: argparse.Namespace) -> str:
    """What is wrong with the parsed command line that argparse does not see ("" when nothing)."""
    unknown = [arm for arm in args.arms if not known_arm(arm)]
    return f"--arms: no such arm {', '.join(unknown)} (see ARMS, GROWTH and arm_setup)" if unknown else ""


def main() -> None:
    import sys

    parser = arguments()
    args = parser.parse_args()
    if bad := check_args(args):
        parser.error(bad)
    args.people_list = args.people
    if args.capacity:
        capacity(args)
        return
    args.people = args.people[0]
    if args.report_only:
        payload = json.loads((RESULTS / f"{args.out}.json").read_text())
        payload["summary"] = summarise(payload["results"], payload["args"]["task"])  # the current rules (candidates)
        payload["best"] = payload["summary"]["best"]
        (RESULTS / f"{args.out}.json").write_text(json.dumps(payload, indent=1))
        (RESULTS / f"{args.out}.md").write_text(report(payload))
        plot(payload, RESULTS / f"{args.out}.png")
        print(report(payload))
        return
    conf = {k: v for k, v in vars(args).items()
            if k not in ("capacity", "capacity_steps", "capacity_lr", "people_list", "report_only")}
    partial = RESULTS / f"{args.out}.partial.json"
    machine = f"{platform.platform()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"
    saved = json.loads(partial.read_text()) if partial.is_file() else {"args": conf, "results": {}, "machine": machine}
    same = ("task", "people", "clients", "rounds", "per_round", "steps", "batch", "lr", "seq_len", "optimizer", "outer",
            "outer_lr", "gen_steps", "gen_lr", "gen_rounds", "gen_samples", "gen_temperature", "gen_server_steps",
            "gen_server_lr", "gen_top_k", "gen_device_state", "hidden", "intermediate", "layers", "stride", "eval_every",
            "grow_round", "frozen", "window_width",
            "window_rank")
    changed = [k for k in same if saved["args"].get(k, conf[k]) != conf[k]]
    if changed:
        raise SystemExit(f"{partial} was run with other settings ({', '.join(changed)}); use another --out or delete it")
    results: dict = saved["results"]
    earlier = sorted(f"{g}/{arm}" for g, arms_runs in results.items() for arm in arms_runs)
    arms = list(args.arms)
    if "mixed" in args.regimes:
        arms += [f"tier_{w}" for w in REGIMES["mixed"][0] if f"tier_{w}" not in arms]
    def wanted(regime: str, arm: str) -> bool:
        if arm.startswith("tier_"):
            return regime == "mixed"
        if arm == "oracle" and regime != args.regimes[0]:
            return False  # the oracle trains the whole target: the same run in every regime
        return ("hidden" not in REGIMES[regime][1]
                or scaled(arm)[0].split("_")[0] in ("smallest", "oracle", "generative", "feddf", "grow", "ff"))

    def done(regime: str, arm: str) -> set[int]:
        return {r["seed"] for r in results.get(regime, {}).get(arm, [])}

    jobs = [{"regime": g, "arm": arm, "seed": s, "args": conf} for g in args.regimes for arm in arms for s in args.seeds
            if wanted(g, arm) and s not in done(g, arm)]
    ran_on = saved.get("machine", machine)
    if jobs and results and ran_on != machine:  # one table, one machine: its runs must be comparable
        raise SystemExit(f"{partial} holds runs from {ran_on}, not this machine ({machine}); use another --out")
    RESULTS.mkdir(exist_ok=True)
    with ProcessPoolExecutor(args.jobs) as pool:  # each run is kept as soon as it finishes
        futures = {pool.submit(run_arm, job): job for job in jobs}
        for future in as_completed(futures):
            job, out = futures[future], future.result()
            results.setdefault(job["regime"], {}).setdefault(job["arm"], []).append({"seed": job["seed"], **out})
            partial.write_text(json.dumps({"args": conf, "results": results, "machine": ran_on}))
            key = PRIMARY[args.task][0]
            print(f"{job['regime']} {job['arm']} seed {job['seed']}: {key} {out[key]:.3f} ({out['wall_s']:.0f}s)", flush=True)
    for arms_runs in results.values():
        for runs in arms_runs.values():
            runs.sort(key=lambda r: r["seed"])
    first = results.get(args.regimes[0], {})
    for regime in args.regimes[1:]:  # the one oracle run serves every regime
        if "oracle" in first and regime in results:
            results[regime]["oracle"] = first["oracle"]
    payload = {"command": shlex.join(["python", "benchmarks/knowledge.py", *sys.argv[1:]]), "args": conf,
               "argv": sys.argv[1:], "results": results, "earlier": earlier,
               "machine": f"{ran_on}, {saved['args']['jobs'] if earlier and not jobs else args.jobs} processes x 1 thread"}
    payload["summary"] = summarise(results, args.task)
    payload["best"] = payload["summary"]["best"]
    (RESULTS / f"{args.out}.json").write_text(json.dumps(payload, indent=1))
    (RESULTS / f"{args.out}.md").write_text(report(payload))
    plot(payload, RESULTS / f"{args.out}.png")
    partial.unlink(missing_ok=True)
    print(report(payload))


if __name__ == "__main__":
    main()
