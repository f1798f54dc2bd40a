"""The library's in-process driver: the fusion method objects (:mod:`fedfusion.fusion`) run round by round
without Flower or Ray, and the loops built on it (width slicing, transfer distillation, mixed slices and families; a
method's own loop sits in its folder: :mod:`fedfusion.fusion.generative.inprocess`,
:mod:`fedfusion.fusion.lora.inprocess`).

For benchmarks and tests that compare many methods on the same clients, samples and seeds. :func:`run_rounds`
takes the steps the Flower strategy takes (:func:`fedfusion.fusion.rounds.round_payloads`, the methods' checks,
:func:`fedfusion.fusion.rounds.fold_round`, seeds from :func:`fedfusion.fusion.rounds.client_seed`); the caller says how a
client trains a payload. Clients train one after another; there are no faults, messages or ledgers.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from fedfusion.config.methods import WINDOW
from fedfusion.config.sections import TrainConfig
from fedfusion.fusion.base import Client, FusionMethod, Payload, State
from fedfusion.fusion.distill.method import DistillMethod
from fedfusion.fusion.outer import OuterConfig
from fedfusion.fusion.rounds import client_seed, client_steps, fold_round, initial_state, round_lr, round_payloads, server_seed
from fedfusion.fusion.submodel.method import SubModelMethod
from fedfusion.models.build import model_from_state, small_model, tied_aliases, wire_state
from fedfusion.models.full_forward import WindowModel, from_payload
from fedfusion.models.low_rank import LowRankModel
from fedfusion.models.slicing import extract, plan_slice, sub_config
from fedfusion.train.distill import DistillationLoss, Teacher, feddf_teacher, forward_flops
from fedfusion.train.dp import ClientBudgets, DpSgd, epsilon_spent
from fedfusion.train.loop import loss_of, train_steps
from fedfusion.wire.keys import FROZEN, NUM_EXAMPLES
from fedfusion.wire.quantize import Wire, client_reply, decode
from fedfusion.wire.specs import ModelSpec, RoleSpec, WindowSpec, WireSpec

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
    optimizer: str = "adamw"  # the clients' local optimizer (fedfusion.train.loop.OPTIMIZERS)
    lr_schedule: str = "constant"  # train.lr_schedule: the clients' lr over the rounds (:meth:`lr_at`)
    lr_final: float = TrainConfig.lr_final  # train.lr_final
    max_epochs: float = 0.0  # train.max_epochs: a client's steps capped at this many passes over its examples
    device: str = "cpu"  # where the clients train (a model moves there; its reply comes back to the CPU)
    # DP-SGD on every client (privacy.mode=dp_sgd with noise_multiplier 0): each client's noise calibrated to spend
    # ``dp_epsilon`` at ``dp_delta`` over the rounds it is expected to train; 0: no DP
    dp_epsilon: float = 0.0
    dp_delta: float = 1e-5
    dp_clip: float = 1.0

    def on_cpu(self, loop: str) -> None:
        """Refuse ``device`` for a loop whose clients train on the CPU only (ValueError naming ``loop``)."""
        if self.device != "cpu":
            raise ValueError(f"{loop}: its clients train on the CPU; device {self.device!r} is for width slicing")

    def lr_at(self, rnd: int) -> float:
        """The clients' lr in round ``rnd`` (:func:`fedfusion.fusion.rounds.round_lr`, as the strategy sends it)."""
        return round_lr(self.lr, self.lr_schedule, self.lr_final, rnd, self.rounds)

    def steps_for(self, examples: int) -> int:
        """The local steps a client of ``examples`` examples takes (:func:`fedfusion.fusion.rounds.client_steps`)."""
        return client_steps(self.steps, self.batch_size, self.max_epochs, examples)

    def draw(self, rng: random.Random, population: int) -> list[int]:
        """This round's sampled partitions, sorted (the strategy's seeded random selector, uniform)."""
        return sorted(rng.sample(range(population), min(self.per_round, population)))

    def private(self, examples: int, population: int) -> DpSgd | None:
        """A client's DP-SGD settings (None without DP): the noise :class:`fedfusion.train.dp.ClientBudgets` would
        calibrate for a client of ``examples`` windows in a population of ``population``, as the Flower strategy
        does with ``privacy.noise_multiplier=0``. The in-process driver leaves no client out for its budget: one
        sampled more often than expected spends more (:meth:`spent` says how much)."""
        if not self.dp_epsilon:
            return None
        budgets = ClientBudgets(0.0, self.dp_delta, self.dp_epsilon, {}, self.expected_rounds(population))
        return DpSgd(self.dp_clip, budgets.sigma(examples, self.batch_size, self.steps_for(examples)))

    def expected_rounds(self, population: int) -> int:
        """The rounds a client is expected to train: rounds x per_round / population, rounded up."""
        return max(1, math.ceil(self.rounds * min(self.per_round, population) / population))

    def spent(self, examples: int, population: int, rounds_trained: int) -> float:
        """The epsilon a client of ``examples`` windows spent after training ``rounds_trained`` rounds (0 without
        DP)."""
        dp = self.private(examples, population)
        if dp is None or not rounds_trained:
            return 0.0
        rate = min(1.0, self.batch_size / max(examples, 1))
        return epsilon_spent([(dp.noise_multiplier, rate, self.steps_for(examples))] * rounds_trained, self.dp_delta)


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
    wire: Wire = field(default_factory=Wire)  # how payloads travel down and replies up (fedfusion.wire.quantize)
    forward: str = "slice"  # slice | full (fedfusion.fusion.submodel.method)
    frozen: str = "int8"  # full: the frozen target's format
    window_shared: bool = False  # full: embeddings and norms in every window
    grow_round: int = 0  # rounds of the smallest slice before the grown target trains
    window_width: float | None = None  # full: every window's fraction of the units (None: the partition's width)
    window_rank: int = 0  # full: a rank-r update of every matrix instead of a window of units (0: off)
    window_core: bool = False  # full: every window also trains the smallest width's units
    core_forward: str = "full"  # window_core: the core trains in the target's forward pass | the small model's own


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
    max_client_params: int = 0  # the most parameters one client trained in a round
    history: list[dict[str, float]] = field(default_factory=list)

    def client(self, out: Mapping[str, float], params: int, seconds: float, flops: float, down: int, up: int,
               trained: int | None = None) -> None:
        """Count one client round: ``out`` its reply metrics (:meth:`fedfusion.train.loop.TrainResult.metrics`), plus
        work beyond training (``seconds``, ``flops``); ``params`` price the work (6 FLOPs each per token),
        ``trained`` (default ``params``) are what it trained."""
        self.client_s += out["train_s"] + seconds
        self.tokens += int(out["train_tokens"])
        self.flops += 6.0 * params * out["train_tokens"] + flops
        self.bytes_down, self.bytes_up = self.bytes_down + down, self.bytes_up + up
        self.client_rounds += 1
        self.max_client_params = max(self.max_client_params, params if trained is None else trained)


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


