"""`engine.ray_address`: a recipe runs on an existing multi-node Ray cluster, here a head and a worker started on
loopback as separate processes (`ray start`), each with one CPU, so the two client actors land one on each node."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from fedfusion.cli import backend_config
from fedfusion.config.recipe import load_recipe
from fedfusion.config.sections import RecipeError
from fedfusion.deploy import _wait_port

RAY = str(Path(sys.executable).parent / "ray")
TINY = [
    "rounds=1", "population.num_clients=4", "selection.clients_per_round=4", "model.hidden_size=32",
    "model.num_heads=4", "model.num_kv_heads=2", "model.intermediate_size=64", "model.num_layers=1",
    "train.local_steps=2", "train.batch_size=4", "train.seq_len=32", "data.eval_chars=3000",
    "output.save_model=false", "engine.cpus_per_client=1.0",
]


def test_a_ray_address_joins_that_cluster_and_none_starts_a_private_one():
    assert "init_args" not in backend_config(load_recipe("quickstart"))
    joined = backend_config(load_recipe("quickstart", ["engine.ray_address=10.0.0.5:6379"]))
    assert joined["init_args"] == {"address": "10.0.0.5:6379"}
    assert joined["client_resources"]["num_cpus"] == 1.0
    assert backend_config(load_recipe("quickstart", ["engine.ray_address=auto"]))["init_args"]["address"] == "auto"


@pytest.mark.parametrize("bad", ["ray://10.0.0.5:10001", "10.0.0.5", "head:port", "head:70000"])
def test_a_bad_ray_address_is_refused_naming_the_key(bad):
    with pytest.raises(RecipeError, match="engine.ray_address"):
        load_recipe("quickstart", [f"engine.ray_address={bad}"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ours(temp_dir: str) -> list[psutil.Process]:
    """Every live process of this test's cluster: Ray names its session directory (under ``temp_dir``) in each
    one's command line, and no other Ray instance on the machine uses that directory."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in arg for arg in proc.info["cmdline"] or ()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _stop(starters: list[subprocess.Popen], temp_dir: str) -> list[psutil.Process]:
    """Stop the cluster: SIGTERM to each blocking `ray start` (it stops the processes it started), worker first;
    returns whatever of the cluster is still alive after that (then killed, so nothing is left either way).
    Not `ray stop`: it stops every Ray instance of the user, and other runs may share this machine."""
    for proc in reversed(starters):
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    deadline = time.monotonic() + 30
    while _ours(temp_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _ours(temp_dir)
    for proc in left:
        proc.kill()
    return left


def _wait_for_nodes(address: str, count: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = subprocess.run([RAY, "status", "--address", address], capture_output=True, text=True)
        if status.stdout.count("node_") >= count:
            return
        time.sleep(2)
    raise TimeoutError(f"the Ray cluster at {address} did not reach {count} nodes: {status.stdout}{status.stderr}")


def _actor_nodes(address: str) -> dict[str, int]:
    """Ray node id -> how many of Flower's client actors ran there (dead ones included), from the cluster's own
    actor table (Ray's developer API: the public state API needs the dashboard, which ray without [default] lacks)."""
    code = ("import json, ray, ray._private.state as state\n"
            f"ray.init(address={address!r}, logging_level='ERROR')\n"
            "nodes = {}\n"
            "for a in state.actors().values():\n"
            "    if a['ActorClassName'] == 'ClientAppActor':\n"
            "        nodes[a['Address']['NodeID']] = nodes.get(a['Address']['NodeID'], 0) + 1\n"
            "print(json.dumps(nodes))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a two-node Ray cluster and a run on it: minutes on a loaded 2-core machine
@pytest.mark.skipif(not Path(RAY).exists(), reason="needs the ray command beside this Python")
def test_a_recipe_runs_spread_over_a_two_node_ray_cluster_and_the_cluster_stops_clean(tmp_path):
    temp_dir = tempfile.mkdtemp(prefix="ffray", dir="/tmp")  # short: Ray's socket paths must fit 107 characters
    address = f"127.0.0.1:{_free_port()}"
    common = ["--block", "--num-cpus=1", "--disable-usage-stats", "--node-ip-address=127.0.0.1"]
    starters = []
    try:
        starters.append(subprocess.Popen(
            [RAY, "start", "--head", f"--port={address.rsplit(':', 1)[1]}", f"--temp-dir={temp_dir}",
             "--include-dashboard=false", *common],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        # the head's GCS accepts connections: all a worker's `ray start --address` needs to join (a socket probe, not
        # `ray status`, which takes 5-15 s a call on a loaded 2-core machine); Ray's logs are under temp_dir
        _wait_port(int(address.rsplit(":", 1)[1]), starters[0], Path(temp_dir), 240)
        starters.append(subprocess.Popen([RAY, "start", f"--address={address}", *common],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait_for_nodes(address, 2)
        out = tmp_path / "run"
        run = subprocess.run(
            [sys.executable, "-m", "fedfusion", "run", "rolling", *TINY, f"engine.ray_address={address}",
             "--out", str(out)], capture_output=True, text=True, timeout=600, env=os.environ.copy())
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert f"on the Ray cluster at {address}" in run.stdout
        rows = [json.loads(line) for line in (out / "clients.jsonl").read_text().splitlines()]
        assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
        nodes = _actor_nodes(address)
        assert len(nodes) == 2, nodes  # one client actor per one-CPU node: the recipe ran on both
    finally:
        left = _stop(starters, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not left, [p.pid for p in left]
