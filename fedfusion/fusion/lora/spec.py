"""LoRA's message specs: the frozen base every client loads and the modules it adapts (:class:`LoRABaseSpec`), the
bits its tier loads the base in (:class:`QuantizeSpec`) and the adapter it trains (:class:`AdapterSpec`), written by
:class:`~fedfusion.fusion.lora.method.LoRAMethod` and read by its client role (:mod:`fedfusion.clients.lora`). On the
wire floor though in the method's folder (it imports only ``wire`` and ``config``), so the client role, which may not
import ``fusion``, reads it; the registry entry names it (``Method.specs``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fedfusion.config.choices import LORA_DTYPES, LORA_METHODS, QUANTIZE_BITS
from fedfusion.wire.specs import CSV, Spec, SpecError, check_choice


@dataclass(frozen=True)
class LoRABaseSpec(Spec):
    """The frozen base every LoRA client loads and the modules it adapts (``lora.*``)."""

    base: str
    dtype: str
    target_modules: tuple[str, ...] = field(metadata=CSV)
    lora_dropout: float

    def __post_init__(self) -> None:
        check_choice(self, "dtype", LORA_DTYPES)
        if not self.target_modules:
            raise SpecError(f"message spec {self.key('target_modules')!r} is empty")


@dataclass(frozen=True)
class QuantizeSpec(Spec):
    """The bits a client's tier loads the frozen base in (0: unquantised)."""

    quantize: int

    def __post_init__(self) -> None:
        check_choice(self, "quantize", QUANTIZE_BITS)


@dataclass(frozen=True)
class AdapterSpec(Spec):
    """The adapter a LoRA client trains: its rank and alpha, and the server's aggregation method."""

    method: str
    rank: int
    alpha: float

    def __post_init__(self) -> None:
        check_choice(self, "method", LORA_METHODS)