Train = Callable[[int, Payload], "tuple[State, Mapping[str, float]]"]


def run_rounds(methods: Mapping[str, FusionMethod], tiers: Sequence[str | None], initial: State, train: Train,
               rounds: Rounds, evaluate: Evaluate | None = None, weighting: str = "uniform",
               caps: Sequence[Mapping[str, Any]] | None = None) -> tuple[State, RunStats]:
    """The driver: ``rounds.rounds`` rounds of the fusion ``methods`` (tier -> method, one or several) over the
    partitions whose tiers ``tiers`` lists (None: a partition that is sampled but never trains), without Flower.

    Each round samples ``rounds.per_round`` partitions (:meth:`Rounds.draw`), asks the methods for their payloads
    (:func:`fedfusion.fusion.rounds.round_payloads`, seeds from :func:`fedfusion.fusion.rounds.client_seed`), runs
    ``train(round, payload) -> (reply, metrics)`` for each client in turn (``metrics``: ``train_s``,
    ``train_tokens`` and ``num-examples``), checks every reply with its method and folds them
    (:func:`fedfusion.fusion.rounds.fold_round`): the Flower strategy's round, less messages, faults and ledgers.
    ``evaluate(target, round)`` is called after every round; its rows go to ``stats.history``. ``caps``: what each
    partition's node reports of itself (:class:`fedfusion.wire.specs.Caps` keys; default none)."""
    rng = random.Random(rounds.seed)  # the sampling draw, like the strategy's seeded random selector
    state, stats = initial_state(methods, dict(initial)), RunStats()
    for rnd in range(1, rounds.rounds + 1):
        sampled = rounds.draw(rng, len(tiers))
        clients = [Client(p, tier, client_seed(rounds.seed, rnd, p), caps[p] if caps is not None else {})
                   for p in sampled if (tier := tiers[p]) is not None]
        start = time.perf_counter()
        payloads = round_payloads(methods, rnd, state, clients)
        stats.server_s += time.perf_counter() - start
        updates = []
        for payload in payloads:
            reply, metrics = train(rnd, payload)
            stats.client(metrics, payload.params, 0.0, 0.0, _nbytes(payload.arrays), _nbytes(reply),
                         payload.row.get("trained_params"))
            start = time.perf_counter()
            weight = float(metrics[NUM_EXAMPLES]) if weighting == "examples" else 1.0
            updates.append(methods[payload.client.tier].check(payload, reply, weight))
            stats.server_s += time.perf_counter() - start
        if updates:
            start = time.perf_counter()
            folded = fold_round(methods, rnd, state, updates)
            state = folded.target
            stats.server_s += time.perf_counter() - start
            stats.server_flops += folded.server_cost.get("flops", 0.0)
        if evaluate is not None and (row := evaluate(state, rnd)) is not None:
            stats.history.append({"round": rnd, **row})
    return state, stats


