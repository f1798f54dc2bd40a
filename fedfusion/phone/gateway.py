"""The device gateway: a small HTTP service through which phones take a SuperNode's training tasks.

Flower has no working phone client (its Kotlin and Swift SDKs speak RPCs the 1.42 Fleet API retired), so a phone
does not talk to the SuperLink. It talks to a gateway beside a SuperNode; the SuperNode's ClientApp
(:mod:`fedfusion.clients.device`) hands each train message to the gateway and replies to Flower with what a phone
sent back, so from Flower's side the node is an ordinary sub-model client. The API (docs/devices.md) is:

Device side, every call with ``Authorization: Bearer <device token>``:

- ``POST /v1/register``                       -> 200 ``{"device": name}``
- ``GET  /v1/task``                           -> 204 (nothing to do) or 200 ``{"task", "program", "deadline_s", "spec"}``
                                               and, for a full-forward window, ``"frozen"``: its frozen target's hash
- ``GET  /v1/programs/<id>/<file>``           -> ``program.pte``, ``weights.ptd`` or ``manifest.json``
- ``GET  /v1/tasks/<task>/weights``           -> the round's weights (safetensors), without the frozen target
- ``GET  /v1/tasks/<task>/frozen``            -> the task's frozen target (safetensors, ``frozen/`` keys as they
                                               travelled): fetched only by a device that does not hold that hash
- ``POST /v1/tasks/<task>/result``            body: trained weights (safetensors; ``__metadata__.metrics`` = JSON)
                                               -> 200, 409 (past the deadline) or 403 (not this device's task)
- ``POST /v1/tasks/<task>/error``             body: ``{"error": reason}``: the device cannot train it (the task is
  dropped at once with that reason) -> 200, 409 (no longer running) or 403

Node side, with ``Authorization: Bearer <node secret>``:

- ``POST /v1/node/tasks``                     body: weights (safetensors; ``__metadata__`` = spec, deadline_s and
                                               model_config (a slice) or lora (a LoRA adapter: base, target_modules,
                                               rank, alpha, bits)) -> 200 ``{"task": id}``
- ``GET  /v1/node/tasks/<task>?wait=S``       -> 200 result (safetensors), 202 still running, 410 dropped (JSON reason)

Tokens come from a JSON file (``{"node": secret, "devices": {token: name}, "revoked": [token, ...]}``) re-read
when it changes, so revoking a device is an edit of that file. Unknown tokens get 401, revoked ones 403.
A task a device took and did not finish by its deadline, or that no device took, is dropped: the node replies
with a dropout, as a simulated client that misses its deadline.

A full-forward window's frozen target (the whole target, the same for every window task of a round) is sent once per
change: the gateway keeps it apart from the task's weights, once per :func:`frozen_hash` however many tasks carry
it, and names its hash in the task; a device that already holds the target of that hash reuses it, any other
fetches it and checks the hash of what arrived before using it.

Plain ``http.server``: put it behind a TLS-terminating proxy for anything beyond a lab network.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlparse

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from fedfusion.wire.keys import FROZEN

if TYPE_CHECKING:
    from fedfusion.phone.program import DeviceProgram

PROGRAM_FILES = {"program.pte": "pte", "weights.ptd": "ptd", "manifest.json": "json"}
ADAPTER = "adapter"  # a task's meta key: the LoRA adapter a device trains on its frozen base (absent: a slice)


KEPT_FLOATS = (torch.float32, torch.float16)  # the floating dtypes pack sends as they are


def pack(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> bytes:
    """Named tensors as safetensors bytes, ``meta`` (JSON-able values) in its ``__metadata__``: the wire format
    of weights both ways (a phone parses it with a few lines: 8-byte header length, JSON header, raw data). Tensors
    go as float32, except those a frozen target travels in, kept as they are: integer codes and shapes, float16
    scales."""
    return save_tensors({k: (v if v.dtype in KEPT_FLOATS or not v.is_floating_point() else v.float()).detach().cpu()
                         .contiguous() for k, v in tensors.items()}, metadata={k: json.dumps(v) for k, v in meta.items()})


def unpack(body: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and metadata of :func:`pack`'s bytes; ValueError for a body that is not safetensors."""
    if len(body) < 8:
        raise ValueError("body is not safetensors: shorter than its header length")
    (size,) = struct.unpack("<Q", body[:8])
    try:
        header = json.loads(body[8:8 + size])
        meta = {k: json.loads(v) for k, v in header.get("__metadata__", {}).items()}
        return load_tensors(body), meta
    except Exception as exc:  # malformed JSON or tensor data from an untrusted device
        raise ValueError(f"body is not valid safetensors: {exc}") from None


