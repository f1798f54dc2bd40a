"""Training through the ExecuTorch runtime only, as a phone does: the executable specification of the phone apps.

The program (:mod:`fedfusion.phone.program`) returns the loss and every parameter's gradient; nothing here
runs torch autograd. The optimizer is client code over ``named_gradients()``, writing into
``named_parameters()`` (views of the program's own parameter memory), because the runtime ships only SGD and a
federation needs AdamW. Torch tensors serve only as arrays here, as Kotlin ``FloatArray``\\s would on Android.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fedfusion.devices.energy import train_flops
from fedfusion.phone.program import DTYPES, ROUND, WRAPPER, DeviceProgram, example_inputs
from fedfusion.train.instruct import IGNORE, InstructData
from fedfusion.train.loop import TrainResult


@dataclass
class ClientOptimizer:
    """AdamW (decoupled weight decay, bias-corrected moments) or SGD (weight decay added to the gradient), step for
    step what ``torch.optim.AdamW`` / ``torch.optim.SGD`` do with the defaults :mod:`fedfusion.train.loop` uses."""

    name: str
    lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    steps: int = 0
    moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "sgd"):
            raise ValueError(f"optimizer {self.name!r}: a device steps adamw or sgd")

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
        """Update ``params`` in place from ``grads`` (same names)."""
        self.steps += 1
        b1, b2 = self.betas
        for name, p in params.items():
            g = grads[name]
            if self.name == "sgd":
                p.sub_(g + self.weight_decay * p if self.weight_decay else g, alpha=self.lr)
                continue
            m, v = self.moments.setdefault(name, (torch.zeros_like(p), torch.zeros_like(p)))
            p.mul_(1 - self.lr * self.weight_decay)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / math.sqrt(1 - b2 ** self.steps)).add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / (1 - b1 ** self.steps))


# One call into the ExecuTorch binding at a time per process: two reference devices in one process (the tests') that
# loaded and ran programs from two threads at once froze the whole process, gateway threads included.
RUNTIME_LOCK = threading.Lock()


class ProgramRunner:
    """A loaded training program: put weights in, take forward+backward steps, read weights out."""

    def __init__(self, program: DeviceProgram) -> None:
        self.program, self.manifest = program, program.manifest  # the runtime reads the buffers in place: keep them
        data = self.manifest.get("data")
        if data and hashlib.sha256(program.ptd).hexdigest() != data["sha256"]:
            raise ValueError(f"program {self.manifest['program_id']}: its data file ({data['holds']}) does not match "
                             "the manifest's sha256")
        self.method = str(self.manifest["method"])
        # the program's parameter names -> the wire's (a slice's strip the wrapper; a LoRA program's are listed)
        self.names = {p.get("fqn", f"{WRAPPER}.{p['name']}"): p["name"] for p in self.manifest["parameters"]}
        # a window program's frozen target: where each tensor lies in the data file, which holds the only copy
        self.places = {p["name"]: p for p in self.manifest.get("window", {}).get("frozen", [])}
        self.frozen_id = ""  # what the data file holds there: "" the export's placeholders, else the caller's id
        self._load()
        # inputs given once a round and appended to every step's batch (a full-forward window's positions:
        # fedfusion.phone.window), in the manifest's order
        self.round_specs = [i for i in self.manifest["inputs"] if i.get("per") == ROUND]
        self.held: tuple[torch.Tensor, ...] = ()

    def _load(self) -> None:
        """Load the program with its data file, and take views of its parameters."""
        from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer
        from executorch.extension.training import TrainingModule

        with RUNTIME_LOCK:
            self.module = TrainingModule(_load_for_executorch_from_buffer(self.program.pte, self.program.ptd))
            # The runtime exposes the parameter views only after a first call: one call on zero inputs, once per load.
            self.module.forward_backward(self.method, example_inputs(self.manifest))
        named = self.module.named_parameters()
        if sorted(named) != sorted(self.names):
            raise ValueError(f"program {self.manifest['program_id']}: its parameters differ from its manifest's")
        self.params = {self.names[k]: v for k, v in named.items()}

    def set_frozen(self, frozen: Mapping[str, torch.Tensor], frozen_id: str) -> None:
        """Write a window program's frozen target (every tensor of the manifest's ``window.frozen`` by name, its
        exact shape and dtype, as it travelled) into its places in the data file and reload the program: the data
        file is then the device's one copy of it (the runtime reads it in place), under ``frozen_id``. Load the
        round's weights after this: a reload starts from the program's initial ones. Memory at its peak: the old data
        file, the new one and ``frozen``. If the reload fails the runner holds no program: drop it (the reference
        device does) and load the program afresh."""
        if set(frozen) != set(self.places):
            missing, extra = sorted(set(self.places) - set(frozen)), sorted(set(frozen) - set(self.places))
            raise ValueError(f"frozen target differs from the program's: missing {missing[:3]}, extra {extra[:3]}")
        old, pieces, at = memoryview(self.program.ptd), list[Any](), 0
        for place in sorted(self.places.values(), key=lambda p: p["offset"]):
            got = frozen[place["name"]]
            if list(got.shape) != place["shape"] or DTYPES.get(got.dtype) != place["dtype"]:
                raise ValueError(f"{place['name']}: {got.dtype} {tuple(got.shape)}, the program takes "
                                 f"{place['dtype']} {tuple(place['shape'])}")
            pieces += [old[at:place["offset"]], got.contiguous().view(torch.uint8).numpy()]
            at = place["offset"] + place["bytes"]
        pieces.append(old[at:])
        del self.module, self.params  # the old program's runtime memory goes before the new one is loaded
        self.frozen_id = ""  # until the reload succeeds the data file holds no target under any id
        ptd = b"".join(pieces)
        del old, pieces
        self.program = replace(self.program, ptd=ptd)
        self._load()
        self.frozen_id = frozen_id

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy ``weights`` (every parameter by name, its exact shape) into the program's parameter memory."""
        if set(weights) != set(self.params):
            missing, extra = sorted(set(self.params) - set(weights)), sorted(set(weights) - set(self.params))
            raise ValueError(f"weights differ from the program's parameters: missing {missing[:3]}, extra {extra[:3]}")
        for name, value in weights.items():
            if tuple(value.shape) != tuple(self.params[name].shape):
                raise ValueError(f"{name}: shape {tuple(value.shape)}, the program's is {tuple(self.params[name].shape)}")
            self.params[name].copy_(value)

    def hold(self, inputs: dict[str, torch.Tensor]) -> None:
        """Keep ``inputs`` (every per-round input by name, its exact shape and dtype) for this round's steps."""
        names = [i["name"] for i in self.round_specs]
        if set(inputs) != set(names):
            missing, extra = sorted(set(names) - set(inputs)), sorted(set(inputs) - set(names))
            raise ValueError(f"round inputs differ from the program's: missing {missing[:3]}, extra {extra[:3]}")
        for spec in self.round_specs:
            got = inputs[spec["name"]]
            if list(got.shape) != spec["shape"] or DTYPES.get(got.dtype) != spec["dtype"]:
                raise ValueError(f"{spec['name']}: {got.dtype} {tuple(got.shape)}, the program takes "
                                 f"{spec['dtype']} {tuple(spec['shape'])}")
        self.held = tuple(inputs[n].contiguous() for n in names)

    def weights(self) -> dict[str, torch.Tensor]:
        """A copy of the program's current parameters, by name."""
        return {k: v.clone() for k, v in self.params.items()}

    def forward_backward(self, *inputs: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
        """One step's loss and gradients (by parameter name) on ``inputs`` of the manifest's shapes (the per-batch
        ones: the per-round inputs are those :meth:`hold` keeps)."""
        if self.round_specs and not self.held:
            raise ValueError(f"program {self.manifest['program_id']} takes per-round inputs: hold() them first")
        with RUNTIME_LOCK:
            loss = self.module.forward_backward(self.method, (*inputs, *self.held))[0]
            grads = {self.names[k]: v for k, v in self.module.named_gradients().items()}
        return float(loss), grads


def batch_inputs(runner: ProgramRunner, data: torch.Tensor | InstructData, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The program's inputs for the rows ``rows`` of ``data``: token windows as they are; instruction rows
    (:meth:`InstructData.rows`, trimmed to the batch's longest) right-padded to the program's length (pad id 0,
    label -100, mask 0: the loss and, under causal attention, every real token's logits are unchanged)."""
    if isinstance(data, torch.Tensor):
        return (data[rows],)
    width = int(runner.manifest["inputs"][0]["shape"][1])
    ids, labels, mask = data.rows(rows)
    pad = width - ids.shape[1]
    if pad < 0:
        raise ValueError(f"instruction rows of {ids.shape[1]} tokens; the program takes {width}")
    pad_to = torch.nn.functional.pad
    return pad_to(ids, (0, pad)), pad_to(labels, (0, pad), value=IGNORE), pad_to(mask, (0, pad))


def train_program(runner: ProgramRunner, data: torch.Tensor | InstructData, steps: int, lr: float, batch_size: int,
                  seed: int, weight_decay: float = 0.0, optimizer: str = "adamw") -> TrainResult:
    """:func:`fedfusion.train.loop.train_steps` through the runtime: the same seeded batches, the same optimizer,
    the same :class:`~fedfusion.train.loop.TrainResult` (``losses``: the loss of every step, for parity checks).
    ``data``: token windows for a slice's program, :class:`InstructData` for a LoRA adapter's (whose tokens are the
    batch's real ones, as :class:`fedfusion.train.instruct.ResponseLoss` counts them)."""
    shape = runner.manifest["inputs"][0]["shape"]
    windows = isinstance(data, torch.Tensor)
    width = data.shape[1] if isinstance(data, torch.Tensor) else shape[1]
    if batch_size != shape[0] or width != shape[1]:
        raise ValueError(f"batches of {batch_size} x {width} tokens; the program takes {shape[0]} x {shape[1]}")
    gen = torch.Generator().manual_seed(seed)
    opt = ClientOptimizer(optimizer, lr, weight_decay)
    start, losses, tokens = time.perf_counter(), list[float](), 0
    for _ in range(steps):
        inputs = batch_inputs(runner, data, torch.randint(len(data), (batch_size,), generator=gen))
        loss, grads = runner.forward_backward(*inputs)
        if not math.isfinite(loss):
            raise FloatingPointError(f"training loss became {loss}")
        opt.step(runner.params, grads)
        losses.append(loss)
        tokens += batch_size * (shape[1] - 1) if windows else int(inputs[2].sum())
    params = sum(p.numel() for p in runner.params.values()) + _frozen_params(runner.manifest)
    return TrainResult(tuple(losses), float(tokens), time.perf_counter() - start, flops=train_flops(params, tokens))


def _frozen_params(manifest: dict[str, Any]) -> int:
    """The frozen base's parameters a LoRA program computes through (0 for a slice's)."""
    return int(manifest.get("adapter", {}).get("base_params", 0))
