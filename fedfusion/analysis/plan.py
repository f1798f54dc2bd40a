"""The plan views no one method owns: a mixed federation's (every tier's rows from its own method) and the ways a
device can train the target (``fedfusion plan --ways``). Like the methods' views, they take the recipe sections
they read."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from fedfusion.config.methods import SERVER_WORK
from fedfusion.config.sections import DataSource, FusionConfig, ModelConfig, PopulationConfig, TrainConfig
from fedfusion.devices.catalog import population_catalog
from fedfusion.devices.memory import PLAN_COSTS, USABLE, estimate_memory, mb, param_count, usable_bytes
from fedfusion.fusion.plan import PlanView, recipe_target
from fedfusion.models.build import config_aliases, wire_state
from fedfusion.models.full_forward import window_axes, window_params
from fedfusion.models.low_rank import factor_params, split
from fedfusion.models.slicing import plan_slice

# a mixable method's part of a mixed plan, (method, its tiers, usable share of memory) -> (its tiers' rows, its
# server's row or None): `fedfusion plan` gives it (its registry entry's ``mixed_plan`` on the recipe's sections), so
# the mixed view reads no method's section itself
MixedPart = Callable[[str, list[str], float], tuple[list[dict[str, Any]], dict[str, Any] | None]]


def mixed_view(name: str, fusion: FusionConfig, population: PopulationConfig, part: MixedPart) -> PlanView:
    """A mixed federation: every tier's row from its own method, then the server's rows."""
    return PlanView(f"plan for {name} ({fusion.label(population.mix)}: each tier trains what its method gives it; "
                    "every round folds them into one target, slices first, then the server's distillation)",
                    mixed_plan_table(fusion, population, part), ("tier", "method", "trains", "params", "peak MB",
                                                                 "device MB", "fits", *PLAN_COSTS),
                    left=("tier", "method", "trains", "fits"), width=240)


def mixed_plan_table(fusion: FusionConfig, population: PopulationConfig, part: MixedPart,
                     usable: float = USABLE) -> list[dict[str, Any]]:
    """A mixed federation (``fusion.tiers``): every tier's row from its own method's table (``part``), with a
    ``method`` column (what it trains under ``trains``), then the server's rows of the methods that have server
    work."""
    methods = {tier: fusion.tier_method(tier) for tier in population.mix}
    mine = {m: [t for t, n in methods.items() if n == m] for m in dict.fromkeys(methods.values())}
    rows: list[dict[str, Any]] = []
    server: dict[str, dict[str, Any]] = {}
    for name, tiers in mine.items():
        own, serves = part(name, tiers, usable)
        rows += [{"method": name, **r} for r in own]
        if serves is not None:
            server[name] = {"method": name, **serves}
    order = list(population.mix)
    return sorted(rows, key=lambda r: order.index(r["tier"])) + [server[n] for n in SERVER_WORK if n in server]


WAY_RANK = 8  # the adapter and window rank the ways table prices (memory barely depends on it)


BFLOAT16_WAY = "AdamW bfloat16"  # the way only a tier with bfloat16 arithmetic (catalog ``bfloat16``) may take


def training_ways(fusion: FusionConfig, train: TrainConfig, target: PretrainedConfig,
                  width: float) -> list[tuple[str, int, int, int]]:
    """Every way a device can train (part of) ``target`` at ``train``'s batch and sequence length, as (way, trainable
    parameters, peak bytes without, with activation checkpointing): the whole target with AdamW in float32 and in
    bfloat16; a full-forward window of ``width`` of the units on the frozen target in int8 and int4; rank-r updates
    of every matrix on an int8 target; LoRA adapters of rank r on an int8 and a 4-bit base."""
    batch, seq = train.batch_size, train.seq_len
    with torch.device("meta"):
        state = AutoModelForCausalLM.from_config(target).state_dict()
    axes = window_axes(target, tuple(fusion.axes) if fusion.axes else None)
    window = window_params(target, state, replace(plan_slice(target, width, "static", axes=axes, scale=False),
                                                  shared=fusion.window_shared))
    factored, exact = split(target, wire_state(state, config_aliases(target)), fusion.window_shared)
    ranked = factor_params(state, factored, WAY_RANK) + sum(state[n].numel() for n in exact)
    ways: list[tuple[str, dict[str, Any]]] = [
        ("whole target, AdamW float32", {}), (f"whole target, {BFLOAT16_WAY}", {"base_bits": 16}),
        (f"window {width:g} of the units, int8 target", {"base_bits": 8, "window": window}),
        (f"window {width:g} of the units, int4 target", {"base_bits": 4, "window": window}),
        (f"rank-{WAY_RANK} windows, int8 target", {"base_bits": 8, "window": ranked}),
        (f"LoRA rank {WAY_RANK}, int8 base", {"base_bits": 8, "lora_rank": WAY_RANK}),
        (f"LoRA rank {WAY_RANK}, 4-bit base", {"base_bits": 4, "lora_rank": WAY_RANK}),
    ]
    rows = []
    for way, kw in ways:
        off, on = (estimate_memory(target, batch, seq, checkpoint=c, **kw) for c in (False, True))
        rows.append((way, off.trainable, off.total, on.total))
    return rows


def ways_view(name: str, fusion: FusionConfig, train: TrainConfig, population: PopulationConfig, model: ModelConfig,
              source: DataSource, usable: float = USABLE) -> PlanView:
    """Per tier, every way of training the target (:func:`training_ways`, a window at the tier's width) against
    the tier's memory: which fit, which fit only with activation checkpointing, and by how much the rest miss; the
    bfloat16 way only on a tier that computes in bfloat16 (without it, bfloat16 matmuls are emulated at a fraction
    of float32's speed)."""
    target, catalog = recipe_target(model, source), population_catalog(population)
    rows = []
    for tier in population.mix:
        device = catalog[tier]
        budget = usable_bytes(device, usable)
        for way, trainable, off, on in training_ways(fusion, train, target, fusion.widths.get(tier, 1.0)):
            fits = ("NO: no bfloat16 arithmetic on this tier (catalog bfloat16: false)"
                    if BFLOAT16_WAY in way and not device.bfloat16 else
                    "yes" if off <= budget else "with checkpointing" if on <= budget else
                    f"NO: needs {mb(on)} MB even checkpointed, {mb(budget)} MB usable")
            rows.append({"tier": tier, "way": way, "trainable": trainable, "peak MB": mb(off),
                         "checkpointed MB": mb(on), "fits": fits})
    title = (f"ways to train {name}'s target ({param_count(target):,} parameters) on each tier, batch "
             f"{train.batch_size} x {train.seq_len} tokens, {usable:.0%} of the tier's memory usable")
    return PlanView(title, rows, ("tier", "way", "trainable", "peak MB", "checkpointed MB", "fits"),
                    left=("tier", "way", "fits"), width=170, per_round=False)
