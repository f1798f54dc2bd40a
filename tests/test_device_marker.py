"""The rule for ``device`` tests (tests/conftest.py): skipped without ExecuTorch, but where CI sets
``FEDFUSION_REQUIRE_DEVICE=1`` a device test that skips, for any reason, fails, so none can pass CI unrun."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import pytest

from tests.conftest import REQUIRE_DEVICE

pytest_plugins = ["pytester"]

HAS_EXECUTORCH = find_spec("executorch") is not None  # else test_device_that_runs is skipped for want of it

TESTS = """
import pytest

@pytest.mark.device
def test_device_that_skips():
    pytest.skip("no phone here")

def test_other_that_skips():
    pytest.skip("not a device test")

@pytest.mark.device
def test_device_that_runs():
    pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    """A throwaway test directory with this suite's conftest and three tests."""
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text(encoding="utf-8"))
    pytester.makepyfile(TESTS)
    return pytester


def _outcomes(suite: pytest.Pytester) -> dict[str, int]:
    """passed, failed (a skip turned failure reads as an error in setup: counted here) and skipped."""
    found = suite.runpytest_inprocess("-p", "no:cacheprovider", "-W", "ignore::pytest.PytestUnknownMarkWarning").parseoutcomes()
    outcomes = {"passed": found.get("passed", 0), "failed": found.get("failed", 0) + found.get("errors", 0),
                "skipped": found.get("skipped", 0)}
    return {k: v for k, v in outcomes.items() if v}


def test_a_skipped_device_test_is_only_skipped_by_default(suite, monkeypatch):
    monkeypatch.delenv(REQUIRE_DEVICE, raising=False)
    assert _outcomes(suite) == ({"passed": 1, "skipped": 2} if HAS_EXECUTORCH else {"skipped": 3})


def test_a_skipped_device_test_fails_where_ci_requires_them(suite, monkeypatch):
    monkeypatch.setenv(REQUIRE_DEVICE, "1")
    assert _outcomes(suite) == ({"passed": 1, "failed": 1, "skipped": 1} if HAS_EXECUTORCH else {"failed": 2, "skipped": 1})
