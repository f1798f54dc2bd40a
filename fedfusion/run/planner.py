"""Per-tier plan: what each device tier trains, its size, estimated peak memory, time and energy; and
auto-fit: the widest sub-model (or the LoRA rank and base precision) that fits each tier's memory.

Memory model (:func:`estimate_memory`), per training step of ``batch`` sequences of ``seq`` tokens:

- **weights**: every parameter at 4 bytes (fp32). With LoRA the frozen base is stored at ``base_bits``:
  the decoder's linear layers quantised (4 bit: 4.5 bits per weight, 8 bit: 8.5, counting
  bitsandbytes' per-block scales), embeddings, norms and lm_head at 16 bit, or everything at 16/32 bit.
- **gradients**: 4 bytes per trainable parameter (all of them; with LoRA only the adapters).
- **optimizer**: AdamW's two fp32 moments, 8 bytes per trainable parameter; its step (torch's multi-tensor AdamW)
  allocates one more trainable-sized temporary, ``sqrt(v)``. Backward has freed the activations by then, so the
  peak counts the larger of the activations and that temporary: for the whole target at a small batch the step is
  the peak (measured on CPU, ``benchmarks/results/cpu_memory.md``).
- **activations** kept for backward: per token and layer ``10*hidden + 3*intermediate + 2*heads*seq``
  values (attention inputs/outputs, norms, SwiGLU branches, attention scores and probabilities), 4 bytes
  each, 2 with a 16-bit or quantised LoRA base (a full-forward window computes in float32 whatever its frozen
  target's bits: :mod:`fedfusion.models.frozen`); no fused attention. With activation checkpointing
  (``train.checkpoint``) each layer keeps only its input (``hidden`` values per token) and one layer's values
  are live at a time in backward. Per token the
  logits: ``vocab`` values in the model's dtype, the loss's float32 copy where that dtype is narrower, the
  float32 log-softmax cross-entropy keeps and its float32 gradient (12 bytes per vocabulary entry at fp32, 14
  at 16 bits: on a
  135M base with a 49k vocabulary this is a fifth of the peak, measured on CUDA in
  ``benchmarks/results/cuda_lora.md``).

A plan fits a device when its estimate is within ``usable`` (default 0.9) of the catalog's
``memory_gb`` (already the memory an app may use), the rest left for allocator fragmentation, the
runtime and the data pipeline.

Time and energy per round come from :func:`fedfusion.devices.energy.price_work`, the cost model the run's ledger
prices every client with: the tier's training FLOPs (``6 x params x tokens``) and the bytes it moves each
round (what the server sends it, what it sends back), split into compute and transfer; joules are drawn
from the wall (charger losses included), as the ledger's ``energy_j``. Bytes are the arrays' data only; a
message adds a few hundred bytes of names and headers per array.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig

from fedfusion.config.methods import DISTILL, GENERATIVE, SLICES, SUBMODEL, UNITS
from fedfusion.config.recipe import Recipe, method_label, tier_methods
from fedfusion.config.sections import RecipeError, UnitsSection
from fedfusion.devices.catalog import Device, load_catalog
from fedfusion.devices.energy import frozen_work_params, price_work, train_flops
from fedfusion.models.build import config_aliases, target_config, target_model_config, wire_state
from fedfusion.models.full_forward import window_axes, window_params
from fedfusion.models.low_rank import factor_params, split
from fedfusion.models.slicing import plan_slice, sub_config
from fedfusion.wire.quantize import encoded_bytes

WIDTH_LADDER = (1.0, 0.5, 0.25, 0.125, 0.0625)  # FedRolex's capacity ladder
LORA_RANKS = (64, 32, 16, 8, 4, 2, 1)
BASE_BITS = (32, 16, 8, 4)  # preferred first: full precision, bf16, 8-bit, 4-bit
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
USABLE = 0.9
_BITS_STORED = {32: 32.0, 16: 16.0, 8: 8.5, 4: 4.5}  # bits per quantised weight, block scales included


def llama_params(config: LlamaConfig) -> int:
    """Parameter count of a Llama config (untied embeddings unless the config ties them)."""
    h, i, v, layers = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    kv = config.num_key_value_heads or config.num_attention_heads  # LlamaConfig's own default: one per head
    attn = h * d * (2 * config.num_attention_heads + 2 * kv)
    per_layer = attn + 3 * h * i + 2 * h
    heads = 1 if config.tie_word_embeddings else 2
    return layers * per_layer + heads * v * h + h


def param_count(config: PretrainedConfig) -> int:
    """Parameters of a causal-LM config: closed form for Llama-style configs, else counted on the meta device."""
    if isinstance(config, LlamaConfig):
        return llama_params(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _dims(config: PretrainedConfig) -> tuple[int, int, int, int, int, int]:
    """(hidden, intermediate, heads, kv heads, head_dim, layers) of a transformer config."""
    h = config.hidden_size
    inter = getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", None) \
        or getattr(config, "n_inner", None) or 4 * h
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or h // heads
    return h, inter, heads, kv, d, config.num_hidden_layers


def lora_params(config: PretrainedConfig, rank: int, modules: Sequence[str] = LORA_MODULES) -> int:
    """Trainable parameters of rank-``rank`` LoRA adapters on ``modules`` of every decoder layer (Llama names)."""
    h, inter, heads, kv, d, layers = _dims(config)
    shapes = {"q_proj": (h, heads * d), "k_proj": (h, kv * d), "v_proj": (h, kv * d), "o_proj": (heads * d, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    unknown = [m for m in modules if m not in shapes]
    if unknown:
        raise ValueError(f"lora modules: unknown module {unknown[0]!r}; known: {', '.join(shapes)}")
    if rank < 1:
        raise ValueError(f"lora rank: must be >= 1, got {rank}")
    return layers * sum(rank * (shapes[m][0] + shapes[m][1]) for m in modules)


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak training memory, by part, in bytes (see the module docstring)."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    params: int  # all parameters of the model trained (base included)
    trainable: int
    step: int = 0  # the optimizer step's temporaries: live after backward has freed the activations

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + max(self.activations, self.step)


def estimate_memory(
    config: PretrainedConfig, batch: int, seq: int, lora_rank: int | None = None, base_bits: int = 32,
    lora_modules: Sequence[str] = LORA_MODULES, compute_bytes: int = 2, window: int | None = None,
    checkpoint: bool = False,
) -> MemoryEstimate:
    """Peak training memory of full fine-tuning (``lora_rank=None``, fp32), LoRA on a ``base_bits`` base, or a
    full-forward window of ``window`` parameters (fp32, with its AdamW state) on a frozen ``base_bits`` target.

    A 4/8-bit base keeps its non-linear weights (embeddings, norms) and its activations in the compute dtype,
    ``compute_bytes`` per value (bitsandbytes' compute dtype: 4 for float32, 2 for float16/bfloat16); a
    32- or 16-bit base keeps them in its own precision; a window computes in float32. ``checkpoint``: activation
    checkpointing (each layer's input kept, one layer's activations live at a time)."""
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be >= 1, got {batch}, {seq}")
    if base_bits not in _BITS_STORED:
        raise ValueError(f"base_bits: must be one of {', '.join(map(str, _BITS_STORED))}, got {base_bits}")
    if lora_rank is None and window is None and base_bits not in (32, 16):
        raise ValueError("base_bits: full training keeps its weights in 32 or 16 bits; 8 and 4 need lora_rank or window")
    h, inter, heads, kv, d, layers = _dims(config)
    params = param_count(config)
    one_layer = batch * seq * (10 * h + 3 * inter + 2 * heads * seq)
    layer_values = batch * seq * layers * h + one_layer if checkpoint else layers * one_layer
    if lora_rank is None and window is None:  # 16: pure bfloat16 training, AdamW's moments in bfloat16 too
        b = base_bits // 8
        return MemoryEstimate(b * params, b * params, 2 * b * params,
                              b * layer_values + _logit_bytes(config, batch, seq, b), params, params, b * params)
    trainable = lora_params(config, lora_rank, lora_modules) if lora_rank is not None else int(window or 0)
    linear = linear_params(config)
    act_bytes = 4 if window is not None else base_bits // 8 if base_bits >= 16 else compute_bytes
    if base_bits >= 16:
        weights = params * base_bits / 8
    else:
        weights = linear * _BITS_STORED[base_bits] / 8 + (params - linear) * act_bytes
    return MemoryEstimate(int(weights) + 4 * trainable, 4 * trainable, 8 * trainable,
                          act_bytes * layer_values + _logit_bytes(config, batch, seq, act_bytes),
                          params + (trainable if window is None else 0), trainable, 4 * trainable)


def linear_params(config: PretrainedConfig) -> int:
    """Values of the decoder layers' projection matrices (what a quantised base or frozen target holds narrow)."""
    h, inter, heads, kv, d, layers = _dims(config)
    return layers * (h * heads * d * 2 + h * kv * d * 2 + 3 * h * inter)


def _logit_bytes(config: PretrainedConfig, batch: int, seq: int, act_bytes: int) -> int:
    """The logits' bytes at the loss: the model's output (``act_bytes`` per value), its float32 copy where the
    output is narrower (``fedfusion.train.loop.lm_loss`` and ``fedfusion.train.instruct.response_loss`` upcast), the
    float32 log-softmax the cross-entropy keeps for backward and the float32 gradient backward starts from
    (``benchmarks/results/cuda_windows.md``: with activation checkpointing it is a visible part of the peak)."""
    per_value = act_bytes + (4 if act_bytes < 4 else 0) + 4 + 4  # + the loss's float32 gradient, live with them
    return batch * seq * config.vocab_size * per_value


def training_memory_bytes(config: PretrainedConfig, batch: int, seq: int, checkpoint: bool = False) -> int:
    """fp32 AdamW training estimate: weights + grads + 2 moments, plus stored activations and logits."""
    return estimate_memory(config, batch, seq, checkpoint=checkpoint).total


def _budget(device: Device, usable: float) -> float:
    if not 0 < usable <= 1:
        raise ValueError(f"usable: must be in (0, 1], got {usable}")
    return device.memory_gb * 2**30 * usable


def sliced_config(config: PretrainedConfig, width: float, axes: Sequence[str] | None = None) -> PretrainedConfig:
    """The config of the width-``width`` static sub-model (the size every policy gives that width)."""
    return config if width == 1 else sub_config(config, plan_slice(config, width, "static", axes=axes))


def fit_width(
    config: PretrainedConfig, device: Device, batch: int, seq: int, ladder: Sequence[float] = WIDTH_LADDER,
    usable: float = USABLE, axes: Sequence[str] | None = None,
) -> float | None:
    """The largest width of ``ladder`` whose sub-model trains within ``usable`` of the device's memory, or None."""
    budget = _budget(device, usable)
    if not ladder or any(not 0 < w <= 1 for w in ladder):
        raise ValueError(f"ladder: widths must be in (0, 1], got {list(ladder)}")
    for width in sorted(ladder, reverse=True):
        if training_memory_bytes(sliced_config(config, width, axes), batch, seq) <= budget:
            return width
    return None


@dataclass(frozen=True)
class LoraFit:
    """A LoRA assignment that fits: adapter rank, bits of the frozen base, estimated bytes."""

    rank: int
    base_bits: int
    memory: MemoryEstimate


def fit_lora_rank(
    config: PretrainedConfig, device: Device, batch: int, seq: int, ranks: Sequence[int] = LORA_RANKS,
    base_bits: Sequence[int] = BASE_BITS, modules: Sequence[str] = LORA_MODULES, usable: float = USABLE,
    compute_bytes: int = 2,
) -> LoraFit | None:
    """The most precise base (in ``base_bits`` order) on which some rank fits, with the largest rank that
    fits on it; None if no (rank, precision) fits. Precision comes first: the base dominates memory,
    the adapters barely count."""
    budget = _budget(device, usable)
    if not ranks:
        raise ValueError("ranks: give at least one LoRA rank")
    for bits in base_bits:
        for rank in sorted(ranks, reverse=True):
            est = estimate_memory(config, batch, seq, lora_rank=rank, base_bits=bits, lora_modules=modules,
                                  compute_bytes=compute_bytes)
            if est.total <= budget:
                return LoraFit(rank, bits, est)
    return None


def recipe_target(recipe: Recipe) -> PretrainedConfig:
    """The target's config; a facts recipe's vocabulary is its own word tokenizer's (unless the target is a
    pretrained model, which brings its tokenizer)."""
    if recipe.data.source == "facts" and not recipe.model.pretrained:
        from fedfusion.data.population import data_spec, data_tokenizer

        return target_config(recipe.model, data_tokenizer(data_spec(recipe.data_source())))
    return target_model_config(recipe.model)


def auto_widths(
    recipe: Recipe, ladder: Sequence[float] = WIDTH_LADDER, usable: float = USABLE,
) -> dict[str, float | None]:
    """For every tier of the population mix, :func:`fit_width` of the recipe's target (None: nothing fits). With
    full-forward windows (``fusion.forward=full``) a width must also fit as a window (:func:`window_memory`: the
    frozen target and the whole target's activations besides the window), so a tier steps down the ladder until it
    does, with a core (``fusion.window_core``) of the smallest slice width found or its own width where that is
    smaller (the core is the smallest tier's width; it can only shrink, so every window checked still fits)."""
    catalog = load_catalog(recipe.population.catalog)
    target = recipe_target(recipe)
    axes = recipe.fusion.axes or None
    fitted = {tier: fit_width(target, catalog[tier], recipe.train.batch_size, recipe.train.seq_len, ladder, usable,
                              axes)
              for tier in recipe.population.mix}
    f = recipe.fusion
    if f.forward != "full" or f.method != SUBMODEL:
        return fitted
    known = [w for w in fitted.values() if w is not None]
    core = min(known) if f.window_core and known else 0.0
    steps = sorted(ladder, reverse=True)
    for tier, width in fitted.items():
        budget = _budget(catalog[tier], usable)
        while width is not None and window_memory(recipe, target, f.window_widths.get(tier, width),
                                                  min(core, width))[1] > budget:
            width = next((w for w in steps if w < width), None)
        fitted[tier] = width
    return fitted


def fit_widths(recipe: Recipe) -> None:
    """With ``fusion.auto_widths``, set ``fusion.widths`` to :func:`auto_widths` (so the run's resolved recipe
    records them); a tier that fits no width of ``fusion.width_ladder`` is a RecipeError naming it. Here and not
    in the recipe module, so that validating a recipe needs no torch."""
    if not recipe.fusion.auto_widths:
        return
    fitted = auto_widths(recipe, recipe.fusion.width_ladder)
    unfit = [tier for tier, width in fitted.items() if width is None]
    if unfit:
        row = next(r for r in plan_table(recipe, fitted, ladder=recipe.fusion.width_ladder) if r["tier"] == unfit[0])
        raise RecipeError(f"fusion.auto_widths: tier {unfit[0]!r} fits no width of fusion.width_ladder "
                          f"({row['fits']}); see `fedfusion plan`")
    recipe.fusion.widths = {tier: float(width) for tier, width in fitted.items() if width is not None}  # all fit


def _mb(n: float) -> float:
    return round(n / 2**20, 1)


def priced(device: Device, flops: float, bytes_down: int, bytes_up: int) -> dict[str, float]:
    """A plan row's cost columns: ``price_work`` of one round's FLOPs and transfers on ``device``, time and
    wall joules split into compute and transfer (the totals are the ledger's ``virtual_s`` and ``energy_j``)."""
    cost = price_work(device, flops, bytes_down, bytes_up)
    return {"MB down": bytes_down / 2**20, "MB up": bytes_up / 2**20,
            "compute s": cost.compute_s, "transfer s": cost.comm_s, "s/round": cost.virtual_s,
            "compute J": cost.compute_wall_j, "transfer J": cost.radio_wall_j, "J/round": cost.wall_j}


_UNPRICED = dict.fromkeys(("MB down", "MB up", "compute s", "transfer s", "s/round", "compute J", "transfer J",
                           "J/round"))


def _wire_bytes(recipe: Recipe, tier: str, params: int) -> tuple[int, int]:
    """Bytes a ``tier`` sub-model of ``params`` values goes down in (``fusion.wire_dtype``) and its reply up in
    (``fusion.wire_up``): :func:`fedfusion.wire.quantize.encoded_bytes`, as one matrix (float32 unless the tier trains
    with sub-model fusion)."""
    if tier_methods(recipe).get(tier) != SUBMODEL:
        return 4 * params, 4 * params
    return encoded_bytes(recipe.fusion.wire_dtype, params), encoded_bytes(recipe.fusion.wire_up, params)


def plan_table(
    recipe: Recipe, widths: Mapping[str, float | None] | None = None, usable: float = USABLE,
    ladder: Sequence[float] = WIDTH_LADDER, tiers: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """One row per tier of the population mix, narrowest first: the slice it trains (sub-model fusion; under
    generative distillation the static slice it keeps as its own model), parameters, memory, and one round's
    cost (:func:`priced`: training FLOPs, the slice down in ``fusion.wire_dtype`` and back in ``fusion.wire_up``),
    at ``train.local_steps``: the most a client takes (``train.max_epochs`` gives one with few examples fewer).

    ``widths`` (default: the recipe's ``fusion.widths``; pass :func:`auto_widths` for auto-fit) may hold
    None for a tier that fits nothing: its row says so (with what ``ladder``'s smallest width would need)
    instead of raising. Memory is :func:`training_memory_bytes`. ``tiers`` (default: every tier of the mix) picks
    the tiers to plan (a mixed federation's slicing tiers).
    """
    catalog = load_catalog(recipe.population.catalog)
    target = recipe_target(recipe)
    axes = recipe.fusion.axes or None
    widths = recipe.fusion.widths if widths is None else widths
    batch, seq = recipe.train.batch_size, recipe.train.seq_len
    tokens = recipe.train.local_steps * batch * seq
    fitted = [w for w in widths.values() if w is not None]
    core = min(fitted) if recipe.fusion.window_core and fitted else 0.0  # full forward: in every window too
    rows = []
    for tier in sorted(tiers or recipe.population.mix, key=lambda t: (widths.get(t) is not None, widths.get(t) or 0)):
        device = catalog[tier]
        width = widths.get(tier)
        budget = _budget(device, usable)
        row: dict[str, Any] = {"tier": tier, "width": width}
        full = recipe.fusion.forward == "full" and tier_methods(recipe).get(tier) == SUBMODEL
        if width is None:
            smallest = min(ladder)
            need = (window_memory(recipe, target, smallest, smallest if recipe.fusion.window_core else 0.0)[1] if full
                    else training_memory_bytes(sliced_config(target, smallest, axes), batch, seq))
            what = f"a full-forward window of {smallest:g}" if full else f"width {smallest:g}"
            rows.append({**row, "slice": "-", "params": None, "peak MB": _mb(need),
                         "device MB": round(device.memory_gb * 1024),
                         "fits": f"NO: even {what} needs {_mb(need)} MB, {_mb(budget)} MB usable", **_UNPRICED})
            continue
        if full:
            rows.append({**row, **window_row(recipe, target, tier, width, core, device, budget, tokens)})
            continue
        sub = sliced_config(target, width, axes)
        params = param_count(sub)
        mem = training_memory_bytes(sub, batch, seq, recipe.train.checkpoint)
        rows.append({
            **row,
            "slice": f"{sub.num_attention_heads}/{target.num_attention_heads} heads, "
                     f"{_dims(sub)[1]}/{_dims(target)[1]} neurons"
                     + (", activations checkpointed" if recipe.train.checkpoint else ""),
            "params": params, "peak MB": _mb(mem), "device MB": round(device.memory_gb * 1024),
            "fits": "yes" if mem <= budget else "NO",
            **priced(device, train_flops(params, tokens), *_wire_bytes(recipe, tier, params)),
        })
    return rows


FROZEN_BITS = {"float32": 32, "float16": 16, "int8": 8, "int4": 4}


def window_memory(recipe: Recipe, target: PretrainedConfig, width: float, core: float,
                  expand: bool = False) -> tuple[int, int]:
    """A full-forward window's trained parameters and its device's peak training memory in bytes (the frozen
    target in ``fusion.frozen_dtype``, the window's float32 weights, gradients and AdamW state, the whole target's
    activations): a window of ``width`` of the units plus ``core``, or with ``fusion.window_rank`` a rank-r update
    of every matrix (whatever the width). ``expand``: the frozen target made float32 once for the round
    (``WindowSpec.expand``), with the message's narrow copy still held beside it."""
    f = recipe.fusion
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
    return window, dense + frozen_window_memory(target, recipe.train.batch_size, recipe.train.seq_len, window,
                                                f.frozen_dtype, recipe.train.checkpoint, expand, f.wire_dtype)


def rank_dense_bytes(target: PretrainedConfig, factored: Sequence[str]) -> int:
    """What a rank-r update costs beyond its factors where it does not ride on a linear layer (an embedding, a
    Conv1D): the parametrization makes the dense ``frozen + B @ A`` at each use (a tied embedding: twice, input and
    head), and backward its dense gradient, float32 each (``fedfusion.models.frozen._Added``)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(target)
    aliases = config_aliases(target)
    total = 0
    for name in factored:
        module = model.get_submodule(name.rpartition(".")[0])
        if not isinstance(module, torch.nn.Linear):
            uses = 1 + sum(1 for source in aliases.values() if source == name)
            total += 2 * 4 * model.get_parameter(name).numel() * uses
    return total


def frozen_window_memory(target: PretrainedConfig, batch: int, seq: int, window: int, frozen_dtype: str,
                         checkpoint: bool = False, expand: bool = False, wire_dtype: str = "float32") -> int:
    """Peak bytes of training ``window`` parameters on ``target`` frozen in ``frozen_dtype``; ``expand``: made float32
    once (``WindowSpec.expand``). The message stays held while the device trains (the client app holds it): its
    window values (in ``wire_dtype``) besides the trained copy, and of the frozen target what the model does not
    share with it: the narrow path keeps the projections' codes themselves but decodes the other matrices
    (embeddings) to float32; the expanded path decodes them all."""
    bits = 32 if expand else FROZEN_BITS[frozen_dtype]
    mem = estimate_memory(target, batch, seq, base_bits=bits, window=window, checkpoint=checkpoint).total
    decoded = param_count(target) - (0 if expand else linear_params(target))
    return mem + encoded_bytes(wire_dtype, window) + (encoded_bytes(frozen_dtype, decoded) if bits != 32 or expand else 0)


def window_path(recipe: Recipe, target: PretrainedConfig, width: float, core: float,
                budget: float) -> tuple[int, int, bool]:
    """The way a device with ``budget`` bytes trains its window: expanded (the frozen target made float32 once for
    the round: no dequantisation in every pass) where that fits, else on the target as it travelled; as (window
    parameters, peak bytes, expanded; the plan's row says "int8 target -> float32"). The run sends the same choice
    (:func:`expanded_tiers`)."""
    window, wide = window_memory(recipe, target, width, core, expand=True)
    if wide <= budget:
        return window, wide, True
    return (*window_memory(recipe, target, width, core), False)


def expanded_tiers(recipe: Recipe, usable: float = USABLE) -> frozenset[str]:
    """The tiers of a full-forward sub-model recipe whose memory holds their window with the frozen target made
    float32 (:func:`window_path`): their messages say so (``WindowSpec.expand``); the values trained are the same."""
    f = recipe.fusion
    methods = tier_methods(recipe)
    tiers = [t for t in recipe.population.mix if methods.get(t) == SUBMODEL and t in f.widths]
    if f.forward != "full" or not tiers:
        return frozenset()
    catalog = load_catalog(recipe.population.catalog)
    target = recipe_target(recipe)
    core = min(f.widths.values()) if f.window_core else 0.0
    return frozenset(t for t in tiers if window_path(recipe, target, f.window_widths.get(t, f.widths[t]), core,
                                                     _budget(catalog[t], usable))[2])


def window_row(recipe: Recipe, target: PretrainedConfig, tier: str, width: float, core: float, device: Device,
               budget: float, tokens: int) -> dict[str, Any]:
    """A full-forward tier's plan (``fusion.forward=full``): its window of units (``fusion.window_widths``, else its
    ``width``, as the plan's widths give it; the residual stream whole) plus ``core`` (the smallest width's units,
    in every window with ``fusion.window_core``; 0 without), the frozen target held in ``fusion.frozen_dtype`` plus
    the window's weights, gradients and AdamW state and the whole target's activations; the frozen target down
    (every round) and the window both ways; the target's forward and activation gradients plus the window's
    training as FLOPs."""
    f = recipe.fusion
    width = f.window_widths.get(tier, width)
    window, mem, expand = window_path(recipe, target, width, core, budget)
    total = param_count(target)
    down = encoded_bytes(f.frozen_dtype, total) + encoded_bytes(f.wire_dtype, window)
    label = (f"rank-{f.window_rank} of every matrix" if f.window_rank else
             f"units {width:g}" + (f" + core {core:g}" if core else ""))
    label += ", checkpointed" if recipe.train.checkpoint else ""
    return {"width": 1.0 if f.window_rank else width,
            "slice": f"{label}; {f.frozen_dtype} target" + (" -> float32" if expand else ""),
            "params": window, "peak MB": _mb(mem), "device MB": round(device.memory_gb * 1024),
            "fits": "yes" if mem <= budget else "NO",
            **priced(device, train_flops(frozen_work_params(total, window), tokens), down,
                     encoded_bytes(f.wire_up, window))}


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
    target, catalog = recipe_target(recipe), load_catalog(recipe.population.catalog)
    rows = []
    for tier in recipe.population.mix:
        device = catalog[tier]
        budget = _budget(device, usable)
        for way, trainable, off, on in training_ways(recipe, target, recipe.fusion.widths.get(tier, 1.0)):
            fits = ("NO: no bfloat16 arithmetic on this tier (catalog bfloat16: false)"
                    if BFLOAT16_WAY in way and not device.bfloat16 else
                    "yes" if off <= budget else "with checkpointing" if on <= budget else
                    f"NO: needs {_mb(on)} MB even checkpointed, {_mb(budget)} MB usable")
            rows.append({"tier": tier, "way": way, "trainable": trainable, "peak MB": _mb(off),
                         "checkpointed MB": _mb(on), "fits": fits})
    title = (f"ways to train {recipe.name}'s target ({param_count(target):,} parameters) on each tier, batch "
             f"{recipe.train.batch_size} x {recipe.train.seq_len} tokens, {usable:.0%} of the tier's memory usable")
    return PlanView(title, rows, ("tier", "way", "trainable", "peak MB", "checkpointed MB", "fits"),
                    left=("tier", "way", "fits"), width=170, per_round=False)


def _family_label(name: str, config: PretrainedConfig, kind: str) -> str:
    """e.g. ``small: gpt2 48x2, 4 heads, bpe 384``: the family, its width x layers, heads and tokenizer."""
    h, _, heads, _, _, layers = _dims(config)
    vocab = "" if kind == "target" else f" {config.vocab_size}"
    return f"{name}: {config.model_type} {h}x{layers}, {heads} heads, {kind}{vocab}"


def distill_plan_table(recipe: Recipe, usable: float = USABLE, tiers: Sequence[str] | None = None,
                       ) -> list[dict[str, Any]]:
    """One row per tier for distillation fusion: the family model it trains (FedAvg within the family), its
    parameters, memory, and one round's cost (:func:`priced`: training FLOPs, the family model down and up in
    float32); then the server's row (:func:`server_plan_row`). Builds the families as the run does (BPE
    tokenizers trained on the transfer text), so the parameter counts are the run's. ``tiers`` (default: every tier
    of the mix) picks the tiers to plan (a mixed federation's distillation tiers)."""
    from fedfusion.data.population import data_spec
    from fedfusion.data.text import load_tokenizer
    from fedfusion.train.distill import forward_flops
    from fedfusion.train.transfer import distill_families, transfer_text

    catalog = load_catalog(recipe.population.catalog)
    d, batch, seq = recipe.distill, recipe.train.batch_size, recipe.train.seq_len
    text = transfer_text(d.transfer.source, data_spec(recipe.data_source()), d.transfer.max_chars, d.transfer.path)
    families = distill_families(recipe.distill, recipe.model.max_position, load_tokenizer(recipe.model.pretrained), text)
    tokens = recipe.train.local_steps * batch * seq
    rows, trained = [], {}
    for tier in tiers or recipe.population.mix:
        device, name = catalog[tier], d.tier_family[tier]
        config = families[name][0]
        params = trained[name] = param_count(config)
        mem = training_memory_bytes(config, batch, seq)
        rows.append({
            "tier": tier, "trains": _family_label(name, config, d.families[name].tokenizer),
            "params": params, "peak MB": _mb(mem), "device MB": round(device.memory_gb * 1024),
            "fits": "yes" if mem <= _budget(device, usable) else "NO",
            **priced(device, train_flops(params, tokens), 4 * params, 4 * params),
        })
    target = param_count(recipe_target(recipe))
    server_tokens, back_tokens = (steps * d.server_batch_size * seq for steps in (d.server_steps, d.back_steps))
    teachers = d.kd_weight > 0  # kd_weight 0 trains on the transfer text alone: no teacher runs
    flops = train_flops(target, server_tokens) + teachers * sum(forward_flops(p, server_tokens)
                                                                for p in trained.values())
    if d.back_distill:
        flops += sum(train_flops(p, back_tokens) + teachers * forward_flops(target, back_tokens)
                     for p in trained.values())
    what = f"distils {', '.join(sorted(trained))} in ({d.server_steps} steps)" + (
        f", and back ({d.back_steps} each)" if d.back_distill else "")
    return rows + [server_plan_row(recipe, d.server_device, what, flops, d.server_batch_size, usable)]


def mixed_plan_table(recipe: Recipe, usable: float = USABLE) -> list[dict[str, Any]]:
    """A mixed federation (``fusion.tiers``): every tier's row from its own method's table, with a ``method`` column
    (what it trains under ``trains``), then the server's rows of the methods that have server work."""
    methods = tier_methods(recipe)
    mine = {m: [t for t, n in methods.items() if n == m] for m in dict.fromkeys(methods.values())}
    rows: list[dict[str, Any]] = []
    sliced = [tier for name in SLICES for tier in mine.get(name, [])]  # the tiers that train a width slice
    if sliced:
        slicing = plan_table(recipe, usable=usable, tiers=sliced)
        rows += [{"method": methods[r["tier"]], **r,
                  "trains": f"width {r['width']:g}: {r['slice']}" if r["width"] is not None else r["slice"]}
                 for r in slicing]
    server = []
    if DISTILL in mine:
        *family_rows, distill_server = distill_plan_table(recipe, usable, mine[DISTILL])
        rows += [{"method": DISTILL, **r} for r in family_rows]
        server.append({"method": DISTILL, **distill_server})
    if GENERATIVE in mine:
        server.append({"method": GENERATIVE, **generative_server_row(recipe, usable)})
    order = list(recipe.population.mix)
    return sorted(rows, key=lambda r: order.index(r["tier"])) + server


def generative_server_row(recipe: Recipe, usable: float = USABLE) -> dict[str, Any]:
    """The server's row under generative distillation: it trains the target on the clients' samples."""
    g = recipe.generative
    flops = train_flops(param_count(recipe_target(recipe)), g.server_steps * g.server_batch * recipe.train.seq_len)
    return server_plan_row(recipe, g.server_device, f"learns the samples ({g.server_steps} steps)",
                           flops, g.server_batch, usable)


def server_plan_row(recipe: Recipe, server_device: str, what: str, flops: float, batch: int,
                    usable: float = USABLE) -> dict[str, Any]:
    """The server's own work per round, priced on ``server_device`` as the ledger prices it (``server_energy_j``:
    its FLOPs, no transfers); memory is training the target at the server's batch size."""
    device = load_catalog(recipe.population.catalog)[server_device]
    target = recipe_target(recipe)
    mem = training_memory_bytes(target, batch, recipe.train.seq_len)
    return {"tier": f"server ({server_device})", "trains": what, "params": param_count(target),
            "peak MB": _mb(mem), "device MB": round(device.memory_gb * 1024),
            "fits": "yes" if mem <= _budget(device, usable) else "NO", **priced(device, flops, 0, 0)}


def lora_plan_table(recipe: Recipe, base_config: PretrainedConfig, usable: float = USABLE) -> list[dict[str, Any]]:
    """One row per tier for LoRA fusion: its rank and base precision, trainable parameters, estimated peak
    memory on its base and on an fp32 base, whether it fits, the largest rank that would fit, and one round's
    cost (:func:`priced`: the FLOPs of :func:`~fedfusion.devices.energy.frozen_work_params`, the adapter down in
    ``fusion.wire_dtype`` and up in ``fusion.wire_up``)."""
    catalog = load_catalog(recipe.population.catalog)
    lora, batch, seq = recipe.lora, recipe.train.batch_size, recipe.train.seq_len
    modules = list(lora.target_modules)
    compute = getattr(torch, lora.dtype).itemsize  # a quantised base computes (and keeps its other weights) in lora.dtype
    base_params, tokens = param_count(base_config), recipe.train.local_steps * batch * seq
    rows = []
    for tier in recipe.population.mix:
        device, rank, bits = catalog[tier], lora.ranks[tier], lora.quantize.get(tier, 0) or 32
        est = estimate_memory(base_config, batch, seq, lora_rank=rank, base_bits=bits, lora_modules=modules,
                              compute_bytes=compute)
        fp32 = estimate_memory(base_config, batch, seq, lora_rank=rank, base_bits=32, lora_modules=modules)
        best = fit_lora_rank(base_config, device, batch, seq, modules=modules, usable=usable, compute_bytes=compute)
        rows.append({
            "tier": tier, "rank": rank, "base": f"{bits}-bit", "trainable": est.trainable,
            "peak MB": _mb(est.total), "fp32 base MB": _mb(fp32.total), "device MB": round(device.memory_gb * 1024),
            "fits": "yes" if est.total <= _budget(device, usable) else "NO",
            "max fit": f"r={best.rank} on {best.base_bits}-bit" if best else "nothing fits",
            **priced(device, train_flops(frozen_work_params(base_params, est.trainable), tokens),
                     encoded_bytes(recipe.fusion.wire_dtype, est.trainable), encoded_bytes(recipe.fusion.wire_up,
                                                                                         est.trainable)),
        })
    return rows


@dataclass(frozen=True)
class UnitsWork:
    """One units-mode step of a recipe's shape at a micro-batch count: one micro-batch's phases, the server's own
    FLOPs and its checks' FLOPs, and the server's seconds between phases and for the optimizer (priced on
    ``units.server_device``)."""

    phases: list[Any]
    own: dict[str, float]  # the server's own FLOPs by kind (fedfusion.units.phases.server_flops)
    verify: float
    gap_s: float
    optimizer_s: float


def units_work(recipe: Recipe, micro_batches: int) -> UnitsWork:
    """The step :func:`units_plan` prices, with the batch cut into ``micro_batches``."""
    from fedfusion.data.population import data_spec, data_tokenizer
    from fedfusion.units.ledger import server_timeline
    from fedfusion.units.phases import WEIGHT_GRADIENT, llama_phases, server_flops
    from fedfusion.units.verify import check_flops

    m, u, seq = recipe.model, recipe.units, recipe.train.seq_len
    vocab = len(data_tokenizer(data_spec(recipe.data_source())))
    tokens = recipe.train.batch_size // micro_batches * seq
    shape: dict[str, Any] = dict(hidden=m.hidden_size, intermediate=m.intermediate_size, layers=m.num_layers,
                                 heads=m.num_heads, kv_heads=m.num_kv_heads, vocab=vocab)
    phases = llama_phases(**shape, tokens=tokens, mode=u.offload)
    own = server_flops(**shape, tokens=tokens * micro_batches, seq=seq, params=param_count(recipe_target(recipe)),
                       mode=u.offload, optimizer=recipe.train.optimizer)
    # one check per product; a weight gradient summed on the devices is checked once per step and SuperNode, over
    # the tokens of that node's micro-batches (fedfusion.units.accumulate; node j sums micro-batches j, j+K, ..)
    summed = u.accumulate and micro_batches > 1
    per_node = [c for c in (len(range(j, micro_batches, u.supernodes)) for j in range(u.supernodes)) if c]
    verify = 0.0
    for shapes, specs in phases if u.verify else ():
        for g, spec in zip(shapes, specs):
            if summed and spec == WEIGHT_GRADIENT:
                verify += sum(check_flops(g.m, g.n, g.k * c) for c in per_node)
            else:
                verify += micro_batches * check_flops(g.m, g.n, g.k)
    server = load_catalog(recipe.population.catalog)[u.server_device]
    gap_s, optimizer_s = server_timeline(server, own, verify, len(phases) * micro_batches)
    return UnitsWork(phases, own, verify, gap_s, optimizer_s)


def units_devices(recipe: Recipe) -> list[Any]:
    """The units mode's devices, one per client of the population (:func:`fedfusion.units.from_catalog`)."""
    from fedfusion.data.population import tier_list
    from fedfusion.units import from_catalog

    catalog = load_catalog(recipe.population.catalog)
    return [from_catalog(catalog[t], name=str(i)) for i, t in enumerate(tier_list(recipe.population, recipe.seed))]


def units_micro_batches(recipe: Recipe) -> int:
    """``units.micro_batches`` as a run uses it: the recipe's count, or with 0 the count
    :func:`fedfusion.units.timeline.choose_micro_batches` predicts for the recipe's devices and shape (the smallest
    that keeps the busiest link >= 70 % busy without a slower step, else the fastest)."""
    from fedfusion.units.timeline import choose_micro_batches

    u = recipe.units
    if u.micro_batches:
        return u.micro_batches
    works = {}  # count -> its work, built once for both callbacks

    def work(m: int) -> UnitsWork:
        if m not in works:
            works[m] = units_work(recipe, m)
        return works[m]

    chosen, _ = choose_micro_batches(
        units_devices(recipe), lambda m: work(m).phases, recipe.train.batch_size,
        kwargs_for=lambda m: {"server_gap_s": work(m).gap_s, "optimizer_s": work(m).optimizer_s},
        deadline_factor=u.deadline_factor, in_flight=u.in_flight, accumulate=u.accumulate, min_count=u.supernodes,
        **u.runtime())
    return chosen


def units_plan(recipe: Recipe) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The exact (units) mode's step from the recipe's shape alone (``fedfusion.units.phases`` priced by the
    timeline on the population's devices, no churn, the server's own time between phases): the micro-batch count
    (:func:`units_micro_batches`), the step's virtual seconds, its floor, busiest-link utilisation and phases, the
    server's work and the same step on the cloud GPU
    (:func:`fedfusion.units.ledger.price_server`, under ``server``), and per tier the devices, their mean units per
    step, the largest unit (rows x columns x inner length), their mean MB down / up and busy seconds per step."""
    from fedfusion.data.population import tier_list
    from fedfusion.units.ledger import price_server
    from fedfusion.units.plan import CostModel, Tile, plan_phase
    from fedfusion.units.timeline import simulate

    u, micro = recipe.units, units_micro_batches(recipe)
    work = units_work(recipe, micro)
    phases, own, verify = work.phases, work.own, work.verify
    gemms = [g for shapes, _ in phases for g in shapes] * micro
    catalog = load_catalog(recipe.population.catalog)
    server = catalog[u.server_device]
    tiers = tier_list(recipe.population, recipe.seed)
    devices = units_devices(recipe)
    timing = simulate(devices, [phases] * micro, deadline_factor=u.deadline_factor, server_gap_s=work.gap_s,
                      optimizer_s=work.optimizer_s, in_flight=u.in_flight, accumulate=u.accumulate, **u.runtime())
    priced = price_server(server, catalog[recipe.report.cloud], own, verify, int(timing.down_bytes.sum()),
                          int(timing.up_bytes.sum()), float(sum(g.flops for g in gemms)))
    cm = CostModel(devices)
    units: list[list[Tile]] = [[] for _ in devices]  # the timeline's plans (no churn): each device's units
    for shapes, _ in phases:
        for tile in plan_phase(cm, list(range(len(devices))), shapes).tiles:
            units[tile.device].append(tile)
    rows = []
    for tier in sorted(set(tiers)):
        idx = [i for i, t in enumerate(tiers) if t == tier]
        busy = [max(timing.down_busy_s[i], timing.up_busy_s[i], timing.compute_s[i]) for i in idx]
        mine = [t for i in idx for t in units[i]]
        big = max(mine, key=lambda t: t.flops, default=None)
        rows.append({"tier": tier, "devices": len(idx), "used": int(sum(timing.down_bytes[i] > 0 for i in idx)),
                     "units/step": len(mine) * micro / len(idx),
                     "largest unit": f"{big.i1 - big.i0}x{big.j1 - big.j0}x{big.k1 - big.k0}" if big else "",
                     "MB down": float(sum(timing.down_bytes[i] for i in idx)) / len(idx) / 1e6,
                     "MB up": float(sum(timing.up_bytes[i] for i in idx)) / len(idx) / 1e6,
                     "busy s": sum(busy) / len(busy)})
    s = priced.row()
    rows += [{"tier": f"server ({server.name})", "devices": 1, "used": 1, "units/step": None, "largest unit": "",
              "MB down": priced.ingress_bytes / 1e6,
              "MB up": priced.egress_bytes / 1e6,
              "busy s": float(s["server_compute_s"]) + float(s["server_verify_s"]) + float(s["server_comm_s"])},
             {"tier": f"{priced.cloud} (the same step)", "devices": 1, "used": 1, "units/step": None, "largest unit": "",
              "MB down": 0.0, "MB up": 0.0,
              "busy s": priced.cloud_step.compute_s}]
    step = {"step_s": timing.step_s, "floor_s": timing.floor_s, "link_utilisation": timing.link_utilisation,
            "phases": len(phases) * micro, "micro_batches": micro,
            "steps": u.steps, "MB down": float(timing.down_bytes.sum()) / 1e6, "MB up": float(timing.up_bytes.sum()) / 1e6,
            "server": s}
    return step, rows


# What ``fedfusion plan`` prints: each method's registry entry names its view (``plan``), a function of the recipe.
PLAN_COSTS = ("MB down", "MB up", "compute s", "transfer s", "s/round", "compute J", "transfer J", "J/round")


@dataclass(frozen=True)
class PlanView:
    """A plan as a table: its title, rows, the columns shown (key -> header), the left-aligned ones, the width to
    print it in, notes under it, and whether the pricing note and the partitions follow (a per-round plan)."""

    title: str
    rows: list[dict[str, Any]]
    columns: tuple[str, ...]
    left: tuple[str, ...]
    width: int
    notes: tuple[str, ...] = ()
    per_round: bool = True
    headers: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "headers", {k: k for k in self.columns})


def slices_view(recipe: Recipe, title: str = "") -> PlanView:
    """Width slicing: per tier its width (fitted to memory with ``fusion.auto_widths``), slice, size and cost."""
    widths = auto_widths(recipe, recipe.fusion.width_ladder) if recipe.fusion.auto_widths else None
    rows = plan_table(recipe, widths, ladder=recipe.fusion.width_ladder)
    grow = recipe.fusion.grow_rounds()
    title = f"plan for {recipe.name} ({method_label(recipe)}" + title
    title += (f", the smallest slice grown into the target after round {grow}: a round after growth"
              if grow and recipe.fusion.method == SUBMODEL else "")
    title += ", widths fitted to memory)" if widths else ")"
    return PlanView(title, rows, ("tier", "width", "slice", "params", "peak MB", "device MB", "fits", *PLAN_COSTS),
                    left=("tier", "slice", "fits"), width=200)


def generative_view(recipe: Recipe) -> PlanView:
    """Generative distillation: each tier's own model (the static slice at its width), then the server's row."""
    view = slices_view(recipe, ": each tier keeps its own model, the static slice at its width; the server trains "
                               "the target")
    server = generative_server_row(recipe)
    top = recipe.generative.top_k
    extra = f", + seq_len x {top} x 6 bytes of top tokens per window (generative.top_k)" if top else ""
    samples = f"its samples (generative.sample_fraction x its windows x (seq_len + 1) x 8 bytes{extra})"
    if recipe.generative.device_state == "node":
        note = (f"generative.device_state=node: MB down is a device's first round only (afterwards its node keeps "
                f"its model and nothing goes down but the spec); every uplink is {samples} and no model, which the "
                "plan cannot know (MB up and transfer s/J above price the model instead)")
    else:
        note = f"a client's uplink also carries {samples}, which the plan cannot know"
    return replace(view, rows=[*view.rows, {**server, "width": None, "slice": server["trains"]}], notes=(note,))


def distill_view(recipe: Recipe) -> PlanView:
    """Distillation: each tier's family model, then the server's distillation."""
    return PlanView(f"plan for {recipe.name} (distill/{recipe.distill.teacher}: each tier trains its family's "
                    "model, the server distils them into the target)", distill_plan_table(recipe),
                    ("tier", "trains", "params", "peak MB", "device MB", "fits", *PLAN_COSTS),
                    left=("tier", "trains", "fits"), width=240)


def mixed_view(recipe: Recipe) -> PlanView:
    """A mixed federation: every tier's row from its own method, then the server's rows."""
    return PlanView(f"plan for {recipe.name} ({method_label(recipe)}: each tier trains what its method gives it; "
                    "every round folds them into one target, slices first, then the server's distillation)",
                    mixed_plan_table(recipe), ("tier", "method", "trains", "params", "peak MB", "device MB", "fits",
                                               *PLAN_COSTS),
                    left=("tier", "method", "trains", "fits"), width=240)


def lora_view(recipe: Recipe) -> PlanView:
    """LoRA: per tier its rank and base precision, memory against an fp32 base, the largest rank that fits."""
    from transformers import AutoConfig

    from fedfusion.models.pretrained import resolve_base

    config = AutoConfig.from_pretrained(resolve_base(recipe.lora.base))
    return PlanView(f"plan for {recipe.name} (lora/{recipe.lora.method} on {recipe.lora.base}; memory estimated)",
                    lora_plan_table(recipe, config),
                    ("tier", "rank", "base", "trainable", "peak MB", "fp32 base MB", "device MB", "fits", "max fit",
                     *PLAN_COSTS), left=("tier", "base", "fits", "max fit"), width=190)


def _runtime_words(u: UnitsSection) -> str:
    """How the plan's step line names the devices' runtime (``units.lanes``, ``units.supernodes``)."""
    if u.supernodes > 1:
        return f"devices running {u.supernodes} SuperNodes of one message each: units.supernodes"
    held = f"{u.lanes or 'any number of'} message{'' if u.lanes == 1 else 's'}"
    return f"devices holding {held} at a time: units.lanes"


def units_view(recipe: Recipe) -> PlanView:
    """The units mode: per device tier and step what it moves and how long it is busy, the server's row and the
    same step on the cloud GPU, and the step's time."""
    step, rows = units_plan(recipe)
    s = step["server"]
    micro = step["micro_batches"]
    notes = (f"one step: {micro} micro-batch{'es' if micro > 1 else ''}, {step['phases']} phases, "
             f"{step['step_s']:.2f} virtual s (floor {step['floor_s']:.2f} s), busiest-link utilisation "
             f"{step['link_utilisation']:.2f}, {step['MB down']:.1f} MB down and {step['MB up']:.1f} MB up in all; {step['steps']} steps "
             f"(fedfusion.units.timeline on the catalog's links, no churn, the server's time between phases, "
             f"{_runtime_words(recipe.units)})",
             f"server ({s['server_device']}) per step: own compute {s['server_flops'] / 1e9:.3g} GFLOP (attention "
             f"{s['server_attention_flops'] / 1e9:.3g}, element-wise {s['server_elementwise_flops'] / 1e9:.3g}, linear "
             f"{s['server_linear_flops'] / 1e9:.3g}, optimizer {s['server_optimizer_flops'] / 1e9:.3g}) "
             f"{s['server_compute_s']:.3g} s; checks {s['server_verify_flops'] / 1e9:.3g} GFLOP "
             f"{s['server_verify_s']:.3g} s; egress {s['server_egress_bytes'] / 1e6:.1f} MB, ingress "
             f"{s['server_ingress_bytes'] / 1e6:.1f} MB {s['server_comm_s']:.3g} s; {s['server_energy_j']:.3g} J "
             f"(price_work on the catalog tier)",
             f"the same step on {s['cloud_device']}: {s['cloud_flops'] / 1e9:.3g} GFLOP in "
             f"{s['cloud_step_s']:.3g} s, {s['cloud_energy_j']:.3g} J; the units step takes "
             f"{step['step_s'] / s['cloud_step_s']:.0f}x as long")
    return PlanView(f"plan for {recipe.name} ({UNITS}, offload={recipe.units.offload}: per device and step; the "
                    f"target trains on the server)", rows,
                    ("tier", "devices", "used", "units/step", "largest unit", "MB down", "MB up", "busy s"),
                    left=("tier", "largest unit"), width=140, notes=notes, per_round=False)
