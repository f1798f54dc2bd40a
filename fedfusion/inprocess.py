"""The library's in-process round loops: sub-model rounds as the Flower strategy runs them, and generative
distillation, without Flower or Ray.

For benchmarks and tests that compare many methods on the same clients, samples and seeds. Every step is
the one the product path runs: :func:`fedfusion.rounds.plan_round` and :func:`fedfusion.rounds.client_seed`
(the strategy's planning), :func:`fedfusion.slicing.extract` (what a message carries),
:func:`fedfusion.training.train_steps` (what the client role runs) and :func:`fedfusion.rounds.fold` (the
strategy's fold and outer step). Clients train one after another; there are no faults, messages or ledgers.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig

from fedfusion.distill import Teacher, distil, feddf_teacher, forward_flops
from fedfusion.generative import GenerativeConfig, SamplePool, sample_windows
from fedfusion.models import model_from_state
from fedfusion.outer import OuterConfig, OuterOptimizer
from fedfusion.rounds import client_seed, fold, owned_starts, plan_round, server_seed
from fedfusion.slicing import SelectiveAverager, extract, plan_slice, sub_config
from fedfusion.training import train_steps

Evaluate = Callable[[dict[str, torch.Tensor], int], "dict[str, float] | None"]


@dataclass(frozen=True, kw_only=True)
class Rounds:
    """What every in-process loop shares: the recipe's round count, sampling and local training settings."""

    rounds: int = 10
    per_round: int = 6
    steps: int = 10
    lr: float = 3e-3
    batch_size: int = 32
    seed: int = 0
    weight_decay: float = 0.0
    optimizer: str = "adamw"  # the clients' local optimizer (fedfusion.training.OPTIMIZERS)

    def draw(self, rng: random.Random, population: int) -> list[int]:
        """This round's sampled partitions, sorted (the strategy's seeded random selector, uniform)."""
        return sorted(rng.sample(range(population), min(self.per_round, population)))


@dataclass(frozen=True)
class SubModelRun(Rounds):
    """One sub-model federation: the target config, each partition's training windows and width, and the
    round settings a recipe's ``fusion`` / ``selection`` / ``train`` sections give the Flower strategy."""

    config: PretrainedConfig
    windows: Sequence[torch.Tensor]  # per partition
    widths: Sequence[float]  # per partition
    policy: str = "rolling"
    stride: float = 0.125
    stagger: bool = True
    axes: tuple[str, ...] | None = None
    scale: bool = True
    outer: OuterConfig = field(default_factory=OuterConfig)


@dataclass
class RunStats:
    """What a run cost: client-side work and traffic, server time."""

    client_s: float = 0.0
    server_s: float = 0.0
    tokens: int = 0
    flops: float = 0.0  # 6 x params x tokens, summed over client rounds
    server_flops: float = 0.0  # the server's own training (generative distillation)
    bytes_down: int = 0
    bytes_up: int = 0
    client_rounds: int = 0
    max_client_params: int = 0
    history: list[dict[str, float]] = field(default_factory=list)

    def client(self, out: dict[str, float], params: int, seconds: float, flops: float, down: int, up: int) -> None:
        """Count one client round: ``out`` from ``train_steps``, plus work beyond it (``seconds``, ``flops``)."""
        self.client_s += out["train_s"] + seconds
        self.tokens += int(out["train_tokens"])
        self.flops += 6.0 * params * out["train_tokens"] + flops
        self.bytes_down, self.bytes_up = self.bytes_down + down, self.bytes_up + up
        self.client_rounds += 1
        self.max_client_params = max(self.max_client_params, params)


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def run_submodel(run: SubModelRun, initial: dict[str, torch.Tensor], evaluate: Evaluate | None = None,
                 ) -> tuple[dict[str, torch.Tensor], RunStats]:
    """Train ``initial`` for ``run.rounds`` rounds; ``evaluate(state, round)`` is called after every round
    (return None to skip a round) and its rows are kept in ``stats.history``. Returns the final target."""
    if len(run.windows) != len(run.widths):
        raise ValueError(f"{len(run.windows)} partitions of windows but {len(run.widths)} widths")
    rng = random.Random(run.seed)  # the sampling draw, like the strategy's seeded random selector
    outer = OuterOptimizer(run.outer) if run.outer.method != "none" else None
    state, stats = {k: v.clone() for k, v in initial.items()}, RunStats()
    owned = owned_starts(dict(enumerate(run.widths))) if run.policy == "owned" else None
    for rnd in range(1, run.rounds + 1):
        sampled = run.draw(rng, len(run.windows))
        start = time.perf_counter()
        plans = plan_round(run.config, [(p, run.widths[p]) for p in sampled], run.policy, rnd, run.seed,
                           run.stride, run.stagger, run.axes, run.scale, owned)
        averager = SelectiveAverager(state, run.config)
        stats.server_s += time.perf_counter() - start
        for partition, plan in zip(sampled, plans):
            sent = extract(state, run.config, plan)
            model = model_from_state(sub_config(run.config, plan), sent)
            out = train_steps(model, run.windows[partition], run.steps, run.lr, run.batch_size,
                              client_seed(run.seed, rnd, partition), run.weight_decay, run.optimizer)
            reply = {k: v.detach() for k, v in model.state_dict().items()}
            stats.client(out, sum(p.numel() for p in model.parameters()), 0.0, 0.0, _nbytes(sent), _nbytes(reply))
            t = time.perf_counter()
            averager.add({k: reply[k] for k in sent}, plan)
            stats.server_s += time.perf_counter() - t
        t = time.perf_counter()
        state = fold(averager, outer)
        stats.server_s += time.perf_counter() - t
        if evaluate is not None and (row := evaluate(state, rnd)) is not None:
            stats.history.append({"round": rnd, **row})
    return state, stats


