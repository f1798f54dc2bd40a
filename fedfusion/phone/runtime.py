"""Training through the ExecuTorch runtime only, as a phone does: the executable specification of the phone apps.

The program (:mod:`fedfusion.phone.program`) returns the loss and every parameter's gradient; nothing here
runs torch autograd. The optimizer is client code over ``named_gradients()``, writing into
``named_parameters()`` (views of the program's own parameter memory), because the runtime ships only SGD and a
federation needs AdamW. Torch tensors serve only as arrays here, as Kotlin ``FloatArray``\\s would on Android.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from fedfusion.data.text import sample_batch
from fedfusion.devices.energy import train_flops
from fedfusion.phone.program import WRAPPER, DeviceProgram, example_inputs
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


class ProgramRunner:
    """A loaded training program: put weights in, take forward+backward steps, read weights out."""

    def __init__(self, program: DeviceProgram) -> None:
        from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer
        from executorch.extension.training import TrainingModule

        self.program, self.manifest = program, program.manifest  # the runtime reads the buffers in place: keep them
        self.module = TrainingModule(_load_for_executorch_from_buffer(program.pte, program.ptd))
        self.method = str(self.manifest["method"])
        # The runtime exposes the parameter views only after a first call: one call on zero inputs, once per load.
        self.module.forward_backward(self.method, example_inputs(self.manifest))
        prefix = WRAPPER + "."
        self.params = {k.removeprefix(prefix): v for k, v in self.module.named_parameters().items()}
        expected = [p["name"] for p in self.manifest["parameters"]]
        if sorted(self.params) != sorted(expected):
            raise ValueError(f"program {self.manifest['program_id']}: its parameters differ from its manifest's")

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy ``weights`` (every parameter by name, its exact shape) into the program's parameter memory."""
        if set(weights) != set(self.params):
            missing, extra = sorted(set(self.params) - set(weights)), sorted(set(weights) - set(self.params))
            raise ValueError(f"weights differ from the program's parameters: missing {missing[:3]}, extra {extra[:3]}")
        for name, value in weights.items():
            if tuple(value.shape) != tuple(self.params[name].shape):
                raise ValueError(f"{name}: shape {tuple(value.shape)}, the program's is {tuple(self.params[name].shape)}")
            self.params[name].copy_(value)

    def weights(self) -> dict[str, torch.Tensor]:
        """A copy of the program's current parameters, by name."""
        return {k: v.clone() for k, v in self.params.items()}

    def forward_backward(self, *inputs: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
        """One step's loss and gradients (by parameter name) on ``inputs`` of the manifest's shapes."""
        loss = self.module.forward_backward(self.method, inputs)[0]
        prefix = WRAPPER + "."
        return float(loss), {k.removeprefix(prefix): v for k, v in self.module.named_gradients().items()}


def train_program(runner: ProgramRunner, windows: torch.Tensor, steps: int, lr: float, batch_size: int, seed: int,
                  weight_decay: float = 0.0, optimizer: str = "adamw") -> TrainResult:
    """:func:`fedfusion.train.loop.train_steps` through the runtime: the same seeded batches, the same optimizer,
    the same :class:`~fedfusion.train.loop.TrainResult` (``losses``: the loss of every step, for parity checks)."""
    shape = runner.manifest["inputs"][0]["shape"]
    if batch_size != shape[0] or windows.shape[1] != shape[1]:
        raise ValueError(f"batches of {batch_size} x {windows.shape[1]} tokens; the program takes {shape[0]} x {shape[1]}")
    gen = torch.Generator().manual_seed(seed)
    opt = ClientOptimizer(optimizer, lr, weight_decay)
    start, losses = time.perf_counter(), list[float]()
    for _ in range(steps):
        loss, grads = runner.forward_backward(sample_batch(windows, batch_size, gen))
        if not math.isfinite(loss):
            raise FloatingPointError(f"training loss became {loss}")
        opt.step(runner.params, grads)
        losses.append(loss)
    tokens = steps * batch_size * (windows.shape[1] - 1)
    params = sum(p.numel() for p in runner.params.values())
    return TrainResult(tuple(losses), float(tokens), time.perf_counter() - start, flops=train_flops(params, tokens))
