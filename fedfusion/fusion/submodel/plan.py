"""Width slicing's plan: each tier's slice (or full-forward window), its memory and one round's cost, and the
auto-fit of widths to each tier's memory (``fusion.auto_widths``). Reads the fusion, train and population sections
and the target's config (:func:`fedfusion.fusion.plan.recipe_target`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from fedfusion.config.methods import SUBMODEL
from fedfusion.config.sections import (
    DataSource,
    FusionConfig,
    ModelConfig,
    PopulationConfig,
    PrivacyConfig,
    RecipeError,
    TrainConfig,
)
from fedfusion.devices.catalog import Device, population_catalog
from fedfusion.devices.energy import frozen_work_params, train_flops
from fedfusion.devices.memory import (
    FROZEN_BITS,
    PLAN_COSTS,
    UNPRICED,
    USABLE,
    dims,
    estimate_memory,
    linear_params,
    mb,
    param_count,
    priced,
    training_memory_bytes,
    usable_bytes,
)
from fedfusion.fusion.plan import PlanView, recipe_target
from fedfusion.models.build import config_aliases, wire_state
from fedfusion.models.full_forward import window_axes, window_params
from fedfusion.models.low_rank import factor_params, split
from fedfusion.models.slicing import plan_slice, sub_config
from fedfusion.wire.quantize import encoded_bytes
from fedfusion.wire.secagg import MASKED_BYTES

WIDTH_LADDER = (1.0, 0.5, 0.25, 0.125, 0.0625)  # FedRolex's capacity ladder


def sliced_config(config: PretrainedConfig, width: float, axes: Sequence[str] | None = None) -> PretrainedConfig:
    """The config of the width-``width`` static sub-model (the size every policy gives that width)."""
    return config if width == 1 else sub_config(config, plan_slice(config, width, "static", axes=axes))


def fit_width(
    config: PretrainedConfig, device: Device, batch: int, seq: int, ladder: Sequence[float] = WIDTH_LADDER,
    usable: float = USABLE, axes: Sequence[str] | None = None,
) -> float | None:
    """The largest width of ``ladder`` whose sub-model trains within ``usable`` of the device's memory, or None."""
    budget = usable_bytes(device, usable)
    if not ladder or any(not 0 < w <= 1 for w in ladder):
        raise ValueError(f"ladder: widths must be in (0, 1], got {list(ladder)}")
    for width in sorted(ladder, reverse=True):
        if training_memory_bytes(sliced_config(config, width, axes), batch, seq) <= budget:
            return width
    return None


def auto_widths(
    fusion: FusionConfig, train: TrainConfig, population: PopulationConfig, target: PretrainedConfig,
    ladder: Sequence[float] = WIDTH_LADDER, usable: float = USABLE,
) -> dict[str, float | None]:
    """For every tier of the population mix, :func:`fit_width` of ``target`` (None: nothing fits). With
    full-forward windows (``fusion.forward=full``) a width must also fit as a window (:func:`window_memory`: the
    frozen target and the whole target's activations besides the window), so a tier steps down the ladder until it
    does, with a core (``fusion.window_core``) of the smallest slice width found or its own width where that is
    smaller (the core is the smallest tier's width; it can only shrink, so every window checked still fits)."""
    catalog = population_catalog(population)
    axes = fusion.axes or None
    fitted = {tier: fit_width(target, catalog[tier], train.batch_size, train.seq_len, ladder, usable, axes)
              for tier in population.mix}
    f = fusion
    if f.forward != "full" or f.method != SUBMODEL:
        return fitted
    known = [w for w in fitted.values() if w is not None]
    core = min(known) if f.window_core and known else 0.0
    steps = sorted(ladder, reverse=True)
    for tier, width in fitted.items():
        budget = usable_bytes(catalog[tier], usable)
        while width is not None and window_memory(f, train, target, f.window_widths.get(tier, width),
                                                  min(core, width))[1] > budget:
            width = next((w for w in steps if w < width), None)
        fitted[tier] = width
    return fitted


