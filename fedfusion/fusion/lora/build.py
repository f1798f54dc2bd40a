"""Heterogeneous-rank LoRA from its recipe sections (the registry entry's ``build``) and the spec its clients
share."""

from __future__ import annotations

from fedfusion.config.sections import FusionConfig
from fedfusion.fusion.base import BuildTarget
from fedfusion.fusion.lora.config import LoRAConfig
from fedfusion.fusion.lora.method import LoRAMethod, adapted_modules
from fedfusion.fusion.lora.spec import LoRABaseSpec
from fedfusion.fusion.rounds import fusion_wire


def client_spec(lora: LoRAConfig) -> LoRABaseSpec:
    """What every LoRA client needs to load the same frozen base and adapt the same modules."""
    return LoRABaseSpec(lora.base, lora.dtype, tuple(lora.target_modules), lora.dropout)


def build(lora: LoRAConfig, fusion: FusionConfig, target: BuildTarget, tiers: list[str]) -> LoRAMethod:
    """Heterogeneous-rank LoRA for ``tiers`` on the target's frozen base; clients load the same base themselves."""
    return LoRAMethod(
        modules=adapted_modules(target.model, list(lora.target_modules)),
        ranks={t: lora.ranks[t] for t in tiers}, alphas={t: lora.alpha for t in tiers},
        quantize={t: lora.quantize.get(t, 0) for t in tiers}, method=lora.method, base_params=target.params,
        base=client_spec(lora), wire=fusion_wire(fusion))
