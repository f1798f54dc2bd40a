"""Deployment on real Flower processes: TLS material, SuperNode keys, and a loopback federation.

``fedfusion certs DIR`` writes what a real deployment needs: a local certificate authority, a SuperLink
certificate for the given hosts, and one EC P-384 key pair per SuperNode (OpenSSH format, as
``flwr supernode register`` and ``flower-supernode --auth-supernode-private-key`` expect).

``fedfusion deploy RECIPE`` uses the same files to start, on this machine, a SuperLink with TLS and
SuperNode authentication, registers the node keys, starts one SuperNode per node (each told its device
tier and partition through ``--node-config``), runs the recipe with ``flwr run . <connection>`` and
stops every process it started. It is the deployment README section, executed; the test suite runs it.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

CONNECTION = "fedfusion-local"


@dataclass(frozen=True)
class DeployFiles:
    """Paths written by :func:`make_deploy_files`."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    node_keys: tuple[Path, ...]  # private keys; the public key is the same path + ".pub"


def _write_private(path: Path, key: ec.EllipticCurvePrivateKey, fmt: serialization.PrivateFormat) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption()))
    path.chmod(0o600)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_deploy_files(out: Path, hosts: list[str], nodes: int, days: int = 365) -> DeployFiles:
    """A CA, a SuperLink certificate valid for ``hosts`` (IPs or DNS names), and ``nodes`` SuperNode key pairs."""
    if nodes < 1:
        raise ValueError(f"nodes: need at least 1 SuperNode key, got {nodes}")
    if not hosts:
        raise ValueError("hosts: the SuperLink certificate needs at least one host name or IP")
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (x509.CertificateBuilder().subject_name(_name("fedfusion local CA")).issuer_name(_name("fedfusion local CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    server_key = ec.generate_private_key(ec.SECP384R1())
    server = (x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca.subject)
              .public_key(server_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
              .add_extension(x509.SubjectAlternativeName(names), critical=False)
              .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
              .sign(ca_key, hashes.SHA256()))
    files = DeployFiles(out / "ca.crt", out / "server.pem", out / "server.key",
                        tuple(out / f"node{i}" for i in range(nodes)))
    files.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    _write_private(files.server_key, server_key, serialization.PrivateFormat.TraditionalOpenSSL)
    for path in files.node_keys:
        node_key = ec.generate_private_key(ec.SECP384R1())
        _write_private(path, node_key, serialization.PrivateFormat.OpenSSH)
        Path(f"{path}.pub").write_bytes(node_key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
    return files


def free_port() -> int:
    """A TCP port nobody listens on right now (loopback)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _bin(name: str) -> str:
    """A Flower executable from this environment (beside the running Python), else from PATH."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.is_file() else shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name}: not found beside {sys.executable} or on PATH; install flwr")
    return found


def _wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}; see {log}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port} after {timeout:.0f}s; see {log}")


@dataclass
class LocalFederation:
    """A SuperLink (TLS, SuperNode auth) and SuperNodes on loopback, all in ``workdir``; stop() ends them all."""

    workdir: Path
    files: DeployFiles
    port: int = field(default_factory=free_port)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """Environment for every Flower process: a private FLWR_HOME and no runtime dependency installs."""
        return {**os.environ, "FLWR_HOME": str(self.workdir / "flwr-home"),
                "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = self.workdir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as fh:
            proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def start_superlink(self, timeout: float = 60) -> None:
        """Start the SuperLink and point this federation's FLWR_HOME connection at it (with the CA)."""
        home = self.workdir / "flwr-home"
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "127.0.0.1:{self.port}"\nroot-certificates = "{self.files.ca_cert.resolve()}"\n')
        proc = self._start("superlink", [
            _bin("flower-superlink"), "--ssl-ca-certfile", str(self.files.ca_cert),
            "--ssl-certfile", str(self.files.server_cert), "--ssl-keyfile", str(self.files.server_key),
            "--enable-supernode-auth", "--disable-runtime-dependency-installation",
            "--port", str(self.port), "--database", str(self.workdir / "superlink.db")])
        _wait_port(self.port, proc, self.workdir / "logs" / "superlink.log", timeout)

    def register(self, key: Path, name: str) -> None:
        """``flwr supernode register`` a node's public key, as an operator would."""
        proc = subprocess.run([_bin("flwr"), "supernode", "register", f"{key}.pub", CONNECTION, "--name", name],
                              env=self.env, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"registering {key}.pub failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")

    def start_supernode(self, name: str, key: Path, node_config: str, max_retries: int | None = None) -> subprocess.Popen:
        """A SuperNode that trusts the local CA and signs in with ``key`` (retrying forever unless ``max_retries``)."""
        retries = [] if max_retries is None else ["--max-retries", str(max_retries)]
        return self._start(name, [
            _bin("flower-supernode"), "--superlink", f"127.0.0.1:{self.port}",
            "--root-certificates", str(self.files.ca_cert), "--auth-supernode-private-key", str(key),
            "--node-config", node_config, "--port", str(free_port()), *retries])

    def run_app(self, app_dir: Path, run_config: str, timeout: float) -> subprocess.CompletedProcess:
        """``flwr run <app_dir> <connection> --stream`` with the given run config."""
        return subprocess.run([_bin("flwr"), "run", str(app_dir), CONNECTION, "--stream", "-c", run_config],
                              env=self.env, capture_output=True, text=True, timeout=timeout)

    def log(self, name: str) -> str:
        """What process ``name`` has written so far."""
        return (self.workdir / "logs" / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        """Stop every process this federation started, and everything they started (SuperExec, app processes)."""
        tree: list[psutil.Process] = []
        for proc in self.procs:
            try:
                parent = psutil.Process(proc.pid)
                tree += [parent, *parent.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.terminate()
        _, alive = psutil.wait_procs(tree, timeout=10)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(alive, timeout=10)
        for proc in self.procs:
            proc.wait()


@dataclass
class DeployResult:
    """How a loopback deployment went."""

    returncode: int  # of `flwr run`
    output: str  # its streamed log
    refused: list[str]  # unregistered SuperNodes the SuperLink turned away
    admitted: list[str]  # unregistered SuperNodes not refused (must stay empty)


def deploy_local(app_dir: Path, recipe_ref: str, overrides: list[str], workdir: Path, out: Path,
                 unregistered: int = 0, timeout: float = 3600, echo=print) -> DeployResult:
    """Run a recipe on a loopback deployment with TLS and SuperNode auth; every process is stopped after.

    One SuperNode per client of the recipe's population (``units.supernodes`` per client in the units mode:
    :func:`~fedfusion.config.recipe.nodes_per_client`), node ``i`` started with
    ``--node-config 'partition-id=i num-partitions=N device="<tier of its client>"'``. ``unregistered``
    extra SuperNodes start with keys nobody registered, to show that the SuperLink refuses them.
    """
    from fedfusion.config.recipe import nodes_per_client
    from fedfusion.data.population import tier_list
    from fedfusion.run.check import load_checked

    recipe = load_checked(recipe_ref, overrides)
    config = run_config(recipe_ref, overrides, out)  # refuses what flwr run cannot carry before anything starts
    if not (app_dir / "pyproject.toml").is_file():
        raise FileNotFoundError(f"{app_dir}: no pyproject.toml; run from the fedfusion source tree (flwr run needs it)")
    k = nodes_per_client(recipe)
    n = recipe.population.num_clients * k
    files = make_deploy_files(workdir / "certs", ["127.0.0.1", "localhost"], n + unregistered)
    fed = LocalFederation(workdir, files)
    try:
        fed.start_superlink()
        echo(f"SuperLink on 127.0.0.1:{fed.port} (TLS, SuperNode auth); logs in {workdir / 'logs'}")
        for i in range(n):
            fed.register(files.node_keys[i], f"node{i}")
        tiers = [t for t in tier_list(recipe.population, recipe.seed) for _ in range(k)]  # node i is client i // k's
        for i in range(n):
            fed.start_supernode(f"node{i}", files.node_keys[i],
                                f'partition-id={i} num-partitions={n} device="{tiers[i]}"')
        echo(f"{n} registered SuperNodes started: {', '.join(f'node{i}={t}' for i, t in enumerate(tiers))}")
        rogues = {f"unregistered{j}": fed.start_supernode(f"unregistered{j}", files.node_keys[n + j],
                                                          f'partition-id=0 num-partitions={n} device="{tiers[0]}"',
                                                          max_retries=0)
                  for j in range(unregistered)}
        proc = fed.run_app(app_dir, config, timeout)
        for p in rogues.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass  # still running: it got in, or is still trying; either way not refused
        refused = [name for name, p in rogues.items()
                   if p.poll() not in (None, 0) and "Failed to activate SuperNode" in fed.log(name)]
        admitted = [name for name in rogues if name not in refused]
        return DeployResult(proc.returncode, proc.stdout + proc.stderr, refused, admitted)
    finally:
        fed.stop()


def run_config(recipe_ref: str, overrides: list[str], out: Path) -> str:
    """The ``-c`` run config of ``flwr run`` for the ServerApp: the overrides shell-quoted, since the ServerApp
    splits them with ``shlex`` (``population.mix={phone: 0.5, laptop: 0.5}`` is one override). Flower reads a
    quoted value up to the next quote of its kind, so an override with a quote in it cannot travel: refused."""
    for override in overrides:
        if '"' in override or "'" in override:
            raise ValueError(f"override {override!r}: flwr run's -c run config cannot carry quotes; leave them out")
    return (f"recipe={_toml(recipe_ref)} overrides={_toml(shlex.join(overrides))} "
            f"out={_toml(str(out.resolve()))}")


def _toml(value: str) -> str:
    """A TOML basic string (Flower parses ``-c`` run config as TOML)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
