"""``fedfusion run`` starts Ray while its modules import (fedfusion.run.early_ray): the Ray it starts must be the one
Flower's engine would start, a failed start must leave nothing for the engine to find, and a failed import must
still raise in the main thread."""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest
from flwr.serverapp import ServerApp

import fedfusion.run.early_ray as early_ray
from fedfusion.cli import backend_config
from fedfusion.config.recipe import load_recipe
from fedfusion.run.early_ray import BackgroundImports, as_engine_sees_it, start_ray


@pytest.mark.parametrize("overrides", [[], ["engine.ray_address=10.0.0.5:6379"]])
def test_the_early_start_gets_the_backend_config_flowers_simulation_passes_its_engine(monkeypatch, overrides):
    """run_simulation completes the backend config (Ray's logging level, driver logging) before its engine builds
    the Ray backend: the early start must complete it the same way, a recipe's own init_args kept."""
    sim = importlib.import_module("flwr.simulation.run_simulation")  # the module: the package's name is its function
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(sim, "_main_loop", lambda *args: seen.append(json.loads(args[2])))
    config = backend_config(load_recipe("quickstart", overrides))
    sim.run_simulation(server_app=ServerApp(), client_app=None, num_supernodes=1,  # type: ignore[arg-type]
                       backend_config=json.loads(json.dumps(config)))
    engine = seen[0]
    assert as_engine_sees_it(config)["init_args"] == engine["init_args"]
    assert as_engine_sees_it(config)["client_resources"] == engine["client_resources"]
    if overrides:
        assert engine["init_args"]["address"] == "10.0.0.5:6379"


def test_a_failed_start_returns_false_and_leaves_ray_down(monkeypatch):
    """A Ray backend that raises (here before Ray starts) is left to the engine, which then reports it itself."""
    import ray

    def refuse(config: dict[str, Any]) -> None:
        raise ValueError("client resources refused")

    monkeypatch.setattr(early_ray, "RayBackend", refuse)
    assert start_ray({"client_resources": {"num_cpus": 1}}) is False
    assert not ray.is_initialized()


def test_a_module_that_fails_in_the_import_thread_raises_in_the_main_thread():
    imports = BackgroundImports(["json", "fedfusion_no_such_module", "csv"])
    imports.wait()  # returns: the thread stops at the failure, quietly
    with pytest.raises(ModuleNotFoundError, match="fedfusion_no_such_module"):
        __import__("fedfusion_no_such_module")


def test_the_import_thread_imports_what_it_is_given():
    import sys

    sys.modules.pop("colorsys", None)  # a small standard module nothing else here needs
    BackgroundImports(["colorsys"]).wait()
    assert "colorsys" in sys.modules


@pytest.mark.slow  # starts Ray
def test_the_early_start_initialises_ray_so_the_engines_backend_starts_none(monkeypatch):
    import ray
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    config = backend_config(load_recipe("quickstart"))
    try:
        assert start_ray(config) is True and ray.is_initialized()

        def second_init(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("the engine's backend started a second Ray")

        monkeypatch.setattr(ray, "init", second_init)
        RayBackend(as_engine_sees_it(config))  # what the engine builds inside run_simulation
    finally:
        monkeypatch.undo()
        ray.shutdown()
