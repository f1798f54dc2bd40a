"""Distillation's message spec: the family model a device trains (:class:`FamilySpec`), written by
:class:`~fedfusion.fusion.distill.method.DistillMethod` and read by its client role (:mod:`fedfusion.clients.smallmodel`).
On the wire floor though in the method's folder, so the client role reads it; the registry entry names it
(``Method.specs``)."""

from __future__ import annotations

from dataclasses import dataclass

from fedfusion.wire.specs import Spec


@dataclass(frozen=True)
class FamilySpec(Spec):
    """A distillation family model (role smallmodel): its name and its tokenizer (``tokenizers`` JSON; empty: the
    target's)."""

    family: str
    tokenizer_json: str
