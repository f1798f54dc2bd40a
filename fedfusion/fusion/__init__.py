"""Fusion methods without Flower: one object per method (width slicing, LoRA, distillation, generative) behind
the :class:`~fedfusion.fusion.base.FusionMethod` protocol; the Flower strategy and the in-process driver run them.

Each method lives in its own module (``fedfusion.fusion.submodel.method``, ``.lora``, ``.distill``, ``.generative``),
imported where it is used.
"""

from fedfusion.fusion.base import (
    Client,
    ClientRound,
    Fold,
    FusionMethod,
    Payload,
    RoundReport,
    TierCost,
    Update,
)

__all__ = ["Client", "ClientRound", "Fold", "FusionMethod", "Payload", "RoundReport", "TierCost", "Update"]
