"""LoRA's recipe section (``lora.*``: the frozen base, each tier's rank and base bits, the aggregation), composed into
the recipe from here; on the config floor like every method's section (no torch, nothing of fedfusion but
``config``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from fedfusion.config.choices import LORA_DTYPES, LORA_METHODS, LORA_SECURE_METHODS, QUANTIZE_BITS, SMOLLM2_BASE
from fedfusion.config.sections import (
    DataConfig,
    FusionConfig,
    ModelConfig,
    PrivacyConfig,
    RecipeError,
    TrainConfig,
    positive,
)


@dataclass
class LoRAConfig:
    """Heterogeneous-rank LoRA (fusion.method=lora): adapters of each tier's rank on one frozen base."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"method": LORA_METHODS, "dtype": LORA_DTYPES}  # key -> allowed values
    # the mappings a recipe states whole: given, they replace the default (fedfusion.config.recipe.WHOLE_MAPPINGS)
    WHOLE: ClassVar[tuple[str, ...]] = ("ranks", "quantize")

    base: str = SMOLLM2_BASE  # smollm2 (offline GGUF package) | a local model directory | a .gguf file | a hub id
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    ranks: dict[str, int] = field(default_factory=lambda: {"phone": 4, "laptop": 8, "desktop": 32})
    alpha: float = 16.0
    quantize: dict[str, int] = field(default_factory=lambda: {"phone": 4, "laptop": 8, "desktop": 0})  # base bits
    dtype: str = "float32"  # unquantised base: float32 | bfloat16 | float16
    dropout: float = 0.0
    method: str = "flexlora"  # fedavg (equal ranks) | zeropad | hetlora | flexlora | flora
    eval_pairs: int = 200  # held-out pairs the server scores the target on
    samples: int = 3  # generations shown in the report

    def check(self) -> None:
        """``lora.*`` with fusion.method=lora: positive ranks, known base bits, modules to adapt, a dropout < 1."""
        for tier, rank in self.ranks.items():
            positive(f"lora.ranks.{tier}", rank)
        for tier, bits in self.quantize.items():
            if bits not in QUANTIZE_BITS:
                raise RecipeError(f"lora.quantize.{tier}: must be 0 (none), 4 or 8 bits, got {bits}")
        if not self.target_modules:
            raise RecipeError("lora.target_modules: name at least one module (e.g. q_proj)")
        for key in ("alpha", "eval_pairs"):
            positive(f"lora.{key}", getattr(self, key))
        if not 0 <= self.dropout < 1:
            raise RecipeError(f"lora.dropout: must be in [0, 1), got {self.dropout}")


def check_across(lora: LoRAConfig, fusion: FusionConfig, data: DataConfig, model: ModelConfig, train: TrainConfig,
                 privacy: PrivacyConfig, tiers: list[str]) -> None:
    """LoRA's rules that read other sections: a rank for every tier, one rank for fedavg, facts tokenised by the base
    itself, AdamW, and under secure aggregation a method that folds one sum from the exact adapters it sent."""
    for tier in tiers:
        if tier not in lora.ranks:
            raise RecipeError(f"lora.ranks: no rank for tier {tier!r} of population.mix")
    if lora.method == "fedavg" and len({lora.ranks[t] for t in tiers}) > 1:
        raise RecipeError("lora.method: fedavg needs one rank for every tier; use zeropad, hetlora, flexlora or flora")
    if data.source == "facts" and model.pretrained != lora.base:
        raise RecipeError(f"model.pretrained: fusion.method=lora on data.source=facts tokenises the facts with "
                          f"model.pretrained, so it must name lora.base ({lora.base!r}), got {model.pretrained!r}")
    if train.optimizer != "adamw":
        raise RecipeError("train.optimizer: LoRA clients train with AdamW; only 'adamw' applies to fusion.method=lora")
    why = "privacy.secure_aggregation: the server folds one sum of masked updates, so"
    if privacy.secure_aggregation and lora.method not in LORA_SECURE_METHODS:
        raise RecipeError(f"{why} lora.method must be one of {', '.join(LORA_SECURE_METHODS)} (hetlora weighs each "
                          f"client by its own update's norm), got {lora.method!r}")
    if privacy.secure_aggregation and fusion.wire_dtype != "float32":
        raise RecipeError(f"{why} fusion.wire_dtype must be float32 with LoRA (the server adds back the exact adapter "
                          "it sent)")
