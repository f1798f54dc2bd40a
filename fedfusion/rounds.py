"""What every sub-model round does, written once for the Flower strategy and the in-process driver.

The per-client seed, the slice plans of a round's sampled clients (stagger and ``owned`` offsets) and the
fold of a round's accepted updates (selective averaging, then the optional outer optimizer) live here, so
:class:`fedfusion.fusion.submodel.SubModelMethod` and :mod:`fedfusion.inprocess` cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from transformers import PretrainedConfig

from fedfusion.outer import OuterOptimizer
from fedfusion.slicing import SelectiveAverager, SlicePlan, plan_slice


def client_seed(run_seed: int, server_round: int, partition: int) -> int:
    """The seed of one client's work in one round: the same recipe repeats the same slices, batches and faults."""
    return run_seed * 100003 + server_round * 1009 + partition


def server_seed(run_seed: int, server_round: int, population: int) -> int:
    """The seed of the server's own training in a round: the seed of a partition no client has."""
    return client_seed(run_seed, server_round, population)


def owned_starts(widths: Mapping[int, float]) -> dict[int, float]:
    """Where each partition's ``owned`` window starts: the widths of the partitions before it laid end to end
    (mod 1), so the population's windows tile the target whatever their widths."""
    starts, at = {}, 0.0
    for partition in sorted(widths):
        starts[partition] = at % 1.0
        at += widths[partition]
    return starts


def plan_round(config: PretrainedConfig, clients: Sequence[tuple[int, float]], policy: str, server_round: int,
               run_seed: int, stride: float = 0.125, stagger: bool = False, axes: Iterable[str] | None = None,
               scale: bool = True, owned: Mapping[int, float] | None = None) -> list[SlicePlan]:
    """Slice plans of a round's sampled ``clients`` ((partition, width), in sample order).

    ``stagger`` (rolling) lays the windows end to end in sample order; ``owned`` starts each client's window
    where ``owned`` (from :func:`owned_starts` over the whole population) says, every round, so clients tile
    the target and keep their units.
    """
    if policy == "owned" and owned is None:
        raise ValueError("policy 'owned' needs every partition's window start (owned_starts)")
    plans, offset = [], 0.0
    axes = tuple(axes) if axes is not None else None
    for partition, width in clients:
        start = owned[partition] if owned is not None and policy == "owned" else offset
        plans.append(plan_slice(config, width, policy, server_round, stride, start,
                                client_seed(run_seed, server_round, partition), axes=axes, scale=scale))
        if stagger:
            offset += width
    return plans


def fold(averager: SelectiveAverager, outer: OuterOptimizer | None = None) -> dict[str, torch.Tensor]:
    """The round's new target: the selective average, stepped by ``outer`` over the coordinates clients held."""
    new = averager.result()
    return new if outer is None else outer.step(averager.target, new, averager.held())
