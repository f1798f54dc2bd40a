"""Deployment: TLS material and node keys, then recipes over a real SuperLink and SuperNodes (one mixed deployment,
with an unregistered SuperNode, read by two tests; the units mode)."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import threading
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

from fedfusion.analysis.report import read_jsonl
from fedfusion.cli import main
from fedfusion.config.recipe import load_recipe
from fedfusion.data.population import tier_list
from fedfusion.deploy import make_deploy_files

pytestmark = pytest.mark.slow  # Flower's runtime (Ray or SuperLink processes): minutes, not seconds


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


MIXED = [  # a phone distilling its own tiny model and a laptop training a quarter slice, in one round
    "rounds=1", "population.num_clients=2", "population.mix={phone: 0.5, laptop: 0.5}",
    "fusion.tiers={phone: distill, laptop: submodel}", "fusion.widths={laptop: 0.25}", "selection.clients_per_round=2",
    "model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=4", "model.intermediate_size=32",
    "model.num_layers=1", "train.local_steps=1", "data.eval_chars=2000", "distill.server_steps=2",
    "distill.back_steps=1", "distill.transfer.max_chars=2000",
]
# the tests of the one mixed deployment stay on one pytest-xdist worker (addopts: --dist loadgroup): made once
ON_THE_MIXED_DEPLOYMENT = pytest.mark.xdist_group("test_deploy.mixed")
needs_pgrep = pytest.mark.skipif(shutil.which("pgrep") is None, reason="needs pgrep to check that every process stopped")


@dataclass(frozen=True)
class Deployment:
    """What one `fedfusion deploy` left: its exit code, what it printed, its run directory and its workdir (certs,
    logs), and the processes still running from that workdir once it returned."""

    code: int
    printed: str
    out: Path
    workdir: Path
    left: list[str]


def deploy(tmp_path: Path, app: Path, recipe: str, overrides: list[str], *extra: str) -> Deployment:
    """`fedfusion deploy RECIPE` over a real SuperLink and SuperNodes, run from ``app``: the source tree's Flower app
    as `flwr run .` bundles it (the ``flower_app`` fixture; flwr run . needs its pyproject.toml). The SuperExecs poll
    for tasks every 0.2 s instead of Flower's 1 s (its FLWR_SUPEREXEC_TASK_POLL_INTERVAL): every ClientApp message of
    a deployment starts after one such poll."""
    out, workdir = tmp_path / "run", tmp_path / "deploy"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(app)
        mp.setenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.2")
        with redirect_stdout(io.StringIO()) as printed:
            code = main(["deploy", recipe, *overrides, "--out", str(out), "--workdir", str(workdir), *extra])
    left = subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True).stdout.split()
    return Deployment(code, printed.getvalue(), out, workdir, left)


@pytest.fixture(scope="module")
def mixed_deployment(tmp_path_factory, flower_app) -> Deployment:
    """recipes/mixed.yaml deployed once, with one SuperNode more than the recipe's two whose key nobody registered."""
    return deploy(tmp_path_factory.mktemp("mixed"), flower_app, "mixed", MIXED, "--unregistered", "1")


@needs_pgrep
@ON_THE_MIXED_DEPLOYMENT
def test_deploying_over_tls_with_registered_supernodes_refuses_an_unregistered_one(mixed_deployment):
    """Over TLS with SuperNode authentication: the registered SuperNodes train, each as the tier its node-config
    named, the unregistered one is refused by the SuperLink, and no process of the deployment is left."""
    d = mixed_deployment
    assert d.code == 0, d.printed[-4000:]
    assert "unregistered0: refused by the SuperLink" in d.printed
    assert json.loads((d.out / "summary.json").read_text())["status"] == "ok"
    clients = read_jsonl(d.out / "clients.jsonl")
    assert len({c["node"] for c in clients}) == 2 and {c["status"] for c in clients} == {"ok"}
    mixed = load_recipe("mixed", MIXED)
    tiers = tier_list(mixed.population, mixed.seed)  # each node trained as the tier its node-config named
    assert sorted((c["partition"], c["device"]) for c in clients) == list(enumerate(tiers))
    assert "Failed to activate SuperNode" in (d.workdir / "logs" / "unregistered0.log").read_text()
    assert d.left == [], "processes left running"


