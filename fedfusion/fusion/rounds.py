"""What every round does, written once for the Flower strategy and the in-process driver.

The per-client seed, the clients' lr of a round (``train.lr_schedule``) and local steps (``train.max_epochs``), the
slice plans of a round's sampled clients (stagger and ``owned`` offsets), the fold of a sub-model round (selective
averaging, then the optional outer optimizer), and, for any mix of fusion methods, each sampled client's payload and
the fold of a round's accepted updates in :data:`FOLD_ORDER`: so :class:`fedfusion.strategies.fusion.FusionStrategy`
and :mod:`fedfusion.fusion.inprocess` cannot drift apart.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from transformers import PretrainedConfig

from fedfusion.config.choices import LR_SCHEDULES
from fedfusion.config.methods import FOLD_ORDER
from fedfusion.config.sections import FusionConfig
from fedfusion.fusion.base import Client, Fold, FusionMethod, Payload, State, Update
from fedfusion.fusion.outer import OuterOptimizer
from fedfusion.models.slicing import SelectiveAverager, SlicePlan, plan_slice
from fedfusion.wire.quantize import Wire

# FOLD_ORDER: the order in which the methods of a mixed federation fold one round into the target, each from the
# previous method's result (the registry's fold ranks: fedfusion.config.methods)


def fusion_wire(fusion: FusionConfig) -> Wire:
    """How payloads travel down and replies up (``fusion.wire_dtype``, ``fusion.wire_up``, ``fusion.error_feedback``)."""
    return Wire(fusion.wire_dtype, fusion.wire_up, fusion.error_feedback)


def client_seed(run_seed: int, server_round: int, partition: int) -> int:
    """The seed of one client's work in one round: the same recipe repeats the same slices, batches and faults."""
    return run_seed * 100003 + server_round * 1009 + partition


def server_seed(run_seed: int, server_round: int, population: int) -> int:
    """The seed of the server's own training in a round: the seed of a partition no client has."""
    return client_seed(run_seed, server_round, population)


def round_lr(lr: float, schedule: str, final: float, server_round: int, rounds: int) -> float:
    """The clients' lr in ``server_round`` (1 .. ``rounds``): ``lr`` in round 1, decayed over the run (``cosine``
    or ``linear``) to ``final`` x ``lr`` in the last round; ``constant`` keeps ``lr``. Late rounds then take
    smaller local steps, so the fold settles where a fixed lr keeps moving the target from round to round."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule {schedule!r} is not one of {', '.join(LR_SCHEDULES)}")
    if schedule == "constant":
        return lr
    t = min(max(server_round - 1, 0) / max(rounds - 1, 1), 1.0)  # 0 in the first round, 1 in the last
    decay = 0.5 * (1 + math.cos(math.pi * t)) if schedule == "cosine" else 1 - t
    return lr * (final + (1 - final) * decay)


def client_steps(local_steps: int, batch_size: int, max_epochs: float, examples: int) -> int:
    """The local steps a client holding ``examples`` training examples takes in a round (``train.max_epochs``):
    ``local_steps``, or fewer where that many batches of ``batch_size`` would pass over its examples more than
    ``max_epochs`` times: ``ceil(max_epochs x examples / batch_size)``, at least one. ``max_epochs`` 0: no cap.
    Many passes over a few examples fit them far below the federation's held-out loss, and the client's update then
    pulls its slice of the target towards its own text (client drift); a cap in epochs bounds that drift."""
    if max_epochs < 0 or local_steps < 1 or batch_size < 1:
        raise ValueError(f"client_steps: needs max_epochs >= 0 and positive local_steps and batch_size, got "
                         f"{max_epochs}, {local_steps}, {batch_size}")
    if max_epochs == 0:
        return local_steps
    return min(local_steps, max(1, math.ceil(max_epochs * examples / batch_size)))


def owned_starts(widths: Mapping[int, float], floor: float = 0.0) -> dict[int, float]:
    """Where each partition's ``owned`` window starts: the widths of the partitions before it laid end to end
    around ``[floor, 1)``, so the population's windows tile the target whatever their widths. ``floor`` > 0 leaves
    the first units to a core that every window trains anyway (full-forward windows with ``window_core``)."""
    if not 0.0 <= floor < 1.0:
        raise ValueError(f"owned_starts: floor must be in [0, 1), got {floor}")
    starts, at, span = {}, 0.0, 1.0 - floor
    for partition in sorted(widths):
        starts[partition] = floor + at % span
        at += widths[partition]
    return starts


def plan_round(config: PretrainedConfig, clients: Sequence[tuple[int, float]], policy: str, server_round: int,
               run_seed: int, stride: float = 0.125, stagger: bool = False, axes: Iterable[str] | None = None,
               scale: bool = True, owned: Mapping[int, float] | None = None, skip: float = 0.0) -> list[SlicePlan]:
    """Slice plans of a round's sampled ``clients`` ((partition, width), in sample order).

    ``stagger`` (rolling) lays the windows end to end in sample order; ``owned`` starts each client's window
    where ``owned`` (from :func:`owned_starts` over the whole population) says, every round, so clients tile
    the target and keep their units. ``skip``: windows drawn outside the first units (a core; ``plan_slice``).
    """
    if policy == "owned" and owned is None:
        raise ValueError("policy 'owned' needs every partition's window start (owned_starts)")
    plans, offset = [], 0.0
    axes = tuple(axes) if axes is not None else None
    for partition, width in clients:
        start = owned[partition] if owned is not None and policy == "owned" else offset
        plans.append(plan_slice(config, width, policy, server_round, stride, start,
                                client_seed(run_seed, server_round, partition), axes=axes, scale=scale, skip=skip))
        if stagger:
            offset += width
    return plans


def fold(averager: SelectiveAverager, outer: OuterOptimizer | None = None) -> dict[str, torch.Tensor]:
    """The round's new target: the selective average, stepped by ``outer`` over the coordinates clients held."""
    new = averager.result()
    return new if outer is None else outer.step(averager.target, new, averager.held())


