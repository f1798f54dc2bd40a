"""Generative distillation's recipe section (``generative.*``): its fields, their checks, and what
:class:`~fedfusion.fusion.generative.method.GenerativeMethod` is built with. The recipe composes it from here
(:class:`fedfusion.config.recipe.Recipe`), so it stays on the config floor: it imports nothing of fedfusion but
``config`` and no torch, and a recipe still loads without the implementation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfusion.config.choices import DEFAULT_SERVER_DEVICE
from fedfusion.config.sections import RecipeError, positive

# device_state: where a device's own model lives between rounds (its node's Flower context.state | the server, which
# sends it down and gets it back every round)
DEVICE_STATES = ("node", "server")


@dataclass
class GenerativeConfig:
    """Generative distillation (fusion.method=generative): each tier keeps its own model (the static slice of
    the target at its fusion.widths), the target learns from the text those models write."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"device_state": DEVICE_STATES}  # key -> allowed values

    sample_fraction: float = 0.5  # windows a sampled client writes per window of its own data
    temperature: float = 1.0
    server_steps: int = 30  # target training steps per round on every client's latest samples
    server_lr: float = 3e-3
    server_batch: int = 64
    server_device: str = DEFAULT_SERVER_DEVICE  # the catalog tier that prices the server's training
    # > 0: each sampled position also carries its k likeliest tokens and log-probs (the target fits that teacher
    # distribution instead of the one sampled token); 0: token ids only
    top_k: int = 0
    # node: each device keeps its own model in its node's Flower context.state (a round's messages carry no model
    # once a device has one); server: the server holds every device's model and sends it both ways every round
    device_state: str = "node"

    def check(self) -> None:
        """``generative.*`` where some tier trains generatively: positive sampling and server settings, a known
        ``device_state`` (a recipe's is checked with every choice first; a method built without a recipe is
        checked here)."""
        for name in ("sample_fraction", "temperature", "server_lr"):
            positive(f"generative.{name}", getattr(self, name))
        for name in ("server_steps", "server_batch"):
            if getattr(self, name) < 1:
                raise RecipeError(f"generative.{name}: must be >= 1, got {getattr(self, name)}")
        if self.top_k < 0:
            raise RecipeError(f"generative.top_k: must be >= 0 (0: the samples' token ids only), got {self.top_k}")
        if self.device_state not in DEVICE_STATES:
            raise RecipeError(f"generative.device_state: {self.device_state!r} is not one of {', '.join(DEVICE_STATES)}")