def fit_widths(fusion: FusionConfig, train: TrainConfig, population: PopulationConfig, model: ModelConfig,
               source: DataSource) -> None:
    """With ``fusion.auto_widths``, set ``fusion.widths`` to :func:`auto_widths` (so the run's resolved recipe
    records them); a tier that fits no width of ``fusion.width_ladder`` is a RecipeError naming it. Here and not
    in the recipe module, so that validating a recipe needs no torch."""
    if not fusion.auto_widths:
        return
    target = recipe_target(model, source)
    fitted = auto_widths(fusion, train, population, target, fusion.width_ladder)
    unfit = [tier for tier, width in fitted.items() if width is None]
    if unfit:
        row = next(r for r in plan_table(fusion, train, population, target, fitted, ladder=fusion.width_ladder)
                   if r["tier"] == unfit[0])
        raise RecipeError(f"fusion.auto_widths: tier {unfit[0]!r} fits no width of fusion.width_ladder "
                          f"({row['fits']}); see `fedfusion plan`")
    fusion.widths = {tier: float(width) for tier, width in fitted.items() if width is not None}  # all fit


def _wire_bytes(fusion: FusionConfig, tier: str, params: int) -> tuple[int, int]:
    """Bytes a ``tier`` sub-model of ``params`` values goes down in (``fusion.wire_dtype``) and its reply up in
    (``fusion.wire_up``): :func:`fedfusion.wire.quantize.encoded_bytes`, as one matrix (float32 unless the tier trains
    with sub-model fusion)."""
    if fusion.tier_method(tier) != SUBMODEL:
        return 4 * params, 4 * params
    return encoded_bytes(fusion.wire_dtype, params), encoded_bytes(fusion.wire_up, params)


def plan_table(
    fusion: FusionConfig, train: TrainConfig, population: PopulationConfig, target: PretrainedConfig,
    widths: Mapping[str, float | None] | None = None, usable: float = USABLE, ladder: Sequence[float] = WIDTH_LADDER,
    tiers: Sequence[str] | None = None, secure: bool = False,
) -> list[dict[str, Any]]:
    """One row per tier of the population mix, narrowest first: the slice of ``target`` it trains (sub-model fusion; under
    generative distillation the static slice it keeps as its own model), parameters, memory, and one round's
    cost (:func:`priced`: training FLOPs, the slice down in ``fusion.wire_dtype`` and back in ``fusion.wire_up``),
    at ``train.local_steps``: the most a client takes (``train.max_epochs`` gives one with few examples fewer).

    ``widths`` (default: the recipe's ``fusion.widths``; pass :func:`auto_widths` for auto-fit) may hold
    None for a tier that fits nothing: its row says so (with what ``ladder``'s smallest width would need)
    instead of raising. Memory is :func:`training_memory_bytes`. ``tiers`` (default: every tier of the mix) picks
    the tiers to plan (a mixed federation's slicing tiers). ``secure`` (``privacy.secure_aggregation``): every reply
    goes up as the masked vector (:func:`secure_up_bytes`).
    """
    catalog = population_catalog(population)
    f = fusion
    axes = f.axes or None
    widths = f.widths if widths is None else widths
    batch, seq = train.batch_size, train.seq_len
    tokens = train.local_steps * batch * seq
    fitted = [w for w in widths.values() if w is not None]
    core = min(fitted) if f.window_core and fitted else 0.0  # full forward: in every window too
    rows = []
    for tier in sorted(tiers or population.mix, key=lambda t: (widths.get(t) is not None, widths.get(t) or 0)):
        device = catalog[tier]
        width = widths.get(tier)
        budget = usable_bytes(device, usable)
        row: dict[str, Any] = {"tier": tier, "width": width}
        full = f.forward == "full" and f.tier_method(tier) == SUBMODEL
        if width is None:
            smallest = min(ladder)
            need = (window_memory(f, train, target, smallest, smallest if f.window_core else 0.0)[1] if full
                    else training_memory_bytes(sliced_config(target, smallest, axes), batch, seq))
            what = f"a full-forward window of {smallest:g}" if full else f"width {smallest:g}"
            rows.append({**row, "slice": "-", "params": None, "peak MB": mb(need),
                         "device MB": round(device.memory_gb * 1024),
                         "fits": f"NO: even {what} needs {mb(need)} MB, {mb(budget)} MB usable", **UNPRICED})
            continue
        if full:
            rows.append({**row, **window_row(f, train, target, tier, width, core, device, budget, tokens, secure)})
            continue
        sub = sliced_config(target, width, axes)
        params = param_count(sub)
        down, up = _wire_bytes(f, tier, params)
        mem = training_memory_bytes(sub, batch, seq, train.checkpoint)
        rows.append({
            **row,
            "slice": f"{sub.num_attention_heads}/{target.num_attention_heads} heads, "
                     f"{dims(sub)[1]}/{dims(target)[1]} neurons"
                     + (", activations checkpointed" if train.checkpoint else ""),
            "params": params, "peak MB": mb(mem), "device MB": round(device.memory_gb * 1024),
            "fits": "yes" if mem <= budget else "NO",
            **priced(device, train_flops(params, tokens), down,
                     secure_up_bytes(target) if secure else up),
        })
    return rows


