"""Distillation's plan: each tier's family model, then the server's distillation."""

from __future__ import annotations

from typing import Any, Sequence

from transformers import PretrainedConfig

from fedfusion.config.sections import DataSource, ModelConfig, PopulationConfig, TrainConfig
from fedfusion.devices.catalog import population_catalog
from fedfusion.devices.energy import train_flops
from fedfusion.devices.memory import PLAN_COSTS, USABLE, dims, mb, param_count, priced, training_memory_bytes, usable_bytes
from fedfusion.fusion.distill.config import DistillConfig
from fedfusion.fusion.plan import PlanView, recipe_target, server_plan_row


def _family_label(name: str, config: PretrainedConfig, kind: str) -> str:
    """e.g. ``small: gpt2 48x2, 4 heads, bpe 384``: the family, its width x layers, heads and tokenizer."""
    h, _, heads, _, _, layers = dims(config)
    vocab = "" if kind == "target" else f" {config.vocab_size}"
    return f"{name}: {config.model_type} {h}x{layers}, {heads} heads, {kind}{vocab}"


def distill_plan_table(distill: DistillConfig, train: TrainConfig, population: PopulationConfig, model: ModelConfig,
                       source: DataSource, usable: float = USABLE, tiers: Sequence[str] | None = None,
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

    catalog = population_catalog(population)
    d, batch, seq = distill, train.batch_size, train.seq_len
    text = transfer_text(d.transfer.source, data_spec(source), d.transfer.max_chars, d.transfer.path)
    families = distill_families(d, model.max_position, load_tokenizer(model.pretrained), text)
    tokens = train.local_steps * batch * seq
    rows, trained = [], {}
    for tier in tiers or population.mix:
        device, name = catalog[tier], d.tier_family[tier]
        config = families[name][0]
        params = trained[name] = param_count(config)
        mem = training_memory_bytes(config, batch, seq)
        rows.append({
            "tier": tier, "trains": _family_label(name, config, d.families[name].tokenizer),
            "params": params, "peak MB": mb(mem), "device MB": round(device.memory_gb * 1024),
            "fits": "yes" if mem <= usable_bytes(device, usable) else "NO",
            **priced(device, train_flops(params, tokens), 4 * params, 4 * params),
        })
    target_config = recipe_target(model, source)
    target = param_count(target_config)
    server_tokens, back_tokens = (steps * d.server_batch_size * seq for steps in (d.server_steps, d.back_steps))
    teachers = d.kd_weight > 0  # kd_weight 0 trains on the transfer text alone: no teacher runs
    flops = train_flops(target, server_tokens) + teachers * sum(forward_flops(p, server_tokens)
                                                                for p in trained.values())
    if d.back_distill:
        flops += sum(train_flops(p, back_tokens) + teachers * forward_flops(target, back_tokens)
                     for p in trained.values())
    what = f"distils {', '.join(sorted(trained))} in ({d.server_steps} steps)" + (
        f", and back ({d.back_steps} each)" if d.back_distill else "")
    return rows + [server_plan_row(population, target_config, seq, d.server_device, what, flops, d.server_batch_size,
                                   usable)]


def distill_view(name: str, distill: DistillConfig, train: TrainConfig, population: PopulationConfig,
                 model: ModelConfig, source: DataSource) -> PlanView:
    """Distillation: each tier's family model, then the server's distillation."""
    return PlanView(f"plan for {name} (distill/{distill.teacher}: each tier trains its family's "
                    "model, the server distils them into the target)",
                    distill_plan_table(distill, train, population, model, source),
                    ("tier", "trains", "params", "peak MB", "device MB", "fits", *PLAN_COSTS),
                    left=("tier", "trains", "fits"), width=240)


def mixed_rows(distill: DistillConfig, train: TrainConfig, population: PopulationConfig, model: ModelConfig,
               source: DataSource, usable: float,
               tiers: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Its part of a mixed federation's plan (the registry entry's ``mixed_plan``): the family rows of ``tiers``,
    the server's distillation."""
    *family_rows, server = distill_plan_table(distill, train, population, model, source, usable, tiers)
    return family_rows, server
