"""Units mode: the whole target trained through sub-matrix units on devices (see the API notes below)."""

from fedfusion.units.devices import UnitDevice, from_catalog
from fedfusion.units.engine import PhaseRecord, UnitEngine
from fedfusion.units.hooks import install
from fedfusion.units.messages import DeviceRuntime, Gemm, Operand, compute_units
from fedfusion.units.plan import CostModel, GemmShape, PhasePlan, Tile, plan_phase
from fedfusion.units.verify import Freivalds, Strikes

__all__ = ["CostModel", "DeviceRuntime", "Freivalds", "Gemm", "GemmShape", "Operand", "PhasePlan", "PhaseRecord", "Strikes", "Tile",
           "UnitDevice", "UnitEngine", "compute_units", "from_catalog", "install", "plan_phase"]