def secure_up_bytes(target: PretrainedConfig) -> int:
    """A reply's bytes under secure aggregation, at most: the masked vector carries :data:`MASKED_BYTES` (fixed point
    modulo 2**64, :mod:`fedfusion.wire.secagg`) for every coordinate some client of the round trains, whatever the client's own
    slice; priced at its bound, every coordinate of the target. The key and share messages (a few hundred bytes a
    peer) are left out."""
    return MASKED_BYTES * param_count(target)


def window_memory(fusion: FusionConfig, train: TrainConfig, target: PretrainedConfig, width: float, core: float,
                  expand: bool = False) -> tuple[int, int]:
    """A full-forward window's trained parameters and its device's peak training memory in bytes (the frozen
    target in ``fusion.frozen_dtype``, the window's float32 weights, gradients and AdamW state, the whole target's
    activations): a window of ``width`` of the units plus ``core``, or with ``fusion.window_rank`` a rank-r update
    of every matrix (whatever the width). ``expand``: the frozen target made float32 once for the round
    (``WindowSpec.expand``), with the message's narrow copy still held beside it."""
    f = fusion
    with torch.device("meta"):
        state = AutoModelForCausalLM.from_config(target).state_dict()
    dense = 0
    if f.window_rank:  # a rank-r update of every matrix plus the exact tensors (fedfusion.models.low_rank)
        factored, exact = split(target, wire_state(state, config_aliases(target)), f.window_shared)
        window = factor_params(state, factored, f.window_rank) + sum(state[n].numel() for n in exact)
        dense = rank_dense_bytes(target, factored)
    else:
        axes = window_axes(target, tuple(f.axes) if f.axes else None)
        plan = replace(plan_slice(target, min(1.0, width + core), "static", axes=axes, scale=False),
                       shared=f.window_shared)
        window = window_params(target, state, plan)
    return window, frozen_window_memory(target, train.batch_size, train.seq_len, window, f.frozen_dtype,
                                        train.checkpoint, expand, f.wire_dtype, dense)