@needs_pgrep
@ON_THE_MIXED_DEPLOYMENT
def test_a_mixed_method_federation_deploys(mixed_deployment):
    """recipes/mixed.yaml over a real SuperLink and SuperNodes: each node trains with its tier's method, and the
    ledger says which."""
    d = mixed_deployment
    assert d.code == 0, d.printed[-4000:]
    assert json.loads((d.out / "summary.json").read_text())["status"] == "ok"
    clients = read_jsonl(d.out / "clients.jsonl")
    assert sorted((c["device"], c["method"], c["status"]) for c in clients) == [
        ("laptop", "submodel", "ok"), ("phone", "distill", "ok")]
    metrics = read_jsonl(d.out / "metrics.jsonl")
    assert [r["round"] for r in metrics] == [0, 1] and metrics[1]["eval_loss"] != metrics[0]["eval_loss"]
    assert d.left == [], "processes left running"


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


class CheckpointCopies(threading.Thread):
    """Copies each round's checkpoint of the run in ``run`` as it appears, into ``to / r{round}``: save_checkpoint
    swaps a whole directory in, so a copy whose state.json names the same round before and after it (and inside
    it) is one checkpoint, whole; a copy caught by a swap is taken again."""

    def __init__(self, run: Path, to: Path) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.to, self.rounds, self.done = run, to, set[int](), threading.Event()

    def _round(self, path: Path) -> int:
        return int(json.loads((path / "checkpoint" / "state.json").read_text())["round"])

    def run(self) -> None:
        while not self.done.is_set():
            try:
                r = self._round(self.run_dir)
                if r not in self.rounds:
                    dst = self.to / f"r{r}"
                    shutil.rmtree(dst, ignore_errors=True)
                    shutil.copytree(self.run_dir / "checkpoint", dst / "checkpoint")
                    if self._round(self.run_dir) == r == self._round(dst):
                        self.rounds.add(r)
            except (OSError, ValueError):  # none yet, or caught between save_checkpoint's two renames
                pass
            self.done.wait(0.1)

    def __enter__(self) -> CheckpointCopies:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.done.set()
        self.join()


@needs_pgrep
def test_the_units_mode_deploys_and_its_loss_is_central_training(tmp_path, flower_app):
    """fusion.method=units through `fedfusion deploy` (~2 min here): every phase's tiles computed by the two
    SuperNodes (weight blocks kept in context.state), each step's loss central training's at the values the run
    held then: step 1 at the target's initial values, step 2 at those of step 1's checkpoint (copied while the run
    goes on), each within the float32 bound of the exact loss on its batch (model_bounds.ExactLM); and step 1's
    checkpoint is AdamW's first step from the initial values with a gradient within the float32 bound of the exact
    one (model_bounds.adamw_first_step_bound, taken about the exact gradient's step in float64). Not the run's loss
    curve against a torch loop's: after an AdamW step no rounding bound relates two trajectories
    (tests/model_bounds.py). (With ``units.supernodes=2 units.micro_batches=2`` the same command starts 4
    SuperNodes, ~2.5 min alone; left out of the suite for time: tests/test_units_flower.py runs two SuperNodes per
    device on the simulation engine.)"""
    import torch
    from fp_bounds import assert_within
    from model_bounds import adamw_first_step_bound

    from fedfusion.run.checkpoint import load_checkpoint
    from tests.test_units_flower import Central

    with CheckpointCopies(tmp_path / "run", tmp_path / "copies") as copies:
        d = deploy(tmp_path, flower_app, "rolling", UNITS)
    assert d.code == 0, d.printed[-4000:]
    assert "2 registered SuperNodes started" in d.printed
    assert json.loads((d.out / "summary.json").read_text())["status"] == "ok"
    assert [n["partition"] for n in read_jsonl(d.out / "nodes.jsonl")] == [0, 1]
    rows = read_jsonl(d.out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and 1 in copies.rounds
    central = Central(UNITS)
    after_one = load_checkpoint(tmp_path / "copies" / "r1")
    assert after_one.round == 1
    held = [central.initial, {k: after_one.target[k] for k in central.names}]
    for row, values, batch in zip(rows[1:], held, central.batches, strict=True):
        want = central.exact.at(values, batch)
        assert_within(torch.tensor(row["train_loss"]), torch.tensor(want.loss), want.loss_bound)
        assert row["clients_ok"] == 2 and not row["missed"] and row["server_fallback"] == 0
    recipe = central.recipe.train
    first = central.exact.at(central.initial, central.batches[0])
    for k, start in central.initial.items():
        g = first.grads[k]
        decayed = start * (1 - recipe.lr * recipe.weight_decay)  # torch's AdamW decays the same float32 values so
        step = decayed.double() - recipe.lr * g / (g.abs() + 1e-8)  # m_hat = g, v_hat = g^2 at the first step
        bound = adamw_first_step_bound(g, first.grad_bounds[k], step, recipe.lr, 1e-8, torch.float32)
        assert_within(held[1][k], step, bound)
    assert d.left == [], "processes left running"