@dataclass(frozen=True)
class GenerativeRun(Rounds):
    """One generative-distillation federation: each client trains its own small model (``client_config``,
    kept on the device between rounds, never averaged) and sends samples of it; the server trains the target
    (``config``) on every client's latest samples (:mod:`fedfusion.generative`)."""

    config: PretrainedConfig
    client_config: PretrainedConfig
    windows: Sequence[torch.Tensor]  # per partition
    generative: GenerativeConfig = field(default_factory=GenerativeConfig)


def run_generative(run: GenerativeRun, initial: dict[str, torch.Tensor], client_initial: dict[str, torch.Tensor],
                   evaluate: Evaluate | None = None,
                   ) -> tuple[dict[str, torch.Tensor], RunStats, dict[int, dict[str, torch.Tensor]]]:
    """Train the target ``initial`` from the clients' samples for ``run.rounds`` rounds (see :class:`GenerativeRun`);
    every client's model starts from ``client_initial``. Uploads are counted as int32 token ids. Returns the
    target, the costs and each sampled partition's own model as its device ends the run (what the samples
    could carry: the ceiling of what the target can learn from them)."""
    rng, g = random.Random(run.seed), run.generative
    devices: dict[int, dict[str, torch.Tensor]] = {}  # each client's own model, as its device keeps it
    pool, stats = SamplePool(), RunStats()
    target = model_from_state(run.config, initial)
    target_params = sum(p.numel() for p in target.parameters())
    for rnd in range(1, run.rounds + 1):
        for partition in run.draw(rng, len(run.windows)):
            model = model_from_state(run.client_config, devices.get(partition, client_initial))
            seed = client_seed(run.seed, rnd, partition)
            out = train_steps(model, run.windows[partition], run.steps, run.lr, run.batch_size, seed, run.weight_decay,
                              run.optimizer)
            devices[partition] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            start = time.perf_counter()
            own = run.windows[partition]
            samples = sample_windows(model, own, math.ceil(g.sample_fraction * len(own)), g.temperature, seed)
            pool.add(partition, samples, cap=len(own))
            params = sum(p.numel() for p in model.parameters())
            # sampling costs ~2 x params per generated token (forward only, KV-cached); ids go up as int32
            stats.client(out, params, time.perf_counter() - start, 2.0 * params * samples.numel(), 0, samples.numel() * 4)
        start = time.perf_counter()
        out = train_steps(target, pool.windows(), g.server_steps, g.server_lr, g.server_batch,
                          server_seed(run.seed, rnd, len(run.windows)))
        stats.server_s += time.perf_counter() - start
        stats.server_flops += 6.0 * target_params * out["train_tokens"]
        if evaluate is not None and (row := evaluate(target.state_dict(), rnd)) is not None:
            stats.history.append({"round": rnd, **row})
    return target.state_dict(), stats, devices


@dataclass(frozen=True)
class TransferRun:
    """FedDF on a public transfer set with one client family, as distillation fusion runs it: the clients
    federate a small model (``run``: every partition at the width of ``run.widths``' smallest, static), and every
    ``every`` rounds the server distils the target from that model's logits on the public ``transfer`` windows
    (:func:`fedfusion.distill.distil` against :func:`fedfusion.distill.feddf_teacher`)."""

    run: SubModelRun
    transfer: torch.Tensor  # (n, seq_len + 1) token ids of text no client owns
    every: int = 10
    steps: int = 30
    lr: float = 3e-3
    batch_size: int = 64
    temperature: float = 1.0


def run_transfer(t: TransferRun, initial: dict[str, torch.Tensor], target_initial: dict[str, torch.Tensor],
                 evaluate: Evaluate | None = None) -> tuple[dict[str, torch.Tensor], RunStats]:
    """The clients' rounds from ``initial`` (:func:`run_submodel`) with the target, from ``target_initial``,
    distilled from the family model every ``t.every`` rounds; ``evaluate`` sees the target after every round."""
    cfg = t.run.config
    plan = plan_slice(cfg, min(t.run.widths), "static", axes=t.run.axes)
    target = model_from_state(cfg, target_initial)
    server = RunStats()

    def after_round(state: dict[str, torch.Tensor], rnd: int) -> dict[str, float] | None:
        if rnd % t.every == 0:
            family = model_from_state(sub_config(cfg, plan), extract(state, cfg, plan)).eval()
            family_params = sum(p.numel() for p in family.parameters())

            def teacher(rows: torch.Tensor) -> Teacher:
                inputs = t.transfer[rows][:, :-1]
                out = feddf_teacher(family(input_ids=inputs).logits[None], t.temperature)
                out.flops = forward_flops(family_params, inputs.numel())
                return out

            start = time.perf_counter()
            fused = distil(target, teacher, t.transfer, t.steps, t.lr, t.temperature, t.batch_size,
                           server_seed(t.run.seed, rnd, len(t.run.windows)))
            server.server_s += time.perf_counter() - start
            server.server_flops += fused["flops"]
        return evaluate(target.state_dict(), rnd) if evaluate is not None else None

    _, stats = run_submodel(t.run, initial, after_round)
    stats.server_s += server.server_s
    stats.server_flops += server.server_flops
    return target.state_dict(), stats
