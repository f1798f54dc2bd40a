"""Flower server strategies (installed as ``fedfusion.strategies``)."""

from fedfusion.strategies.submodel import SubModelFusion

__all__ = ["SubModelFusion"]
