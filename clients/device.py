"""Client role of a SuperNode that serves phones: each train message becomes a task on the node's device gateway
(:mod:`fedfusion.phone.gateway`), and the phone's result becomes the reply, as :mod:`fedfusion.clients.submodel` replies.

Turned on per node: ``--node-config 'gateway="http://127.0.0.1:8765" gateway-secret-file="/path/secret"'``.
A phone that misses the deadline (``gateway-deadline-s``, default :data:`DEADLINE_S`) makes the reply an error
whose reason starts with :data:`DROPPED`, which the strategy records as a ``dropped`` row, with the work it was
sent, as a simulated client that misses its deadline.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord

from fedfusion.config.methods import LORA, SUBMODEL, WINDOW
from fedfusion.devices.meters import WIRE_PREFIX
from fedfusion.fusion.lora.spec import AdapterSpec, LoRABaseSpec, QuantizeSpec
from fedfusion.phone.gateway import ADAPTER, call, pack, unpack
from fedfusion.wire.keys import DEVICE_STEP_S, NUM_EXAMPLES
from fedfusion.wire.specs import DROPPED, ClientSpec, ModelSpec, RoleSpec, RoundSpec, SliceSpec, TrainSpec, WindowSpec, merge

DEADLINE_S = 600.0
# how long queuing a task may take: the gateway exports a program the first time it sees a sub-model shape (a minute
# or more on a small CPU), before the phone's deadline starts
SUBMIT_TIMEOUT_S = 1800.0
# what a reply may carry of a device's metrics (the strategy reads the first four; the energy is the phone's own meter)
DEVICE_METRICS = {NUM_EXAMPLES: int, "train_loss": float, "train_s": float, "train_tokens": float,
                  DEVICE_STEP_S: float, "measured_device_j": float}
# the phone's meter reaches the ledger as one more meter, source "device" (fedfusion.devices.meters owns the reply keys)
DEVICE_METER_KEY = WIRE_PREFIX + "device"


class DeviceDropped(RuntimeError):
    """The phone behind the gateway did not deliver before the deadline."""


def _gateway(node_config: Mapping[str, Any]) -> tuple[str, str, float]:
    url = str(node_config["gateway"]).rstrip("/")
    if "gateway-secret-file" not in node_config:
        raise ValueError("node config: gateway needs gateway-secret-file (the gateway's node secret)")
    secret = Path(str(node_config["gateway-secret-file"])).read_text().strip()
    return url, secret, float(node_config.get("gateway-deadline-s", DEADLINE_S))


def relay(state: dict[str, torch.Tensor], spec: ConfigRecord, partition: int,
          node_config: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict]:
    """Hand one train message to the gateway and wait for a phone's result; returns (state, metrics)."""
    url, secret, deadline_s = _gateway(node_config)
    role = RoleSpec.from_config(spec).role
    policy = SliceSpec.from_config(spec).policy if role in (SUBMODEL, WINDOW) else None
    if role not in (SUBMODEL, LORA, WINDOW) or policy == "ordered":
        raise ValueError(f"a device gateway serves width slices (role submodel, any policy but ordered), full-forward "
                         f"windows (role window) and LoRA adapters (role lora); this message is role {role!r}, "
                         f"policy {policy!r}")
    window = WindowSpec.from_config(spec) if role == WINDOW else None
    if window is not None and (window.rank or window.core):
        raise ValueError("a device window program trains a window of units in the target's forward pass: no rank-r "
                         "update (fusion.window_rank) and no core in the small model's (fusion.core_forward=small)")
    if any(".merged_" in k for k in state):
        raise ValueError("a device LoRA program has no input for a frozen merged update (m.merged_*: lora.method=flora)")
    # what a device needs of the message (the program holds the model): its data, training settings and round
    task_spec = merge(ClientSpec.from_config(spec), TrainSpec.from_config(spec), RoundSpec.from_config(spec),
                      *([window] if window is not None else []))
    task_spec["partition"] = partition
    meta: dict[str, Any] = {"spec": task_spec, "deadline_s": deadline_s}
    if role == LORA:  # the gateway's program is the adapter's on the frozen base; a device's data are pairs
        base, adapter = LoRABaseSpec.from_config(spec), AdapterSpec.from_config(spec)
        if base.lora_dropout:
            raise ValueError(f"lora dropout {base.lora_dropout}: a device program trains without dropout")
        meta[ADAPTER] = {"base": base.base, "target_modules": list(base.target_modules), "rank": adapter.rank,
                        "alpha": adapter.alpha, "bits": QuantizeSpec.from_config(spec).quantize}
        task_spec.update(merge(base))  # the device's tokenizer is the base's
    else:
        meta["model_config"] = ModelSpec.from_config(spec).model_config
    if window is not None:  # the gateway's program is the window's shape on the whole target; positions are inputs
        meta["window"] = True
    body = pack(state, meta)
    status, answer = call(f"{url}/v1/node/tasks", "POST", secret, body, timeout=SUBMIT_TIMEOUT_S)
    if status != 200:
        raise RuntimeError(f"gateway {url} refused the task ({status}): {answer.decode(errors='replace')[:300]}")
    task = json.loads(answer)["task"]
    end = time.monotonic() + deadline_s + 30  # the gateway drops the task at its deadline; this only guards a hang
    while time.monotonic() < end:
        status, answer = call(f"{url}/v1/node/tasks/{task}?wait=10", "GET", secret, timeout=60)
        if status == 200:
            tensors, meta = unpack(answer)
            if set(tensors) == set(state):  # in the order sent, which Flower's DP mods compare key lists in
                tensors = {k: tensors[k] for k in state}
            metrics = meta["metrics"]
            kept = {k: kind(metrics[k]) for k, kind in DEVICE_METRICS.items() if k in metrics}
            if "measured_device_j" in kept:
                kept[DEVICE_METER_KEY] = kept.pop("measured_device_j")
            return tensors, kept
        if status == 410:
            raise DeviceDropped(f"{DROPPED} {json.loads(answer)['reason']}")
        if status != 202:
            raise RuntimeError(f"gateway {url}: task {task} answered {status}: {answer.decode(errors='replace')[:300]}")
    raise DeviceDropped(f"{DROPPED} gateway {url} gave no outcome for task {task}")
