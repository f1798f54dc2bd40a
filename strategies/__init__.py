"""Flower server strategies (installed as ``fedfusion.strategies``)."""

from fedfusion.strategies.distillation import DistillationFusion
from fedfusion.strategies.generative import GenerativeFusion
from fedfusion.strategies.lora import LoRAFusion
from fedfusion.strategies.submodel import SubModelFusion

__all__ = ["DistillationFusion", "GenerativeFusion", "LoRAFusion", "SubModelFusion"]
