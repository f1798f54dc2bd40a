"""LoRA's plan: each tier's rank and base precision, its memory against an fp32 base, the largest rank that fits."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig

from fedfusion.config.sections import FusionConfig, PopulationConfig, PrivacyConfig, TrainConfig
from fedfusion.devices.catalog import population_catalog
from fedfusion.devices.energy import frozen_work_params, train_flops
from fedfusion.devices.memory import PLAN_COSTS, USABLE, estimate_memory, fit_lora_rank, mb, param_count, priced, usable_bytes
from fedfusion.fusion.lora.config import LoRAConfig
from fedfusion.fusion.lora.method import adapted_modules, secure_shapes
from fedfusion.fusion.plan import PlanView
from fedfusion.wire.quantize import encoded_bytes
from fedfusion.wire.secagg import MASKED_BYTES


def lora_plan_table(lora: LoRAConfig, fusion: FusionConfig, train: TrainConfig, population: PopulationConfig,
                    base_config: PretrainedConfig, usable: float = USABLE, secure: bool = False) -> list[dict[str, Any]]:
    """One row per tier for LoRA fusion: its rank and base precision, trainable parameters, estimated peak
    memory on its base and on an fp32 base, whether it fits, the largest rank that would fit, and one round's
    cost (:func:`priced`: the FLOPs of :func:`~fedfusion.devices.energy.frozen_work_params`, the adapter down in
    ``fusion.wire_dtype`` and up in ``fusion.wire_up``; with ``secure``, ``privacy.secure_aggregation``, up as the
    masked vector, :func:`secure_up_bytes`)."""
    catalog = population_catalog(population)
    batch, seq = train.batch_size, train.seq_len
    modules = list(lora.target_modules)
    compute = getattr(torch, lora.dtype).itemsize  # a quantised base computes (and keeps its other weights) in lora.dtype
    base_params, tokens = param_count(base_config), train.local_steps * batch * seq
    masked = secure_up_bytes(lora, population, base_config) if secure else None
    rows = []
    for tier in population.mix:
        device, rank, bits = catalog[tier], lora.ranks[tier], lora.quantize.get(tier, 0) or 32
        est = estimate_memory(base_config, batch, seq, lora_rank=rank, base_bits=bits, lora_modules=modules,
                              compute_bytes=compute)
        fp32 = estimate_memory(base_config, batch, seq, lora_rank=rank, base_bits=32, lora_modules=modules)
        best = fit_lora_rank(base_config, device, batch, seq, modules=modules, usable=usable, compute_bytes=compute)
        rows.append({
            "tier": tier, "rank": rank, "base": f"{bits}-bit", "trainable": est.trainable,
            "peak MB": mb(est.total), "fp32 base MB": mb(fp32.total), "device MB": round(device.memory_gb * 1024),
            "fits": "yes" if est.total <= usable_bytes(device, usable) else "NO",
            "max fit": f"r={best.rank} on {best.base_bits}-bit" if best else "nothing fits",
            **priced(device, train_flops(frozen_work_params(base_params, est.trainable), tokens),
                     encoded_bytes(fusion.wire_dtype, est.trainable),
                     encoded_bytes(fusion.wire_up, est.trainable) if masked is None else masked),
        })
    return rows


def secure_up_bytes(lora: LoRAConfig, population: PopulationConfig, base_config: PretrainedConfig) -> int:
    """A LoRA reply's bytes under secure aggregation, at most: :data:`MASKED_BYTES` for every coordinate of the padded
    change the method masks (:func:`~fedfusion.fusion.lora.method.secure_shapes`, the base's adapted modules read off
    a meta-device copy of it): exact for the dense methods, at its bound (the population's largest rank; a round
    masks its largest sampled rank) for the factor methods. The key and share messages are left out."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(base_config)
    shapes = secure_shapes(adapted_modules(model, list(lora.target_modules)), lora.method,
                           max(lora.ranks[tier] for tier in population.mix))
    return MASKED_BYTES * sum(rows * cols for rows, cols in shapes.values())


def lora_view(name: str, lora: LoRAConfig, fusion: FusionConfig, train: TrainConfig, population: PopulationConfig,
              privacy: PrivacyConfig) -> PlanView:
    """LoRA: per tier its rank and base precision, memory against an fp32 base, the largest rank that fits (under
    ``privacy.secure_aggregation``, the masked reply's cost)."""
    from transformers import AutoConfig

    from fedfusion.models.pretrained import resolve_base

    config = AutoConfig.from_pretrained(resolve_base(lora.base))
    return PlanView(f"plan for {name} (lora/{lora.method} on {lora.base}; memory estimated)",
                    lora_plan_table(lora, fusion, train, population, config, secure=privacy.secure_aggregation),
                    ("tier", "rank", "base", "trainable", "peak MB", "fp32 base MB", "device MB", "fits", "max fit",
                     *PLAN_COSTS), left=("tier", "base", "fits", "max fit"), width=190,
                    notes=(f"secure aggregation: each reply is the masked padded change of lora.method={lora.method}, "
                           "8 bytes a coordinate (the dense update of every adapted module, or both factors at the "
                           "largest rank); MB up priced at that bound",) if privacy.secure_aggregation else ())
