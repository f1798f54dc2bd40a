"""Generative distillation's plan: each tier's own model (width slicing's rows), then the server's training on the
samples."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from transformers import PretrainedConfig

from fedfusion.config.sections import DataSource, FusionConfig, ModelConfig, PopulationConfig, TrainConfig
from fedfusion.devices.energy import train_flops
from fedfusion.devices.memory import USABLE, param_count
from fedfusion.fusion.generative.config import GenerativeConfig
from fedfusion.fusion.plan import PlanView, recipe_target, server_plan_row
from fedfusion.fusion.submodel.plan import slice_rows, slices_plan


def generative_view(name: str, generative: GenerativeConfig, fusion: FusionConfig, train: TrainConfig,
                    population: PopulationConfig, model: ModelConfig, source: DataSource) -> PlanView:
    """Generative distillation: each tier's own model (the static slice at its width), then the server's row."""
    target = recipe_target(model, source)
    view = slices_plan(name, fusion, train, population, target, ": each tier keeps its own model, the static slice "
                                                                "at its width; the server trains the target")
    server = generative_server_row(generative, train, population, target)
    top = generative.top_k
    extra = f", + seq_len x {top} x 6 bytes of top tokens per window (generative.top_k)" if top else ""
    samples = f"its samples (generative.sample_fraction x its windows x (seq_len + 1) x 8 bytes{extra})"
    if generative.device_state == "node":
        note = (f"generative.device_state=node: MB down is a device's first round only (afterwards its node keeps "
                f"its model and nothing goes down but the spec); every uplink is {samples} and no model, which the "
                "plan cannot know (MB up and transfer s/J above price the model instead)")
    else:
        note = f"a client's uplink also carries {samples}, which the plan cannot know"
    return replace(view, rows=[*view.rows, {**server, "width": None, "slice": server["trains"]}], notes=(note,))


def generative_server_row(generative: GenerativeConfig, train: TrainConfig, population: PopulationConfig,
                          target: PretrainedConfig, usable: float = USABLE) -> dict[str, Any]:
    """The server's row under generative distillation: it trains ``target`` on the clients' samples."""
    g = generative
    flops = train_flops(param_count(target), g.server_steps * g.server_batch * train.seq_len)
    return server_plan_row(population, target, train.seq_len, g.server_device,
                           f"learns the samples ({g.server_steps} steps)", flops, g.server_batch, usable)


def mixed_rows(generative: GenerativeConfig, fusion: FusionConfig, train: TrainConfig, population: PopulationConfig,
               model: ModelConfig, source: DataSource, usable: float,
               tiers: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Its part of a mixed federation's plan (the registry entry's ``mixed_plan``): each tier's own model, the
    server's training on the samples."""
    target = recipe_target(model, source)
    return (slice_rows(fusion, train, population, target, usable, tiers),
            generative_server_row(generative, train, population, target, usable))