def split_frozen(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the frozen target's tensors (:data:`~fedfusion.wire.keys.FROZEN` keys), the rest) of a task's tensors."""
    frozen = {k: v for k, v in tensors.items() if k.startswith(FROZEN)}
    return frozen, {k: v for k, v in tensors.items() if k not in frozen}


def frozen_hash(body: bytes) -> str:
    """The sha256 (hex) of a frozen target's bytes as the gateway serves them (:func:`pack` of its tensors, the same
    bytes for the same tensors): the one name under which a gateway offers it and a device keeps it, so a device
    fetches it only when it changed and checks the body it fetched against the task's hash before reading it (a
    plain sha256 of the response, as a phone app computes it)."""
    return hashlib.sha256(body).hexdigest()


class Refused(Exception):
    """A request the gateway turns away, with its HTTP status."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


class Tokens:
    """Who may call: the node secret and the device tokens, read from a JSON file and re-read when it changes."""

    def __init__(self, path: Path) -> None:
        self.path, self.mtime = path, -1.0
        self.node = ""
        self.devices: dict[str, str] = {}  # token -> device name
        self.revoked: set[str] = set()
        self._reload()

    def _reload(self) -> None:
        mtime = self.path.stat().st_mtime
        if mtime == self.mtime:
            return
        data = json.loads(self.path.read_text())
        if not isinstance(data.get("node"), str) or not data["node"] or not isinstance(data.get("devices"), dict):
            raise ValueError(f"{self.path}: needs {{'node': secret, 'devices': {{token: name}}, 'revoked': [...]}}")
        self.node, self.devices, self.revoked = data["node"], dict(data["devices"]), set(data.get("revoked", []))
        self.mtime = mtime

    def device(self, token: str) -> str:
        """The device name of ``token``; Refused 401 (unknown) or 403 (revoked)."""
        self._reload()
        if token in self.revoked:
            raise Refused(403, "this device token is revoked")
        if token not in self.devices:
            raise Refused(401, "unknown device token")
        return str(self.devices[token])

    def check_node(self, token: str) -> None:
        self._reload()
        if not secrets.compare_digest(token.encode(), self.node.encode()):
            raise Refused(401, "unknown node secret")


def write_tokens(path: Path, devices: dict[str, str], node: str | None = None) -> str:
    """Write a tokens file for ``devices`` (token -> name) and a fresh node secret (or ``node``); returns the secret."""
    node = node or secrets.token_urlsafe(24)
    path.write_text(json.dumps({"node": node, "devices": devices, "revoked": []}, indent=1) + "\n")
    return node


@dataclass
class Task:
    """One train message, as the gateway holds it until a device finishes it or its deadline passes."""

    id: str
    program: str
    spec: dict[str, Any]
    weights: bytes
    deadline: float  # time.monotonic()
    frozen: str = ""  # the hash of its frozen target (a full-forward window's; "" for none), kept in Gateway.frozen
    device: str | None = None
    result: bytes | None = None
    status: str = "queued"  # queued -> running -> done | dropped
    reason: str = ""
    done: threading.Event = field(default_factory=threading.Event)


