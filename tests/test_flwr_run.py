"""`flwr run .` runs the same ServerApp/ClientApp through Flower's own CLI and local SuperLink (from the unpacked FAB
that `flwr run .` bundles of the source tree, the ``flower_app`` fixture: the same FAB, built once)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.processes import still_running
from tests.ray_actors import ONE_ACTOR_CPUS

pytestmark = pytest.mark.slow  # Flower's runtime (Ray or SuperLink processes): minutes, not seconds

FLWR = os.path.join(os.path.dirname(sys.executable), "flwr")
OVERRIDES = (
    "rounds=1 population.num_clients=3 selection.clients_per_round=2 model.hidden_size=32 model.num_heads=2 "
    "model.num_kv_heads=2 model.intermediate_size=32 model.num_layers=1 train.local_steps=1 data.eval_chars=2000"
)


def _stop_local_superlink(flwr_home: Path) -> None:
    """`flwr run` leaves its auto-started SuperLink running; stop the one that uses our FLWR_HOME."""
    subprocess.run(["pkill", "-f", f"flower-superlink.*{flwr_home}"], check=False)


def _free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports nobody listens on right now (all held open while they are picked)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _flwr_env(flwr_home: Path) -> dict[str, str]:
    """The environment of a `flwr` command on its own FLWR_HOME, with this venv's executables first, and its own
    local SuperLink ports: on Flower's fixed defaults (39091, 39093) `flwr run` would join whatever local SuperLink
    already listens there (another test's under pytest -n, another checkout's suite on the same machine)."""
    http_api, control_api = _free_ports(2)
    return {**os.environ, "FLWR_HOME": str(flwr_home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http_api), "FLWR_LOCAL_CONTROL_API_PORT": str(control_api),
            "PATH": str(Path(FLWR).parent) + os.pathsep + os.environ.get("PATH", "")}


def _flwr_run_cmd(supernodes: int, overrides: str, out: Path) -> list[str]:
    # the rolling recipe's submodel nodes keep nothing between messages: one Ray actor (tests/ray_actors.py)
    return [FLWR, "run", ".", "--stream", "--federation-config",
            f"num-supernodes={supernodes} client-resources-num-cpus={ONE_ACTOR_CPUS}",
            "-c", f"recipe='rolling' overrides='{overrides}' out='{out}'"]


def _flwr_run(tmp_path: Path, app: Path, supernodes: int) -> tuple[subprocess.CompletedProcess, Path]:
    """`flwr run . --stream` in ``app`` of the tiny rolling recipe on a local federation of ``supernodes`` SuperNodes
    (its own FLWR_HOME, its SuperLink stopped afterwards); the finished process and the run directory it was given."""
    flwr_home, out = tmp_path / "flwr-home", tmp_path / "run"
    flwr_home.mkdir()
    try:
        return subprocess.run(_flwr_run_cmd(supernodes, OVERRIDES, out), cwd=app, env=_flwr_env(flwr_home),
                              capture_output=True, text=True, timeout=480), out
    finally:
        _stop_local_superlink(flwr_home)


@pytest.mark.skipif(shutil.which("pkill") is None, reason="needs pkill to stop the local SuperLink")
def test_flwr_run_writes_a_complete_run(tmp_path, flower_app):
    proc, out = _flwr_run(tmp_path, flower_app, supernodes=3)
    assert (out / "summary.json").is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1] and rows[1]["clients_ok"] == 2
    assert (out / "model" / "model.safetensors").is_file()


@pytest.mark.skipif(shutil.which("pkill") is None, reason="needs pkill to stop the local SuperLink")
def test_flwr_run_with_more_supernodes_than_clients_is_a_clear_error(tmp_path, flower_app):
    """(Fewer SuperNodes wait 30 s for more to connect first: that case is held by tests/test_federation_check.py.)"""
    proc, out = _flwr_run(tmp_path, flower_app, supernodes=4)
    said = proc.stdout + proc.stderr
    assert "the federation has 4 SuperNodes but population.num_clients is 3" in said, said[-3000:]
    assert not out.exists()  # refused before the run directory is made


@pytest.mark.skipif(shutil.which("pkill") is None, reason="needs pkill to stop the local SuperLink")
def test_flwr_stop_leaves_no_process_of_the_run_behind(tmp_path, flower_app):
    """`flwr stop` ends the run's flwr-simulation process; Ray's agents used to outlive it by a minute or more."""
    flwr_home, out = tmp_path / "flwr-home", tmp_path / "run"
    flwr_home.mkdir()
    env = _flwr_env(flwr_home)
    cli = subprocess.Popen(_flwr_run_cmd(3, OVERRIDES.replace("rounds=1", "rounds=200"), out), cwd=flower_app, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").is_file() or len((out / "metrics.jsonl").read_text().splitlines()) < 2:
            assert time.monotonic() < deadline and cli.poll() is None, "the run never finished a round"
            time.sleep(0.2)
        superlink = next(p for p in psutil.process_iter(["cmdline"])
                         if "flower-superlink" in " ".join(p.info["cmdline"] or [])
                         and str(flwr_home) in " ".join(p.info["cmdline"]))
        superexec = {c.pid for c in superlink.children() if "flower-superexec" in " ".join(c.cmdline())}
        run_procs = [p for p in superlink.children(recursive=True) if p.pid not in superexec]
        assert any("ray" in " ".join(p.cmdline()) for p in run_procs), [p.cmdline()[:1] for p in run_procs]
        listed = subprocess.run([FLWR, "ls", "--format", "json"], env=env, capture_output=True, text=True, check=True)
        run_id = json.loads(listed.stdout)["runs"][0]["run-id"]
        subprocess.run([FLWR, "stop", str(run_id)], env=env, capture_output=True, check=True, timeout=60)
        alive = still_running(run_procs, timeout_s=20)
        assert not alive, [" ".join(p.cmdline())[:80] for p in alive]
    finally:
        cli.kill()
        _stop_local_superlink(flwr_home)