def spec_config(config: PretrainedConfig, payload: Payload) -> PretrainedConfig:
    """The model config a message's spec names (a slice's), of ``config``'s class: what the client app builds."""
    return config.__class__.from_dict(ModelSpec.from_config(payload.spec).model_config)


def wire_of(model: torch.nn.Module) -> State:
    """A trained model's state as a client replies it (detached, on the CPU, tied weights once)."""
    return wire_state({k: v.detach().cpu() for k, v in model.state_dict().items()}, tied_aliases(model))


def submodel_method(run: SubModelRun, widths: Mapping[str, float], template: State) -> SubModelMethod:
    """The run's :class:`~fedfusion.fusion.submodel.method.SubModelMethod` for the tiers ``widths`` names (tier ->
    width) on a target laid out as ``template``."""
    return SubModelMethod(run.config, dict(widths), template, policy=run.policy, stride=run.stride, stagger=run.stagger,
                          run_seed=run.seed, axes=run.axes, scale=run.scale, outer=run.outer, wire=run.wire,
                          forward=run.forward, frozen=run.frozen, window_shared=run.window_shared,
                          grow_round=run.grow_round,
                          window_widths=dict.fromkeys(widths, run.window_width) if run.window_width else None,
                          window_rank=run.window_rank, window_core=run.window_core, core_forward=run.core_forward)


class SliceClients:
    """The sub-model client role in process: trains a payload's slice or window on its partition's windows, as
    :mod:`fedfusion.clients.submodel` / :mod:`fedfusion.clients.window` do, keeping each partition's uplink error
    feedback as its node would."""

    def __init__(self, run: SubModelRun) -> None:
        self.run = run
        self.residuals: dict[int, State] = {}

    def __call__(self, rnd: int, payload: Payload) -> tuple[State, dict[str, float]]:
        run, p = self.run, payload.client.partition
        received = decode(payload.arrays, keep=FROZEN)  # as the client app decodes it
        config = spec_config(run.config, payload)
        full = RoleSpec.from_config(payload.spec).role == WINDOW  # the client role fedfusion.clients.window
        model = (from_payload(config, received, WindowSpec.from_config(payload.spec), payload.client.seed) if full
                 else model_from_state(config, received)).to(run.device)  # type: ignore[arg-type]  # transformers' wrapped .to
        out = train_steps(model, run.windows[p], run.steps_for(len(run.windows[p])), run.lr_at(rnd) * payload.lr_scale,
                          run.batch_size, payload.client.seed, run.weight_decay, run.optimizer, loss=loss_of(model),
                          dp=run.private(len(run.windows[p]), len(run.windows))).metrics()
        trained = ({k: v.cpu() for k, v in model.trained().items()} if isinstance(model, WindowModel | LowRankModel)
                   else wire_of(model))
        wire = WireSpec.read(payload.spec)  # the uplink the message asks for, read as the client app reads it
        feedback = wire.error_feedback and wire.up != "float32"
        reply, self.residuals[p] = client_reply(trained, payload.arrays, wire.up,
                                                self.residuals.get(p, {}) if feedback else None, received)
        return reply, {**out, NUM_EXAMPLES: len(run.windows[p])}