class Gateway:
    """Tasks and programs behind the HTTP API (no Flower; :class:`GatewayServer` serves it)."""

    def __init__(self, tokens: Tokens, programs: Path) -> None:
        self.tokens, self.programs = tokens, programs
        self.tasks: dict[str, Task] = {}
        self.frozen: dict[str, bytes] = {}  # frozen target hash -> its packed tensors, while a task may need it
        self.registered: set[str] = set()
        self.lock = threading.Lock()
        self.export_lock = threading.Lock()

    # -- programs -------------------------------------------------------------------------------------------
    def program_for(self, model_config: dict, batch_size: int, seq_len: int) -> str:
        """The id of the training program of this sub-model shape: found in ``programs`` (by its manifest's
        key), else exported there once (tens of seconds; ``fedfusion export-device --out`` prepares it)."""
        from fedfusion.models.families import config_from_dict
        from fedfusion.phone.program import export_program, program_key

        config = config_from_dict(model_config)
        key = program_key(config, batch_size, seq_len)
        return self._found_or_exported(key, lambda: export_program(config, batch_size, seq_len))

    def window_program_for(self, model_config: dict, spec: dict, frozen: Mapping[str, torch.Tensor], batch_size: int,
                           seq_len: int) -> str:
        """The id of the training program of a full-forward window of this shape (units per axis, shared tensors or
        not; ``spec`` carries the message's :class:`~fedfusion.wire.specs.WindowSpec`) in a target of
        ``model_config`` whose frozen part travels as ``frozen`` does: found in ``programs`` by its key, else
        exported there once."""
        from fedfusion.models.families import config_from_dict
        from fedfusion.models.full_forward import window_plan
        from fedfusion.phone.window import export_window_program, frozen_format, window_program_key
        from fedfusion.wire.specs import WindowSpec

        config, plan = config_from_dict(model_config), window_plan(WindowSpec.from_config(spec))
        fmt = frozen_format(frozen)
        key = window_program_key(config, plan, batch_size, seq_len, fmt)
        return self._found_or_exported(key, lambda: export_window_program(config, plan, batch_size, seq_len,
                                                                          frozen_dtype=fmt))

    def lora_program_for(self, lora: dict, batch_size: int, seq_len: int) -> str:
        """The id of the training program of this LoRA adapter (``lora``: base, target_modules, rank, alpha, bits):
        found in ``programs`` by its key, else exported there once from the base (which the gateway's host holds)."""
        from fedfusion.models.pretrained import load_base
        from fedfusion.phone.program import export_lora_program, lora_program_key

        modules, rank, alpha, bits = list(lora["target_modules"]), int(lora["rank"]), float(lora["alpha"]), int(lora["bits"])
        key = lora_program_key(lora["base"], modules, rank, alpha, bits, batch_size, seq_len)
        return self._found_or_exported(key, lambda: export_lora_program(
            load_base(lora["base"]), modules, rank, alpha, batch_size, seq_len, bits=bits, base_name=lora["base"]))

    def _found_or_exported(self, key: str, export: Callable[[], DeviceProgram]) -> str:
        """The id of the program whose manifest has ``key`` in ``programs``, else of the one ``export`` makes, saved
        there once (one export at a time)."""
        with self.export_lock:
            for manifest in self.programs.glob("*.json"):
                if json.loads(manifest.read_text()).get("key") == key:
                    return manifest.stem
            return export().save(self.programs)["json"].stem

    def program_file(self, program: str, name: str) -> bytes:
        if name not in PROGRAM_FILES or not program.isalnum():
            raise Refused(404, f"no program file {name!r}")
        path = self.programs / f"{program}.{PROGRAM_FILES[name]}"
        if not path.is_file():
            raise Refused(404, f"no program {program!r}")
        return path.read_bytes()

    # -- node side ------------------------------------------------------------------------------------------
    def submit(self, body: bytes) -> str:
        """Queue a task from a node's request body; returns its id."""
        tensors, meta = unpack(body)
        spec, deadline_s = dict(meta["spec"]), float(meta["deadline_s"])
        shape = int(spec["batch-size"]), int(spec["seq-len"])
        frozen, rest = split_frozen(tensors)
        packed = pack(frozen, {}) if frozen else b""
        program = (self.lora_program_for(meta[ADAPTER], *shape) if ADAPTER in meta
                   else self.window_program_for(meta["model_config"], spec, frozen, *shape) if meta.get("window")
                   else self.program_for(meta["model_config"], *shape))
        digest = frozen_hash(packed) if frozen else ""
        task = Task(secrets.token_hex(8), program, spec, pack(rest, {}), time.monotonic() + deadline_s, digest)
        with self.lock:
            if digest and digest not in self.frozen:  # the round's other tasks carried the same target: one copy
                self.frozen[digest] = packed
            self.tasks[task.id] = task
        return task.id

    def outcome(self, task_id: str, wait_s: float) -> Task:
        """The task once it is done or dropped, or as it stands after ``wait_s`` seconds."""
        task = self._task(task_id)
        task.done.wait(max(0.0, min(wait_s, task.deadline - time.monotonic())))
        self._expire(task)
        return task

    def collected(self, task: Task) -> None:
        """The node has the task's outcome: a finished task is forgotten; a dropped one keeps only its record, so
        that a late result is answered 409, not 404."""
        with self.lock:
            if task.status == "done":
                self.tasks.pop(task.id, None)
            task.weights = b""
            if task.frozen and not any(t.frozen == task.frozen and t.status in ("queued", "running")
                                       for t in self.tasks.values()):
                self.frozen.pop(task.frozen, None)

    def _expire(self, task: Task) -> None:
        with self.lock:
            if task.status in ("queued", "running") and time.monotonic() >= task.deadline:
                task.status = "dropped"
                task.reason = (f"device {task.device} took the task and sent no result before its deadline"
                               if task.device else "no device took the task before its deadline")
                task.done.set()

    def _task(self, task_id: str) -> Task:
        with self.lock:
            task = self.tasks.get(task_id)
        if task is None:
            raise Refused(404, f"no task {task_id!r}")
        return task

    # -- device side ----------------------------------------------------------------------------------------
    def register(self, device: str) -> dict[str, Any]:
        with self.lock:
            self.registered.add(device)
        return {"device": device}

    def pull(self, device: str) -> Task | None:
        """The oldest queued task still in time, now this device's; None if there is none."""
        if device not in self.registered:
            raise Refused(403, "register first (POST /v1/register)")
        for task in list(self.tasks.values()):
            self._expire(task)
        with self.lock:
            for task in self.tasks.values():
                if task.status == "queued":
                    task.status, task.device = "running", device
                    return task
        return None

    def own(self, device: str, task_id: str) -> Task:
        task = self._task(task_id)
        if task.device != device:
            raise Refused(403, "this task is not this device's")
        return task

    def frozen_of(self, device: str, task_id: str) -> bytes:
        """The packed frozen target of this device's running task; Refused 404 for a task without one, 409 for a
        task no longer running (its target may be gone)."""
        task = self.own(device, task_id)
        with self.lock:
            if not task.frozen:
                raise Refused(404, "this task has no frozen target")
            if task.status != "running":
                raise Refused(409, f"task is {task.status}: {task.reason}")
            return self.frozen[task.frozen]

    def fail(self, device: str, task_id: str, reason: str) -> None:
        """A device could not train its task: the task is dropped at once with the device's reason, so its node
        answers the server with it instead of waiting for the deadline."""
        task = self.own(device, task_id)
        with self.lock:
            if task.status != "running":
                raise Refused(409, f"task is {task.status}: {task.reason}")
            task.status, task.reason = "dropped", f"device {device} could not train the task: {reason[:500]}"
            task.done.set()

    def push(self, device: str, task_id: str, body: bytes) -> None:
        """Accept a device's result (checked to be safetensors with metrics) unless its deadline has passed."""
        task = self.own(device, task_id)
        _, meta = unpack(body)
        if not isinstance(meta.get("metrics"), dict):
            raise Refused(400, "result lacks __metadata__.metrics")
        self._expire(task)
        with self.lock:
            if task.status != "running":
                raise Refused(409, f"task is {task.status}: {task.reason}")
            task.result, task.status = body, "done"
            task.done.set()