def initial_state(methods: Mapping[str, FusionMethod], target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The target a fresh run starts from: each method's :meth:`~fedfusion.fusion.base.FusionMethod.begin`, in
    :data:`FOLD_ORDER`."""
    for method in fold_order(methods):
        target = method.begin(target)
    return target


def fold_order(methods: Mapping[str, FusionMethod]) -> list[FusionMethod]:
    """The distinct methods of a tier -> method map, in :data:`FOLD_ORDER`."""
    unique = {id(m): m for m in methods.values()}.values()
    return sorted(unique, key=lambda m: FOLD_ORDER.index(m.name) if m.name in FOLD_ORDER else len(FOLD_ORDER))


def round_payloads(methods: Mapping[str, FusionMethod], server_round: int, target: State,
                   clients: Sequence[Client], population: Mapping[int, str] | None = None) -> list[Payload]:
    """Every sampled client's payload, in sample order: each method plans all of its own clients at once (staggered
    slices follow each other), after :meth:`~FusionMethod.observe` of the known population (partition -> tier)."""
    out: dict[int, Payload] = {}
    for method in fold_order(methods):
        mine = [i for i, c in enumerate(clients) if methods[c.tier] is method]
        if mine:
            method.observe(population if population is not None else {c.partition: c.tier for c in clients})
            out.update(zip(mine, method.payloads(server_round, target, [clients[i] for i in mine])))
    return [out[i] for i in range(len(clients))]


def fold_round(methods: Mapping[str, FusionMethod], server_round: int, target: State,
               updates: Sequence[Update]) -> Fold:
    """A round's accepted updates (sample order) folded into one target: each method folds its own, in
    :data:`FOLD_ORDER`, starting from the previous method's result; coverage is the largest any method reached,
    stats are merged and the server's costs added up."""
    coverage, stats, cost = 0.0, {}, {"flops": 0.0, "seconds": 0.0, "tokens": 0.0}
    for method in fold_order(methods):
        mine = [u for u in updates if methods[u.payload.client.tier] is method]
        if not mine:
            continue
        folded = method.fold(server_round, target, mine)
        target, coverage = folded.target, max(coverage, folded.coverage)
        stats.update(folded.stats)
        for key, value in folded.server_cost.items():
            cost[key] += value
    return Fold(target, coverage, stats, cost)
