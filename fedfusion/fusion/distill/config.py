"""Distillation's recipe section (``distill.*``: the small families, which tier trains which, the teacher, the server's
distillation and the transfer set), composed into the recipe from here; on the config floor like every method's
section (no torch, nothing of fedfusion but ``config``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from fedfusion.config.choices import (
    AVERAGES,
    CONFIDENCES,
    DEFAULT_SERVER_DEVICE,
    FAMILY_MODEL_TYPES,
    FAMILY_TOKENIZERS,
    TEACHERS,
    TRANSFER_SOURCES,
)
from fedfusion.config.sections import DataConfig, RecipeError, positive


@dataclass
class FamilyConfig:
    """A small model family that some tiers train in distillation fusion."""

    model_type: str = "llama"  # llama | gpt2
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: Optional[int] = None  # llama: default num_heads
    intermediate_size: Optional[int] = None  # default 4 x hidden_size
    tokenizer: str = "target"  # target (the target's) | char | bpe (trained on the transfer text)
    bpe_vocab: int = 512

    def check(self, name: str) -> None:
        """``distill.families.<name>.*``: a known architecture and tokenizer, positive sizes."""
        key = f"distill.families.{name}"
        if self.model_type not in FAMILY_MODEL_TYPES:
            raise RecipeError(f"{key}.model_type: {self.model_type!r} is not one of {', '.join(FAMILY_MODEL_TYPES)}")
        if self.tokenizer not in FAMILY_TOKENIZERS:
            raise RecipeError(f"{key}.tokenizer: {self.tokenizer!r} is not one of {', '.join(FAMILY_TOKENIZERS)}")
        for size in ("hidden_size", "num_layers", "num_heads"):
            positive(f"{key}.{size}", getattr(self, size))
        if self.hidden_size % self.num_heads:
            raise RecipeError(f"{key}.num_heads: {self.num_heads} does not divide hidden_size {self.hidden_size}")
        if self.tokenizer == "bpe" and self.bpe_vocab < 260:
            raise RecipeError(f"{key}.bpe_vocab: must be >= 260 (bytes + specials), got {self.bpe_vocab}")


@dataclass
class TransferConfig:
    """The server's unlabeled transfer set, disjoint from every client's data."""

    source: str = "shakespeare"  # shakespeare: roles no client owns | text: a local file (e.g. the KJV)
    path: Optional[str] = None
    max_chars: int = 100000

    def check(self) -> None:
        """``distill.transfer.*``: a file where the source is one, a positive size."""
        if self.source == "text" and not self.path:
            raise RecipeError("distill.transfer.path: required when distill.transfer.source is 'text'")
        positive("distill.transfer.max_chars", self.max_chars)


@dataclass
class DistillConfig:
    """Distillation fusion (fusion.method=distill): small families per tier, distilled into the target."""

    # key -> allowed values
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"teacher": TEACHERS, "average": AVERAGES, "confidence": CONFIDENCES,
                                                   "transfer.source": TRANSFER_SOURCES}
    # the mappings a recipe states whole: given, they replace the default (fedfusion.config.recipe.WHOLE_MAPPINGS)
    WHOLE: ClassVar[tuple[str, ...]] = ("families", "tier_family")

    families: dict[str, FamilyConfig] = field(default_factory=lambda: {
        "tiny": FamilyConfig(), "small": FamilyConfig(hidden_size=48, model_type="gpt2", tokenizer="bpe",
                                                      bpe_vocab=384)})
    tier_family: dict[str, str] = field(default_factory=lambda: {"phone": "tiny", "laptop": "small",
                                                                  "desktop": "small"})
    teacher: str = "fedet"  # feddf (average) | fedet (confidence-weighted consensus + diversity)
    average: str = "logits"  # feddf: logits | probs
    confidence: str = "variance"  # fedet: variance | entropy | maxprob
    diversity_weight: float = 0.1  # fedet
    temperature: float = 1.0
    kd_weight: float = 0.1  # 1: pure distillation (FedDF); lower mixes in the LM loss on the transfer text
    server_steps: int = 100
    server_lr: float = 1e-3
    server_batch_size: int = 16
    back_distill: bool = True  # the target teaches each family back (FedMKT)
    back_steps: int = 10
    back_lr: float = 1e-3
    server_device: str = DEFAULT_SERVER_DEVICE  # the catalog tier that prices the server's distillation work
    transfer: TransferConfig = field(default_factory=TransferConfig)

    def check(self) -> None:
        """``distill.*`` where some tier distils: families named by tiers exist and are well formed, the server's
        steps and weights are in range, the transfer set is given."""
        for tier, family in self.tier_family.items():
            if family not in self.families:
                raise RecipeError(f"distill.tier_family.{tier}: unknown family {family!r}; "
                                  f"families: {', '.join(sorted(self.families))}")
        for name, f in self.families.items():
            f.check(name)
        for key in ("temperature", "server_steps", "server_lr", "server_batch_size", "back_steps", "back_lr"):
            positive(f"distill.{key}", getattr(self, key))
        if not 0 <= self.kd_weight <= 1:
            raise RecipeError(f"distill.kd_weight: must be in [0, 1], got {self.kd_weight}")
        if self.diversity_weight < 0:
            raise RecipeError(f"distill.diversity_weight: must be >= 0, got {self.diversity_weight}")
        self.transfer.check()


def check_across(distill: DistillConfig, data: DataConfig, tiers: list[str]) -> None:
    """Distillation's rules that read other sections: a family for every tier that distils, and with a user's dataset
    a transfer set from a file."""
    for tier in tiers:
        if tier not in distill.tier_family:
            raise RecipeError(f"distill.tier_family: no family for tier {tier!r} of population.mix")
    if data.source == "dataset" and distill.transfer.source == "shakespeare":
        raise RecipeError("distill.transfer.source: with data.source=dataset the transfer text is a file "
                          "(distill.transfer.source=text, distill.transfer.path=...)")
