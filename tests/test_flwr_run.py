"""`flwr run .` runs the same ServerApp/ClientApp through Flower's own CLI and local SuperLink."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # Flower's runtime (Ray or SuperLink processes): minutes, not seconds

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = (
    "rounds=1 population.num_clients=3 selection.clients_per_round=2 model.hidden_size=32 model.num_heads=2 "
    "model.num_kv_heads=2 model.intermediate_size=32 model.num_layers=1 train.local_steps=1 data.eval_chars=2000"
)


def _stop_local_superlink(flwr_home: Path) -> None:
    """`flwr run` leaves its auto-started SuperLink running; stop the one that uses our FLWR_HOME."""
    subprocess.run(["pkill", "-f", f"flower-superlink.*{flwr_home}"], check=False)


def _flwr_run(tmp_path: Path, supernodes: int) -> tuple[subprocess.CompletedProcess, Path]:
    """`flwr run . --stream` of the tiny quickstart on a local federation of ``supernodes`` SuperNodes (its own
    FLWR_HOME, its SuperLink stopped afterwards); the finished process and the run directory it was given."""
    flwr_home, out = tmp_path / "flwr-home", tmp_path / "run"
    flwr_home.mkdir()
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "FLWR_HOME": str(flwr_home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    cmd = [os.path.join(bin_dir, "flwr"), "run", ".", "--stream",
           "--federation-config", f"num-supernodes={supernodes} client-resources-num-cpus=1",
           "-c", f"recipe='quickstart' overrides='{OVERRIDES}' out='{out}'"]
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=480), out
    finally:
        _stop_local_superlink(flwr_home)


@pytest.mark.skipif(shutil.which("pkill") is None, reason="needs pkill to stop the local SuperLink")
def test_flwr_run_writes_a_complete_run(tmp_path):
    proc, out = _flwr_run(tmp_path, supernodes=3)
    assert (out / "summary.json").is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1] and rows[1]["clients_ok"] == 2
    assert (out / "model" / "model.safetensors").is_file()


@pytest.mark.skipif(shutil.which("pkill") is None, reason="needs pkill to stop the local SuperLink")
def test_flwr_run_with_more_supernodes_than_clients_is_a_clear_error(tmp_path):
    """(Fewer SuperNodes wait 30 s for more to connect first: that case is held by tests/test_federation_check.py.)"""
    proc, out = _flwr_run(tmp_path, supernodes=4)
    said = proc.stdout + proc.stderr
    assert "the federation has 4 SuperNodes but population.num_clients is 3" in said, said[-3000:]
    assert not out.exists()  # refused before the run directory is made