class _Handler(BaseHTTPRequestHandler):
    server: GatewayServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet: a phone polls every second
        pass

    def _send(self, status: int, body: bytes = b"", kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, data: dict) -> None:
        self._send(status, json.dumps(data).encode())

    def _token(self) -> str:
        auth = self.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            raise Refused(401, "missing Authorization: Bearer <token>")
        return auth.removeprefix("Bearer ").strip()

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def _route(self, method: str) -> None:
        gateway = self.server.gateway
        url = urlparse(self.path)
        parts = [p for p in url.path.split("/") if p]
        try:
            if parts[:2] == ["v1", "node"]:
                gateway.tokens.check_node(self._token())
                self._node(method, parts[2:], parse_qs(url.query))
                return
            if parts[:1] != ["v1"]:
                raise Refused(404, "not found")
            device = gateway.tokens.device(self._token())
            self._device(method, device, parts[1:])
        except Refused as exc:
            self._json(exc.status, {"error": exc.reason})
        except (ValueError, KeyError) as exc:
            self._json(400, {"error": str(exc)[:500]})

    def _node(self, method: str, parts: list[str], query: dict[str, list[str]]) -> None:
        gateway = self.server.gateway
        if method == "POST" and parts == ["tasks"]:
            self._json(200, {"task": gateway.submit(self._body())})
        elif method == "GET" and len(parts) == 2 and parts[0] == "tasks":
            task = gateway.outcome(parts[1], float(query.get("wait", ["0"])[0]))
            # the task is marked collected before the answer goes out: a node's next request may arrive at once
            if task.status == "done":
                result = task.result or b""
                gateway.collected(task)
                self._send(200, result, "application/octet-stream")
            elif task.status == "dropped":
                gateway.collected(task)
                self._json(410, {"status": "dropped", "reason": task.reason, "device": task.device})
            else:
                self._json(202, {"status": task.status, "device": task.device})
        else:
            raise Refused(404, "not found")

    def _device(self, method: str, device: str, parts: list[str]) -> None:
        gateway = self.server.gateway
        if method == "POST" and parts == ["register"]:
            self._json(200, gateway.register(device))
        elif method == "GET" and parts == ["task"]:
            task = gateway.pull(device)
            if task is None:
                self._send(204)
            else:
                self._json(200, {"task": task.id, "program": task.program, "spec": task.spec,
                                 "deadline_s": round(task.deadline - time.monotonic(), 3),
                                 **({"frozen": task.frozen} if task.frozen else {})})
        elif method == "GET" and len(parts) == 3 and parts[0] == "programs":
            self._send(200, gateway.program_file(parts[1], parts[2]), "application/octet-stream")
        elif method == "GET" and len(parts) == 3 and parts[0] == "tasks" and parts[2] == "weights":
            self._send(200, gateway.own(device, parts[1]).weights, "application/octet-stream")
        elif method == "GET" and len(parts) == 3 and parts[0] == "tasks" and parts[2] == "frozen":
            self._send(200, gateway.frozen_of(device, parts[1]), "application/octet-stream")
        elif method == "POST" and len(parts) == 3 and parts[0] == "tasks" and parts[2] == "result":
            gateway.push(device, parts[1], self._body())
            self._json(200, {"status": "accepted"})
        elif method == "POST" and len(parts) == 3 and parts[0] == "tasks" and parts[2] == "error":
            gateway.fail(device, parts[1], str(json.loads(self._body() or b"{}").get("error", "")))
            self._json(200, {"status": "dropped"})
        else:
            raise Refused(404, "not found")

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._route("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._route("POST")


class GatewayServer(ThreadingHTTPServer):
    """The HTTP front of a :class:`Gateway` (one thread per request)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], gateway: Gateway) -> None:
        super().__init__(address, _Handler)
        self.gateway = gateway

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host.decode() if isinstance(host, bytes) else host}:{port}"


def call(url: str, method: str, token: str, body: bytes | None = None, timeout: float = 60.0) -> tuple[int, bytes]:
    """One request to a gateway as a device or node makes it: (HTTP status, body); refusals are returned, not
    raised, so callers branch on the status as a phone app would."""
    from urllib.error import HTTPError
    from urllib.request import Request, urlopen

    request = Request(url, data=body, method=method, headers={"Authorization": f"Bearer {token}"})
    try:
        with urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except HTTPError as exc:
        return exc.code, exc.read()
