"""Generative distillation's message spec: what the server asks of a device's own model (:class:`GenerativeSpec`),
written by :class:`~fedfusion.fusion.generative.method.GenerativeMethod` and read by its client role
(:mod:`fedfusion.clients.generative`). It sits on the wire floor though in the method's folder (it imports only
``wire`` and ``config``), so the client role, which may not import ``fusion``, reads it; the registry entry names it
(``Method.specs``)."""

from __future__ import annotations

from dataclasses import dataclass

from fedfusion.fusion.generative.config import DEVICE_STATES
from fedfusion.wire.specs import Spec, SpecError, check_choice


@dataclass(frozen=True)
class GenerativeSpec(Spec):
    """A device's own model in generative distillation: its width, how many windows to sample at which
    temperature, how many likeliest tokens per sampled position to send with them (0: none), where the model lives
    between rounds (``device_state``: node | server) and, with node, whether the message carries none and the node
    trains the one it kept (``kept``)."""

    width: float
    samples: int
    temperature: float
    top_k: int
    device_state: str
    kept: bool

    def __post_init__(self) -> None:
        check_choice(self, "device_state", DEVICE_STATES)
        if self.kept and self.device_state != "node":
            raise SpecError(f"message spec {self.key('kept')!r}: only a node that keeps its model "
                            f"({self.key('device_state')}=node) can train a kept one")
