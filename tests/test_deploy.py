"""Deployment: TLS material and node keys, then the rolling recipe over a real SuperLink and SuperNodes."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from fedfusion.cli import main
from fedfusion.config.recipe import load_recipe
from fedfusion.data.population import tier_list
from fedfusion.deploy import make_deploy_files
from fedfusion.run.run_dir import read_jsonl

pytestmark = pytest.mark.slow  # Flower's runtime (Ray or SuperLink processes): minutes, not seconds

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = [
    "rounds=1", "population.num_clients=2", "selection.clients_per_round=2", "model.hidden_size=32",
    "model.num_heads=2", "model.num_kv_heads=2", "model.intermediate_size=32", "model.num_layers=1",
    "train.local_steps=1", "data.eval_chars=2000",
]


def test_certificates_chain_to_the_ca_and_node_keys_are_what_flower_accepts(tmp_path):
    # imported here, not at the top: flwr.cli pulls in fastapi, a second of every worker's collection with -m "not slow"
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.cli.supernode.register import try_load_public_key

    files = make_deploy_files(tmp_path, ["127.0.0.1", "superlink.example"], nodes=2)
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert san.get_values_for_type(x509.DNSName) == ["superlink.example"]
    for key in files.node_keys:
        assert try_load_public_key(Path(f"{key}.pub"))  # the check `flwr supernode register` applies
        assert load_ssh_private_key(key.read_bytes(), password=None)  # what flower-supernode loads
        assert key.stat().st_mode & 0o077 == 0  # private keys are not readable by others
    with pytest.raises(ValueError, match="nodes"):
        make_deploy_files(tmp_path / "none", ["127.0.0.1"], nodes=0)


@pytest.mark.skipif(shutil.which("pgrep") is None, reason="needs pgrep to check that every process stopped")
def test_rolling_over_tls_with_registered_supernodes_refuses_an_unregistered_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    out, workdir = tmp_path / "run", tmp_path / "deploy"
    assert main(["deploy", "rolling", *OVERRIDES, "--out", str(out), "--workdir", str(workdir),
                 "--unregistered", "1"]) == 0, capsys.readouterr().out[-4000:]
    printed = capsys.readouterr().out
    assert "unregistered0: refused by the SuperLink" in printed
    assert json.loads((out / "summary.json").read_text())["status"] == "ok"
    clients = read_jsonl(out / "clients.jsonl")
    assert len({c["node"] for c in clients}) == 2 and {c["status"] for c in clients} == {"ok"}
    tiers = tier_list(load_recipe("rolling", OVERRIDES))  # each node trained as the tier its node-config named
    assert sorted((c["partition"], c["device"]) for c in clients) == list(enumerate(tiers))
    assert "Failed to activate SuperNode" in (workdir / "logs" / "unregistered0.log").read_text()
    left = subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True).stdout.split()
    assert left == [], "processes left running"


MIXED = [  # a phone distilling its own tiny model and a laptop training a quarter slice, in one round
    "rounds=1", "population.num_clients=2", "population.mix={phone: 0.5, laptop: 0.5}",
    "fusion.tiers={phone: distill, laptop: submodel}", "fusion.widths={laptop: 0.25}", "selection.clients_per_round=2",
    "model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=4", "model.intermediate_size=32",
    "model.num_layers=1", "train.local_steps=1", "data.eval_chars=2000", "distill.server_steps=2",
    "distill.back_steps=1", "distill.transfer.max_chars=2000",
]


@pytest.mark.skipif(shutil.which("pgrep") is None, reason="needs pgrep to check that every process stopped")
def test_a_mixed_method_federation_deploys(tmp_path, monkeypatch, capsys):
    """recipes/mixed.yaml over a real SuperLink and SuperNodes: each node trains with its tier's method, and the
    ledger says which."""
    monkeypatch.chdir(ROOT)
    out, workdir = tmp_path / "run", tmp_path / "deploy"
    assert main(["deploy", "mixed", *MIXED, "--out", str(out), "--workdir", str(workdir)]) == 0, \
        capsys.readouterr().out[-4000:]
    assert json.loads((out / "summary.json").read_text())["status"] == "ok"
    clients = read_jsonl(out / "clients.jsonl")
    assert sorted((c["device"], c["method"], c["status"]) for c in clients) == [
        ("laptop", "submodel", "ok"), ("phone", "distill", "ok")]
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [r["round"] for r in metrics] == [0, 1] and metrics[1]["eval_loss"] != metrics[0]["eval_loss"]
    left = subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True).stdout.split()
    assert left == [], "processes left running"


def test_the_run_config_carries_overrides_with_spaces_whole(tmp_path):
    """Flower parses ``-c`` as TOML and the ServerApp splits the overrides with shlex: a mapping override with
    spaces must come back as one override (joined with plain spaces it broke the recipe's YAML)."""
    import shlex

    from flwr.common.config import parse_config_args

    from fedfusion.deploy import run_config

    overrides = ["population.mix={phone: 0.5, laptop: 0.5}", "rounds=2", "name=two words"]
    parsed = parse_config_args([run_config("quickstart", overrides, tmp_path / "run")])
    assert shlex.split(parsed["overrides"]) == overrides
    assert parsed["recipe"] == "quickstart" and parsed["out"] == str((tmp_path / "run").resolve())
    with pytest.raises(ValueError, match="override \"name=it's\": flwr run's -c run config cannot carry quotes"):
        run_config("quickstart", ["name=it's"], tmp_path / "run")


UNITS = [  # the exact mode over real SuperNodes: 2 steps of a 1-layer target, its MLP's GEMMs on the nodes
    "fusion.method=units", "units.steps=2", "population.num_clients=2", "model.hidden_size=32", "model.num_heads=4",
    "model.num_kv_heads=2", "model.intermediate_size=64", "model.num_layers=1", "train.batch_size=4",
    "train.seq_len=32", "data.eval_chars=2000", "output.save_model=false",
    "units.deadline_floor_s=60",  # a deployed SuperNode starts a fresh ClientApp process per message (~15 s a phase)
]


@pytest.mark.skipif(shutil.which("pgrep") is None, reason="needs pgrep to check that every process stopped")
def test_the_units_mode_deploys_and_its_loss_is_central_training(tmp_path, monkeypatch, capsys):
    """fusion.method=units through `fedfusion deploy` (~2 min here): every phase's tiles computed by the two
    SuperNodes (weight blocks kept in context.state), the loss curve that of a plain torch loop. (With
    ``units.supernodes=2 units.micro_batches=2`` the same command starts 4 SuperNodes and its losses were bit-equal
    to the torch loop's too, ~2.5 min alone; left out of the suite for time: tests/test_units_flower.py runs two
    SuperNodes per device on the simulation engine.)"""
    from tests.test_units_flower import central_losses

    monkeypatch.chdir(ROOT)
    out, workdir = tmp_path / "run", tmp_path / "deploy"
    overrides = UNITS
    assert main(["deploy", "rolling", *overrides, "--out", str(out), "--workdir", str(workdir)]) == 0, \
        capsys.readouterr().out[-4000:]
    assert "2 registered SuperNodes started" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["status"] == "ok"
    assert [n["partition"] for n in read_jsonl(out / "nodes.jsonl")] == [0, 1]
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row, central in zip(rows[1:], central_losses(overrides)):
        assert abs(row["train_loss"] - central) <= 1e-5 * central
        assert row["clients_ok"] == 2 and not row["missed"] and row["server_fallback"] == 0
    left = subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True).stdout.split()
    assert left == [], "processes left running"