def run_submodel(run: SubModelRun, initial: dict[str, torch.Tensor], evaluate: Evaluate | None = None,
                 ) -> tuple[dict[str, torch.Tensor], RunStats]:
    """Train ``initial`` for ``run.rounds`` rounds of width slicing (:class:`~fedfusion.fusion.submodel.method.SubModelMethod`
    through :func:`run_rounds`, each client running :func:`fedfusion.train.loop.train_steps` as the client role
    does); ``evaluate(state, round)`` is called after every round (return None to skip a round) and its rows are
    kept in ``stats.history``. Returns the final target."""
    if len(run.windows) != len(run.widths):
        raise ValueError(f"{len(run.windows)} partitions of windows but {len(run.widths)} widths")
    tiers = [f"w{w:g}" for w in run.widths]
    method = submodel_method(run, dict(zip(tiers, run.widths)), initial)
    # every round's payloads re-observe the round's sampled clients (round_payloads without a population), so
    # ``owned`` windows tile those, not every partition as the Flower strategy's do
    return run_rounds(dict.fromkeys(tiers, method), tiers, initial, SliceClients(run), run, evaluate)


def family_model(payload: Payload, state: State) -> PreTrainedModel:
    """The small model a family payload's spec names, holding ``state``: what the small-model client builds."""
    return small_model(json.dumps(ModelSpec.from_config(payload.spec).model_config), state)


def run_mixed(run: SubModelRun, tiers: Sequence[str], families: DistillMethod, initial: dict[str, torch.Tensor],
              evaluate: Evaluate | None = None) -> tuple[dict[str, torch.Tensor], RunStats]:
    """A mixed-method federation (``fusion.method=mixed``): the partitions whose tier (``tiers``, per partition)
    ``families.tier_family`` names train that family's small model as the small-model client role does (their
    ``run.widths`` entries are not read), the others slices of the target at ``run.widths`` (per partition); every
    round folds both, in the methods' fold order, as the Flower strategy does. ``families`` keeps the run's family
    models and distillation state (it is changed by the run)."""
    if not len(run.windows) == len(run.widths) == len(tiers):
        raise ValueError(f"{len(run.windows)} partitions of windows, {len(run.widths)} widths, {len(tiers)} tiers")
    own = sorted(name for name, tokenizer in families.tokenizer_json.items() if tokenizer)
    if own:  # the client role re-tokenises its text for such a family; this loop holds target-token windows only
        raise ValueError(f"families {own} have tokenizers of their own; run_mixed trains families on the target's")
    widths = {t: w for t, w in zip(tiers, run.widths) if t not in families.tier_family}
    slices = submodel_method(run, widths, initial)  # ``owned``: as run_submodel, the round's sampled clients
    methods = {t: families if t in families.tier_family else slices for t in tiers}
    train_slice = SliceClients(run)

    def train(rnd: int, payload: Payload) -> tuple[State, dict[str, float]]:
        if methods[payload.client.tier] is slices:
            return train_slice(rnd, payload)
        p = payload.client.partition  # the small-model client role (fedfusion.clients.smallmodel)
        model = family_model(payload, decode(payload.arrays)).to(run.device)  # type: ignore[arg-type]  # as above
        out = train_steps(model, run.windows[p], run.steps_for(len(run.windows[p])), run.lr_at(rnd) * payload.lr_scale,
                          run.batch_size, payload.client.seed, run.weight_decay, run.optimizer,
                          dp=run.private(len(run.windows[p]), len(run.windows))).metrics()
        return wire_of(model), {**out, NUM_EXAMPLES: len(run.windows[p])}

    return run_rounds(methods, list(tiers), initial, train, run, evaluate)


@dataclass(frozen=True)
class TransferRun:
    """FedDF on a public transfer set with one client family, as distillation fusion runs it: the clients
    federate a small model (``run``: every partition at the width of ``run.widths``' smallest, static), and every
    ``every`` rounds the server distils the target from that model's logits on the public ``transfer`` windows
    (:class:`fedfusion.train.distill.DistillationLoss` against :func:`fedfusion.train.distill.feddf_teacher`)."""

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
            fused = train_steps(target, t.transfer, t.steps, t.lr, t.batch_size,
                                server_seed(t.run.seed, rnd, len(t.run.windows)),
                                loss=DistillationLoss(teacher, t.temperature))
            server.server_s += time.perf_counter() - start
            server.server_flops += fused.flops
        return evaluate(target.state_dict(), rnd) if evaluate is not None else None

    _, stats = run_submodel(t.run, initial, after_round)
    stats.server_s += server.server_s
    stats.server_flops += server.server_flops
    return target.state_dict(), stats
