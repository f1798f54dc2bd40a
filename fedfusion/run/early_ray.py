"""Ray started while ``fedfusion run`` imports torch, transformers, Flower's apps and the run's modules.

Flower's simulation starts Ray (``ray.init``: its GCS, raylet and first workers, about 4 s here) only when
``run_simulation`` is called, after the run's seconds of imports; the client actors start after that. Ray's start
waits on its processes, the imports on this process's CPU, so the run does both at once: a thread imports the
modules while the main thread builds Flower's own Ray backend (``RayBackend.__init__`` calls ``ray.init`` with the
arguments the engine's backend would get), and the engine's backend, built later, finds Ray initialised and starts
no second one. Ray stays in the main thread because Linux ends a child whose parent *thread* exits (Ray gives its
GCS and raylet a parent-death signal), and because Ray sets its signal handling there
(:class:`~fedfusion.run.interrupt.RayKeepsOffSigterm` applies as it does under the engine). A start that fails
here is undone and left to the engine, which then fails as it always has (and
:class:`~fedfusion.run.interrupt.EngineWatch` reports it).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence
from typing import Any

# imported by the main thread, before the import thread starts: two threads importing Flower's modules at once can
# deadlock on its circular imports (``ray.init``'s own imports are Ray's and the standard library's)
from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend
from flwr.supercore.constant import DEFAULT_SIMULATION_CONFIG

from fedfusion.run.interrupt import RayKeepsOffSigterm, shutdown_ray


def as_engine_sees_it(backend_config: dict[str, Any]) -> dict[str, Any]:
    """The backend config with ``ray.init``'s arguments completed as Flower's ``run_simulation`` completes them (its
    default logging level and driver logging, unless given), so that a Ray started before the engine is the Ray
    the engine would have started."""
    init_args = {"logging_level": DEFAULT_SIMULATION_CONFIG.init_args_logging_level,
                 "log_to_driver": DEFAULT_SIMULATION_CONFIG.init_args_log_to_driver,
                 **backend_config.get("init_args", {})}
    return {**backend_config, "init_args": init_args}


class BackgroundImports:
    """Imports ``modules`` in a daemon thread; :meth:`wait` joins it. A module that fails to import there is
    imported again by the caller's own ``import`` statement, which raises its error in the main thread."""

    def __init__(self, modules: Sequence[str]) -> None:
        self._thread = threading.Thread(target=self._load, args=(tuple(modules),), name="fedfusion-imports",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def _load(modules: tuple[str, ...]) -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the main thread's import of the same module raises it
                return

    def wait(self) -> None:
        self._thread.join()


def start_ray(backend_config: dict[str, Any]) -> bool:
    """Initialise Ray as Flower's simulation engine would (main thread only); False, with nothing left started, if
    that fails: the engine then tries again and reports the failure itself."""
    try:
        with RayKeepsOffSigterm():  # Ray's SIGTERM and failure-signal handlers stay off this driver, as under CtrlC
            RayBackend(as_engine_sees_it(backend_config))
    except Exception:  # noqa: BLE001 - the engine's own start gives the user its error
        shutdown_ray()
        return False
    return True
