"""Expected third-party noise is silenced by exact filters, and only LoRA processes import peft/bitsandbytes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from fedfusion.run.quiet import EXPECTED_LOGS, silence_expected_noise

ROOT = Path(__file__).parents[1]


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("name,prefix", EXPECTED_LOGS)
def test_each_expected_message_is_dropped_and_the_rest_of_its_logger_is_not(name, prefix):
    silence_expected_noise()
    silence_expected_noise()  # twice: still one filter
    logger, seen = logging.getLogger(name), _Collect()
    logger.addHandler(seen)
    try:
        logger.warning("%s (and the rest of the line)", prefix)
        logger.warning("something else went wrong: %s", prefix)
    finally:
        logger.removeHandler(seen)
    assert seen.messages == [f"something else went wrong: {prefix}"]
    assert sum(f.__class__.__name__ == "_DropExpected" for f in logger.filters) == sum(
        n == name for n, _ in EXPECTED_LOGS)


def test_the_torch_jit_deprecation_is_ignored_and_other_deprecations_are_not():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        silence_expected_noise()
        warnings.warn("`torch.jit.script_method` is deprecated. Please switch to `torch.compile`", DeprecationWarning,
                      stacklevel=1)
        warnings.warn("`torch.jit.trace` is deprecated", DeprecationWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["`torch.jit.trace` is deprecated"]


def test_the_gradient_checkpointing_rename_is_ignored_and_other_future_warnings_are_not():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        silence_expected_noise()
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6. Use "
                      "`is_activation_checkpointing` instead.", FutureWarning, stacklevel=1)
        warnings.warn("`use_cache` is deprecated", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["`use_cache` is deprecated"]


@pytest.mark.slow  # a fresh Python process per case: seconds each
def test_only_lora_imports_peft_and_bitsandbytes():
    """A server and the sub-model, small-model and generative client roles load neither (LoRA clients do)."""
    code = ("import sys, fedfusion.server_app, fedfusion.run.federation, fedfusion.client_app, fedfusion.strategies as s; "
            "import fedfusion.clients.submodel, fedfusion.clients.smallmodel, fedfusion.clients.generative; "
            "s.FusionStrategy, fedfusion.run.federation.build_strategy; from fedfusion.fusion.lora.method import LoRAMethod; "
            "print(sorted(m for m in ('peft', 'bitsandbytes') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_strategies_resolve_lazily_by_name():
    import fedfusion.strategies as strategies
    from fedfusion.strategies.fusion import FusionStrategy

    assert strategies.FusionStrategy is FusionStrategy
    with pytest.raises(AttributeError, match="NoSuchFusion"):
        strategies.NoSuchFusion  # noqa: B018
