"""Typed message specs: the recipe's local-training and fault settings as a client's ConfigRecord carries them.

One place owns the key of every field, derived from the recipe's own dataclasses, so the server writes and every
client role reads the same keys: renaming a recipe field renames its key on both sides, and a spec that carries
some fault keys but not all is an error instead of silently injecting nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, fields
from typing import Any

from fedfusion.recipe import FaultConfig, TrainConfig

# how an error reply says that a phone behind a device gateway missed its deadline: the strategy records a dropout
DROPPED = "device dropped:"
FAULT_KEYS = {f.name: "fault-" + f.name.replace("_", "-") for f in fields(FaultConfig)}
TRAIN_KEYS = {f.name: f.name.replace("_", "-") for f in fields(TrainConfig)} | {"local_steps": "local-steps"}


def fault_spec(faults: FaultConfig) -> dict[str, float]:
    """The spec entries of the recipe's injected faults."""
    return {FAULT_KEYS[name]: float(value) for name, value in asdict(faults).items()}


def read_faults(spec: Mapping[str, Any]) -> FaultConfig:
    """The faults a spec asks for; a spec with no fault key injects none, one with only some is refused."""
    present = [key for key in FAULT_KEYS.values() if key in spec]
    if not present:
        return FaultConfig()
    missing = sorted(set(FAULT_KEYS.values()) - set(present))
    if missing:
        raise ValueError(f"message spec has fault keys {present} but not {missing}: server and client disagree")
    return FaultConfig(**{name: float(spec[key]) for name, key in FAULT_KEYS.items()})


def train_spec(train: TrainConfig) -> dict[str, Any]:
    """The spec entries of the recipe's local training settings."""
    return {TRAIN_KEYS[name]: value for name, value in asdict(train).items()}


def read_train(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of :func:`fedfusion.training.train_steps` from a spec (``seed`` is the message's own);
    a missing key raises KeyError naming it."""
    def get(name: str) -> Any:
        key = TRAIN_KEYS[name]
        if key not in spec:
            raise KeyError(f"message spec lacks {key!r} (recipe train.{name})")
        return spec[key]

    return dict(steps=int(get("local_steps")), lr=float(get("lr")), batch_size=int(get("batch_size")),
                weight_decay=float(get("weight_decay")), optimizer=str(get("optimizer")), seed=int(spec["seed"]))


# how a client replies: the uplink format (fedfusion.quantize.UPLINK) and error feedback on a quantised uplink
WIRE_KEYS = {"up": "wire-up", "error_feedback": "wire-error-feedback"}


def wire_spec(up: str, error_feedback: bool) -> dict[str, Any]:
    """The spec entries of the uplink's wire format (the downlink's format travels in the arrays themselves)."""
    return {WIRE_KEYS["up"]: up, WIRE_KEYS["error_feedback"]: bool(error_feedback)}


def read_wire(spec: Mapping[str, Any]) -> tuple[str, bool]:
    """(uplink format, error feedback) a spec asks for; a spec without them (an older server) gets float32."""
    return str(spec.get(WIRE_KEYS["up"], "float32")), bool(spec.get(WIRE_KEYS["error_feedback"], False))
