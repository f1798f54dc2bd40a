"""The plan views no one method owns: a mixed federation's (every tier's rows from its own method) and the ways a
device can train the target (``fedfusion plan --ways``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from fedfusion.config.methods import SERVER_WORK, call, method
from fedfusion.config.recipe import Recipe, tier_methods
from fedfusion.devices.catalog import population_catalog
from fedfusion.devices.memory import PLAN_COSTS, USABLE, estimate_memory, mb, param_count, usable_bytes
from fedfusion.fusion.plan import PlanView, recipe_target
from fedfusion.models.build import config_aliases, wire_state
from fedfusion.models.full_forward import window_axes, window_params
from fedfusion.models.low_rank import factor_params, split
from fedfusion.models.slicing import plan_slice


def mixed_view(recipe: Recipe) -> PlanView:
    """A mixed federation: every tier's row from its own method, then the server's rows."""
    return PlanView(f"plan for {recipe.name} ({recipe.fusion.label(recipe.population.mix)}: each tier trains what its method gives it; "
                    "every round folds them into one target, slices first, then the server's distillation)",
                    mixed_plan_table(recipe), ("tier", "method", "trains", "params", "peak MB", "device MB", "fits",
                                               *PLAN_COSTS),
                    left=("tier", "method", "trains", "fits"), width=240)


def mixed_plan_table(recipe: Recipe, usable: float = USABLE) -> list[dict[str, Any]]:
    """A mixed federation (``fusion.tiers``): every tier's row from its own method's table, with a ``method`` column
    (what it trains under ``trains``), then the server's rows of the methods that have server work."""
    methods = tier_methods(recipe)
    mine = {m: [t for t, n in methods.items() if n == m] for m in dict.fromkeys(methods.values())}
    rows: list[dict[str, Any]] = []
    server: dict[str, dict[str, Any]] = {}
    source = recipe.data_source()
    for name, tiers in mine.items():  # each method's part: its registry entry's mixed_plan, on the sections it names
        own, serves = call(method(name).mixed_plan, recipe, source=source, usable=usable, tiers=tiers)
        rows += [{"method": name, **r} for r in own]
        if serves is not None:
            server[name] = {"method": name, **serves}
    order = list(recipe.population.mix)
    return sorted(rows, key=lambda r: order.index(r["tier"])) + [server[n] for n in SERVER_WORK if n in server]


WAY_RANK = 8  # the adapter and window rank the ways table prices (memory barely depends on it)


BFLOAT16_WAY = "AdamW bfloat16"  # the way only a tier with bfloat16 arithmetic (catalog ``bfloat16``) may take


def training_ways(recipe: Recipe, target: PretrainedConfig, width: float) -> list[tuple[str, int, int, int]]:
    """Every way a device can train (part of) ``target`` at the recipe's batch and sequence length, as (way, trainable
    parameters, peak bytes without, with activation checkpointing): the whole target with AdamW in float32 and in
    bfloat16; a full-forward window of ``width`` of the units on the frozen target in int8 and int4; rank-r updates
    of every matrix on an int8 target; LoRA adapters of rank r on an int8 and a 4-bit base."""
    batch, seq, f = recipe.train.batch_size, recipe.train.seq_len, recipe.fusion
    with torch.device("meta"):
        state = AutoModelForCausalLM.from_config(target).state_dict()
    axes = window_axes(target, tuple(f.axes) if f.axes else None)
    window = window_params(target, state, replace(plan_slice(target, width, "static", axes=axes, scale=False),
                                                  shared=f.window_shared))
    factored, exact = split(target, wire_state(state, config_aliases(target)), f.window_shared)
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


def ways_view(recipe: Recipe, usable: float = USABLE) -> PlanView:
    """Per tier, every way of training the target (:func:`training_ways`, a window at the tier's width) against
    the tier's memory: which fit, which fit only with activation checkpointing, and by how much the rest miss; the
    bfloat16 way only on a tier that computes in bfloat16 (without it, bfloat16 matmuls are emulated at a fraction
    of float32's speed)."""
    target, catalog = recipe_target(recipe.model, recipe.data_source()), population_catalog(recipe.population)
    rows = []
    for tier in recipe.population.mix:
        device = catalog[tier]
        budget = usable_bytes(device, usable)
        for way, trainable, off, on in training_ways(recipe, target, recipe.fusion.widths.get(tier, 1.0)):
            fits = ("NO: no bfloat16 arithmetic on this tier (catalog bfloat16: false)"
                    if BFLOAT16_WAY in way and not device.bfloat16 else
                    "yes" if off <= budget else "with checkpointing" if on <= budget else
                    f"NO: needs {mb(on)} MB even checkpointed, {mb(budget)} MB usable")
            rows.append({"tier": tier, "way": way, "trainable": trainable, "peak MB": mb(off),
                         "checkpointed MB": mb(on), "fits": fits})
    title = (f"ways to train {recipe.name}'s target ({param_count(target):,} parameters) on each tier, batch "
             f"{recipe.train.batch_size} x {recipe.train.seq_len} tokens, {usable:.0%} of the tier's memory usable")
    return PlanView(title, rows, ("tier", "way", "trainable", "peak MB", "checkpointed MB", "fits"),
                    left=("tier", "way", "fits"), width=170, per_round=False)
