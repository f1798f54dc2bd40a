"""Silence third-party messages that every run prints although nothing is wrong and nobody can act on them.

Each filter matches one known message exactly (its logger, or its warning category and text), so anything
else those libraries say still reaches the user:

- Flower's simulation engine stops each Ray actor at the end of a run by logging a WARNING
  ``Manually terminating ClientAppActor``: that is its normal shutdown.
- bitsandbytes (imported by peft, so by LoRA processes only) asks the Hugging Face hub, through the ``kernels``
  package (a transformers dependency), for an optional 4-bit kernel on CPUs with AVX-512 BF16 and logs ``Failed
  to load CPU gemm_4bit_forward ... pip install kernels`` when it gets none (offline: its publisher check cannot
  reach the hub); it then uses its own 4-bit kernel.
- importing bitsandbytes makes torch load its compiler, whose ``torch.utils.mkldnn`` still calls the
  deprecated ``torch.jit.script_method`` and warns about it.
- peft asks a model ``is_gradient_checkpointing``, which transformers 5 renamed and warns about (FutureWarning)
  in every LoRA client's first round.
"""

from __future__ import annotations

import logging
import warnings

# (logger name, start of the message) for each expected log record
EXPECTED_LOGS = (
    ("flwr", "Manually terminating ClientAppActor"),
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
)
JIT_DEPRECATION = r"`torch\.jit\.script_method` is deprecated"
CHECKPOINTING_RENAME = r"`is_gradient_checkpointing` is deprecated"


class _DropExpected(logging.Filter):
    """Drops the records of one logger whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def silence_expected_noise() -> None:
    """Install the filters in this process (idempotent); every process that imports the server or client app
    calls it, Ray actors included, before any of these libraries speaks."""
    for name, prefix in EXPECTED_LOGS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropExpected) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_DropExpected(prefix))
    warnings.filterwarnings("ignore", message=JIT_DEPRECATION, category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=CHECKPOINTING_RENAME, category=FutureWarning)
