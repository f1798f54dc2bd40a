"""A phone in a real Flower deployment: SuperLink with TLS and node auth, one ordinary SuperNode and one that serves
phones through a device gateway, 2 rounds of the rolling recipe. Round 1: a reference device trains through ExecuTorch.
Round 2: a second device takes the task and is killed; the node's reply is a dropout and the round completes."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from fedfusion.analysis.report import read_jsonl
from fedfusion.deploy import LocalFederation, make_deploy_files
from fedfusion.phone.gateway import Gateway, GatewayServer, Tokens, write_tokens
from tests.test_device import _take_and_vanish

pytestmark = [pytest.mark.slow, pytest.mark.device]  # SuperLink and SuperNode processes plus an ExecuTorch export: minutes

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = [
    "rounds=2", "population.num_clients=2", "selection.clients_per_round=2", "model.num_layers=1",
    "train.local_steps=2", "train.batch_size=4", "train.seq_len=16", "data.eval_chars=2000",
]


def test_a_gateway_node_trains_through_a_reference_device(tmp_path, monkeypatch):
    from fedfusion.phone.reference import ReferenceDevice

    monkeypatch.chdir(ROOT)
    tokens = tmp_path / "tokens.json"
    (tmp_path / "node.secret").write_text(write_tokens(tokens, {"tok-a": "phone-a", "tok-b": "phone-b"}))
    server = GatewayServer(("127.0.0.1", 0), Gateway(Tokens(tokens), tmp_path / "programs"))
    (tmp_path / "programs").mkdir()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    device = ReferenceDevice(server.url, "tok-a")
    trained: list[int] = []

    def devices() -> None:
        trained.append(device.serve(tasks=1, poll_s=0.2, echo=lambda s: None))
        _take_and_vanish(server.url, "tok-b")  # the second device is killed once it has the task

    worker = threading.Thread(target=devices, daemon=True)
    worker.start()
    out = tmp_path / "run"
    files = make_deploy_files(tmp_path / "certs", ["127.0.0.1", "localhost"], 2)
    fed = LocalFederation(tmp_path / "deploy", files)
    try:
        fed.start_superlink()
        for i in range(2):
            fed.register(files.node_keys[i], f"node{i}")
        fed.start_supernode("node0", files.node_keys[0], 'partition-id=0 num-partitions=2 device="phone"')
        fed.start_supernode("node1", files.node_keys[1],
                            f'partition-id=1 num-partitions=2 device="phone" gateway="{server.url}" '
                            f'gateway-secret-file="{tmp_path / "node.secret"}" gateway-deadline-s=60')
        config = f'recipe="rolling" overrides="{" ".join(OVERRIDES)}" out="{out}"'
        proc = fed.run_app(ROOT, config, timeout=1800)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:] + fed.log("node1")[-4000:]
    finally:
        fed.stop()
        server.shutdown()
        server.server_close()
    worker.join(timeout=60)
    assert trained == [1]
    rows = {(r["round"], r["partition"]): r for r in read_jsonl(out / "clients.jsonl")}
    assert {k: r["status"] for k, r in rows.items()} == {(1, 0): "ok", (1, 1): "ok", (2, 0): "ok", (2, 1): "dropped"}
    assert "phone-b" in rows[2, 1]["error"] and rows[2, 1]["wasted"]
    metrics = read_jsonl(out / "metrics.jsonl")
    assert metrics[-1]["eval_loss"] < metrics[0]["eval_loss"]  # the target changed, for the better
    assert json.loads((out / "summary.json").read_text())["status"] == "ok"


def test_two_phones_fine_tune_lora_adapters_through_gateway_nodes(tmp_path, monkeypatch):
    """LoRA fusion in a real deployment: SuperLink with TLS and node auth, two SuperNodes that serve phones through
    one gateway, two reference devices, 2 rounds on a tiny local base whose phone tier holds it in 4 bits. Every
    client row is ok with the phone's rank; each device loads the program and its frozen base once."""
    from tests.test_lora_client import save_tiny_base

    monkeypatch.chdir(ROOT)
    base = save_tiny_base(tmp_path / "base")
    overrides = ["rounds=2", "population.num_clients=2", "selection.clients_per_round=2", "train.local_steps=2",
                 "train.batch_size=4", "train.seq_len=96", "fusion.method=lora", "data.source=chatterbot",
                 f"lora.base={base}", "lora.eval_pairs=8", "lora.samples=1"]
    out, devices, fetched = _two_phones(tmp_path, "rolling", overrides, deadline_s=300)
    rows = {(r["round"], r["partition"]): r for r in read_jsonl(out / "clients.jsonl")}
    assert {k: r["status"] for k, r in rows.items()} == {(1, 0): "ok", (1, 1): "ok", (2, 0): "ok", (2, 1): "ok"}
    assert {r["rank"] for r in rows.values()} == {4}
    # every row came from a phone: its compute is priced at the seconds the phone measured, not the catalog's speed
    assert all(r["device_s"] is not None and r["compute_s"] == r["device_s"] == r["train_s"] for r in rows.values())
    trained = [d for d in devices if d.runners]
    assert all(len(d.runners) == 1 for d in trained) and fetched.count("weights.ptd") == len(trained)
    assert json.loads((out / "summary.json").read_text())["status"] == "ok"


