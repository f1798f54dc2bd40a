"""What every method's plan view (``fedfusion.fusion.<method>.plan``, named by its registry entry's ``plan``) shares:
the table it returns, the recipe's target config and the server's own row. A view takes the recipe sections it
reads, by name (``fedfusion.config.methods.call``), and the data source."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import PretrainedConfig

from fedfusion.config.sections import DataSource, ModelConfig, PopulationConfig
from fedfusion.devices.catalog import population_catalog
from fedfusion.devices.memory import USABLE, mb, param_count, priced, training_memory_bytes, usable_bytes
from fedfusion.models.build import target_config, target_model_config


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


def recipe_target(model: ModelConfig, source: DataSource) -> PretrainedConfig:
    """The target's config; a facts recipe's vocabulary is its own word tokenizer's (unless the target is a
    pretrained model, which brings its tokenizer)."""
    if source.data.source == "facts" and not model.pretrained:
        from fedfusion.data.population import data_spec, data_tokenizer

        return target_config(model, data_tokenizer(data_spec(source)))
    return target_model_config(model)


def server_plan_row(population: PopulationConfig, target: PretrainedConfig, seq_len: int, server_device: str,
                    what: str, flops: float, batch: int, usable: float = USABLE) -> dict[str, Any]:
    """The server's own work per round, priced on ``server_device`` (of the population's catalog) as the ledger
    prices it (``server_energy_j``: its FLOPs, no transfers); memory is training ``target`` at the server's batch
    size and ``seq_len``."""
    device = population_catalog(population)[server_device]
    mem = training_memory_bytes(target, batch, seq_len)
    return {"tier": f"server ({server_device})", "trains": what, "params": param_count(target),
            "peak MB": mb(mem), "device MB": round(device.memory_gb * 1024),
            "fits": "yes" if mem <= usable_bytes(device, usable) else "NO", **priced(device, flops, 0, 0)}