def rank_dense_bytes(target: PretrainedConfig, factored: Sequence[str]) -> int:
    """What a rank-r update costs beyond its factors where it does not ride on a linear layer (an embedding, a
    Conv1D): the parametrization makes the dense ``frozen + B @ A`` at each use (``fedfusion.models.frozen._Added``),
    and backward its dense gradient, float32 each; two such matrices are live at once, whatever the uses: a tied
    head keeps its dense copy for backward, where its gradient joins it, while an embedding's lookup keeps only the
    token ids, so the input use's copy is freed at once (measured on SmolLM2-135M's shape:
    ``benchmarks/results/cpu_memory.md``, the rank arm). When they are live beside the activations:
    ``fedfusion.devices.memory.estimate_memory``'s ``dense``."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(target)
    return sum(2 * 4 * model.get_parameter(name).numel() for name in factored
               if not isinstance(model.get_submodule(name.rpartition(".")[0]), torch.nn.Linear))


def frozen_window_memory(target: PretrainedConfig, batch: int, seq: int, window: int, frozen_dtype: str,
                         checkpoint: bool = False, expand: bool = False, wire_dtype: str = "float32",
                         dense: int = 0) -> int:
    """Peak bytes of training ``window`` parameters on ``target`` frozen in ``frozen_dtype``; ``expand``: made float32
    once (``WindowSpec.expand``). The message stays held while the device trains (the client app holds it): its
    window values (in ``wire_dtype``) besides the trained copy, and of the frozen target what the model does not
    share with it: the narrow path keeps the projections' codes themselves but decodes the other matrices
    (embeddings) to float32; the expanded path decodes them all. ``dense``: a rank-r update's dense matrices
    (:func:`rank_dense_bytes`)."""
    bits = 32 if expand else FROZEN_BITS[frozen_dtype]
    mem = estimate_memory(target, batch, seq, base_bits=bits, window=window, checkpoint=checkpoint, dense=dense).total
    decoded = param_count(target) - (0 if expand else linear_params(target))
    return mem + encoded_bytes(wire_dtype, window) + (encoded_bytes(frozen_dtype, decoded) if bits != 32 or expand else 0)


def window_path(fusion: FusionConfig, train: TrainConfig, target: PretrainedConfig, width: float, core: float,
                budget: float) -> tuple[int, int, bool]:
    """The way a device with ``budget`` bytes trains its window: expanded (the frozen target made float32 once for
    the round: no dequantisation in every pass) where that fits, else on the target as it travelled; as (window
    parameters, peak bytes, expanded; the plan's row says "int8 target -> float32"). The run sends the same choice
    (:func:`expanded_tiers`)."""
    window, wide = window_memory(fusion, train, target, width, core, expand=True)
    if wide <= budget:
        return window, wide, True
    return (*window_memory(fusion, train, target, width, core), False)


def expanded_tiers(fusion: FusionConfig, train: TrainConfig, population: PopulationConfig, model: ModelConfig,
                   source: DataSource, usable: float = USABLE) -> frozenset[str]:
    """The tiers of a full-forward sub-model recipe whose memory holds their window with the frozen target made
    float32 (:func:`window_path`): their messages say so (``WindowSpec.expand``); the values trained are the same."""
    f = fusion
    tiers = [t for t in population.mix if f.tier_method(t) == SUBMODEL and t in f.widths]
    if f.forward != "full" or not tiers:
        return frozenset()
    catalog = population_catalog(population)
    target = recipe_target(model, source)
    core = min(f.widths.values()) if f.window_core else 0.0
    return frozenset(t for t in tiers if window_path(f, train, target, f.window_widths.get(t, f.widths[t]), core,
                                                     usable_bytes(catalog[t], usable))[2])


def window_row(fusion: FusionConfig, train: TrainConfig, target: PretrainedConfig, tier: str, width: float,
               core: float, device: Device, budget: float, tokens: int, secure: bool = False) -> dict[str, Any]:
    """A full-forward tier's plan (``fusion.forward=full``): its window of units (``fusion.window_widths``, else its
    ``width``, as the plan's widths give it; the residual stream whole) plus ``core`` (the smallest width's units,
    in every window with ``fusion.window_core``; 0 without), the frozen target held in ``fusion.frozen_dtype`` plus
    the window's weights, gradients and AdamW state and the whole target's activations; the frozen target down
    (every round) and the window both ways; the target's forward and activation gradients plus the window's
    training as FLOPs. ``secure``: the reply goes up as the masked vector (:func:`secure_up_bytes`)."""
    f = fusion
    width = f.window_widths.get(tier, width)
    window, mem, expand = window_path(f, train, target, width, core, budget)
    total = param_count(target)
    down = encoded_bytes(f.frozen_dtype, total) + encoded_bytes(f.wire_dtype, window)
    label = (f"rank-{f.window_rank} of every matrix" if f.window_rank else
             f"units {width:g}" + (f" + core {core:g}" if core else ""))
    label += ", checkpointed" if train.checkpoint else ""
    return {"width": 1.0 if f.window_rank else width,
            "slice": f"{label}; {f.frozen_dtype} target" + (" -> float32" if expand else ""),
            "params": window, "peak MB": mb(mem), "device MB": round(device.memory_gb * 1024),
            "fits": "yes" if mem <= budget else "NO",
            **priced(device, train_flops(frozen_work_params(total, window), tokens), down,
                     secure_up_bytes(target) if secure else encoded_bytes(f.wire_up, window))}


def slices_view(name: str, fusion: FusionConfig, train: TrainConfig, population: PopulationConfig,
                model: ModelConfig, privacy: PrivacyConfig, source: DataSource) -> PlanView:
    """Width slicing: per tier its width (fitted to memory with ``fusion.auto_widths``), slice, size and cost (under
    ``privacy.secure_aggregation``, the masked reply's)."""
    return slices_plan(name, fusion, train, population, recipe_target(model, source),
                       secure=privacy.secure_aggregation)


def slices_plan(name: str, fusion: FusionConfig, train: TrainConfig, population: PopulationConfig,
                target: PretrainedConfig, title: str = "", secure: bool = False) -> PlanView:
    """:func:`slices_view` of ``target``, ``title`` added to its method's (generative distillation's view says what
    the slices are there)."""
    f = fusion
    widths = auto_widths(f, train, population, target, f.width_ladder) if f.auto_widths else None
    rows = plan_table(f, train, population, target, widths, ladder=f.width_ladder, secure=secure)
    grow = f.grow_rounds()
    title = f"plan for {name} ({f.label(population.mix)}" + title
    title += (f", the smallest slice grown into the target after round {grow}: a round after growth"
              if grow and f.method == SUBMODEL else "")
    title += ", widths fitted to memory)" if widths else ")"
    notes = (("secure aggregation: each reply is the masked vector, 8 bytes for every coordinate some client of the "
              "round trains; MB up priced at its bound, every coordinate of the target",) if secure else ())
    return PlanView(title, rows, ("tier", "width", "slice", "params", "peak MB", "device MB", "fits", *PLAN_COSTS),
                    left=("tier", "slice", "fits"), width=200, notes=notes)


def mixed_rows(fusion: FusionConfig, train: TrainConfig, population: PopulationConfig, model: ModelConfig,
               source: DataSource, usable: float, tiers: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Its tiers' rows in a mixed federation's plan (the registry entry's ``mixed_plan``); no server work."""
    return slice_rows(fusion, train, population, recipe_target(model, source), usable, tiers), None


def slice_rows(fusion: FusionConfig, train: TrainConfig, population: PopulationConfig, target: PretrainedConfig,
               usable: float, tiers: list[str]) -> list[dict[str, Any]]:
    """:func:`plan_table`'s rows of ``tiers``, each naming what it trains under ``trains`` (a mixed plan's column)."""
    return [{**r, "trains": f"width {r['width']:g}: {r['slice']}" if r["width"] is not None else r["slice"]}
            for r in plan_table(fusion, train, population, target, usable=usable, tiers=tiers)]