def test_two_phones_train_the_quickstart_before_and_after_growth_through_gateway_nodes(tmp_path, monkeypatch):
    """The default recipe's two phases on phones in a real deployment: SuperLink with TLS and node auth, two
    SuperNodes that serve phones through one gateway, two reference devices. Round 1 trains the small model (a slice
    program), round 2, after growth, a core window drawn outside the core on the frozen int8 target (a window
    program, its frozen target and positions the round's inputs). Every client row is ok, priced at the phone's own
    seconds; round 2's rows trained the whole target's forward; each device ran both programs and fetched round 2's
    frozen target (one hash for both tasks) at most once."""
    monkeypatch.chdir(ROOT)
    overrides = [*OVERRIDES, "fusion.grow_round=1", "fusion.window_outside_core=true"]
    out, devices, _ = _two_phones(tmp_path, "quickstart", overrides, deadline_s=600)
    assert len({program for d in devices for program in d.runners}) == 2  # the small model's program and the window's
    # round 2's two window tasks carry the same frozen target: each device that took one fetched it once, by one hash
    assert 1 <= sum(len(d.fetched) for d in devices) <= 2 and len({h for d in devices for h in d.fetched}) == 1
    rows = {(r["round"], r["partition"]): r for r in read_jsonl(out / "clients.jsonl")}
    assert {k: r["status"] for k, r in rows.items()} == {(1, 0): "ok", (1, 1): "ok", (2, 0): "ok", (2, 1): "ok"}
    assert all(r["device_s"] is not None and r["compute_s"] == r["device_s"] == r["train_s"] for r in rows.values())
    assert {rows[1, p]["forward"] for p in (0, 1)} != {rows[2, p]["forward"] for p in (0, 1)}  # slice, then window
    manifests = [json.loads(p.read_text()) for p in (tmp_path / "programs").glob("*.json")]
    assert sorted("window" in m for m in manifests) == [False, True]  # the small model's program and the window's
    metrics = read_jsonl(out / "metrics.jsonl")
    assert all(m["clients_ok"] == 2 for m in metrics[1:]) and json.loads((out / "summary.json").read_text())["status"] == "ok"


def _two_phones(tmp_path: Path, recipe: str, overrides: list[str], deadline_s: float):
    """Run ``recipe`` in a real deployment (SuperLink with TLS and node auth) whose two SuperNodes serve phones
    through one gateway, two reference devices polling it; returns (the run directory, the devices, the program
    files they fetched)."""
    from fedfusion.phone.reference import ReferenceDevice

    tokens = tmp_path / "tokens.json"
    (tmp_path / "node.secret").write_text(write_tokens(tokens, {"tok-a": "phone-a", "tok-b": "phone-b"}))
    gateway = Gateway(Tokens(tokens), tmp_path / "programs")
    (tmp_path / "programs").mkdir()
    fetched: list[str] = []
    serve_file = gateway.program_file
    gateway.program_file = lambda program, name: fetched.append(name) or serve_file(program, name)  # type: ignore[method-assign]
    server = GatewayServer(("127.0.0.1", 0), gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    devices = [ReferenceDevice(server.url, token) for token in ("tok-a", "tok-b")]
    for device in devices:  # they poll until the test ends
        threading.Thread(target=device.serve, kwargs={"poll_s": 0.2, "echo": lambda s: None}, daemon=True).start()
    out = tmp_path / "run"
    files = make_deploy_files(tmp_path / "certs", ["127.0.0.1", "localhost"], 2)
    fed = LocalFederation(tmp_path / "deploy", files)
    try:
        fed.start_superlink()
        for i in range(2):
            fed.register(files.node_keys[i], f"node{i}")
            fed.start_supernode(f"node{i}", files.node_keys[i],
                                f'partition-id={i} num-partitions=2 device="phone" gateway="{server.url}" '
                                f'gateway-secret-file="{tmp_path / "node.secret"}" gateway-deadline-s={deadline_s:g}')
        config = f'recipe="{recipe}" overrides="{" ".join(overrides)}" out="{out}"'
        proc = fed.run_app(ROOT, config, timeout=1800)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:] + fed.log("node1")[-4000:]
    finally:
        fed.stop()
        server.shutdown()
        server.server_close()
    return out, devices, fetched
