"""Ctrl-C for ``fedfusion run``: one press (or one SIGTERM) stops the run at a safe point, cleans up Ray, and says
how to resume.

Flower's simulation gives the driver no stop: a KeyboardInterrupt in the main thread leaves the ServerApp
thread waiting for replies until the round deadline and Ray's actors running. Instead, the first SIGINT only
sets an event; the server's Grid (:class:`fedfusion.strategies.stop.StopGrid`) raises at its next call, the
run records ``status: interrupted``, the actors still training are killed so Flower's workers return, Ray
shuts down, and whatever process the run started and is still alive is terminated. A second SIGINT raises
KeyboardInterrupt as usual, for a run that does not stop. SIGTERM (a scheduler's stop) is taken the same way.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import psutil

from fedfusion.strategies.stop import StopRequest

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class CtrlC:
    """While active, the first SIGINT or SIGTERM sets :attr:`stop` and calls ``on_first`` with the signal; a later
    SIGINT (Ctrl-C again) raises KeyboardInterrupt, a later SIGTERM is ignored: ``timeout``, Slurm and systemd send
    SIGTERM to the process and then to its group (and ``fedfusion compare`` passes one on), so a run often gets two
    at once, which must not force it (a scheduler that wants it gone follows with SIGKILL)."""

    def __init__(self, on_first: Callable[[signal.Signals], None]) -> None:
        self.stop, self.on_first = StopRequest(), on_first
        self.previous: dict[signal.Signals, signal.Handlers | Callable | int | None] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.stop.is_set():
            if signum == signal.SIGTERM:
                return
            raise KeyboardInterrupt
        self.stop.set()
        self.on_first(signal.Signals(signum))

    def __enter__(self) -> CtrlC:
        self.ray_patch = RayKeepsOffSigterm().__enter__()  # first: a Ray it cannot patch leaves no handler of ours
        self.previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.ray_patch.__exit__(kind, exc, tb)
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class RayKeepsOffSigterm:
    """While active, the Ray driver this process starts leaves SIGTERM to :class:`CtrlC`.

    ``ray.init`` in the main thread (where Flower's simulation builds its Ray backend) replaces the SIGTERM handler
    with one that raises SystemExit there: the engine unwinds while the ServerApp thread waits for replies forever,
    and the process never exits. Ray's core worker then installs absl's failure-signal handler, which counts SIGTERM
    as a crash: it prints a stack and kills the driver outright, leaving no summary. Both are switched off for this
    process's driver only (two module attributes of Ray's, put back on exit; a test sends a run SIGTERM through
    Ray and fails if Ray changes either); Ray's worker processes keep their own handlers."""

    def __enter__(self) -> RayKeepsOffSigterm:
        self.saved: tuple[Any, ...] = ()
        try:
            import ray._private.ray_constants as constants
            import ray._private.utils as utils
        except ImportError:  # no Ray: nothing will touch the handlers
            return self
        # a Ray without either attribute fails here, before anything is changed (the SIGTERM test then fails too)
        self.saved = (utils, utils.set_sigterm_handler, constants, constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER)
        vars(utils)["set_sigterm_handler"] = _leave_sigterm_alone
        vars(constants)["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"] = True
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.saved:
            utils, set_handler, constants, disabled = self.saved
            vars(utils)["set_sigterm_handler"] = set_handler
            vars(constants)["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"] = disabled


def _leave_sigterm_alone(handler: Callable[[int, FrameType | None], Any]) -> None:
    """Stands in for Ray's ``set_sigterm_handler`` while a run's own handler is in place."""


class EngineWatch(logging.Handler):
    """Fails the run when Flower's simulation engine itself dies (Ray cannot start, the backend crashes).

    Flower then logs the error from its engine loop (``vce_api.run_api``) and waits for the ServerApp thread,
    which would go on waiting for replies that never come, round after round, up to each round's deadline. This
    handler, on Flower's logger, turns that record into ``stop.fail(reason)``: the server's Grid raises at its
    next poll, the run is recorded as failed with Flower's reason, and the command ends. A client's own
    exception is logged from the engine's worker, not its main loop, and stays an error reply."""

    def __init__(self, stop: StopRequest) -> None:
        super().__init__(logging.ERROR)
        self.stop = stop

    def emit(self, record: logging.LogRecord) -> None:
        path = Path(record.pathname)
        if record.funcName == "run_api" and path.name == "vce_api.py" and path.parent.name == "vce":
            self.stop.fail(f"Flower's simulation engine failed: {record.getMessage()}")


def silence_ray() -> None:
    """Stop Ray's driver from echoing its processes' output (the switch Ray's own debugger uses): a terminal's
    Ctrl-C also reaches Ray's agents, they die of it, and the raylet would report that at length."""
    ray_worker = sys.modules.get("ray._private.worker")
    if ray_worker is not None:
        vars(ray_worker)["_worker_logs_enabled"] = False  # a module global of Ray's, not a declared attribute


def shutdown_ray() -> None:
    """Disconnect this process from Ray if a run left it connected (and stop the instance it started).

    Flower's Ray backend calls ``ray.init`` when it is built and ``ray.shutdown`` only when it is terminated: an
    engine that fails in between (its client resources refused, for one) leaves this process "initialized" on a
    Ray instance that :func:`reap` then kills. A later run in the same process (a notebook, a test session) would
    reuse that dead instance, and Ray's driver exits the whole process when it cannot reach its GCS for 60 s."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def descendants() -> set[psutil.Process]:
    """Every live process this one started, directly or not."""
    return set(psutil.Process().children(recursive=True))


def _is_ray_worker(proc: psutil.Process) -> bool:
    """A Ray worker process (an actor, idle or mid-task, or one still starting), not one of Ray's own services.

    Ray retitles its workers ``ray::<Actor>`` / ``ray::IDLE`` and its agents ``ray::<Name>Agent``;
    before the retitling a worker is ``python .../default_worker.py``."""
    cmdline = proc.cmdline()
    title = cmdline[0] if cmdline else ""
    return (title.startswith("ray::") and not title.endswith("Agent")) or any(
        arg.endswith("default_worker.py") for arg in cmdline)


def kill_ray_workers() -> None:
    """SIGKILL this process's Ray workers (actors mid-task), so Flower's threads waiting on them return."""
    for proc in descendants():
        try:
            if _is_ray_worker(proc):
                proc.kill()
        except psutil.Error:  # gone already, or not ours to read
            continue


def reap(keep: set[psutil.Process], grace_s: float = 3.0) -> list[psutil.Process]:
    """Terminate the descendants not in ``keep``, SIGKILL those still alive after ``grace_s``; return them all."""
    procs = list(descendants() - keep)
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            continue
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(alive, timeout=grace_s)
    return procs


_reaping_on_flower_exit = False


def reap_on_flower_exit() -> None:
    """Have Flower's exit path terminate every process this one started (once per process).

    ``flwr stop`` ends a run's ``flwr-simulation`` process through Flower's graceful exit, which leaves Ray's
    agents orphaned: they ignore SIGTERM and linger for a minute or more. Reaping the descendants (SIGKILL
    after a short grace) from one of Flower's exit handlers ends them with the run. Elsewhere (``fedfusion
    run``, a deployed SuperLink) Flower's exit path is not taken and the handler never runs."""
    global _reaping_on_flower_exit
    if _reaping_on_flower_exit:
        return
    from flwr.supercore.exit import add_exit_handler  # Flower's own exit hook (what flwr-simulation runs on stop)

    def reap_children() -> None:
        reap(set(), grace_s=1.0)

    add_exit_handler(reap_children, run_before_force_exit=True)
    _reaping_on_flower_exit = True
