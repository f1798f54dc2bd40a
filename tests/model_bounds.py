"""A language model's training step in float64, with the first-order bounds on what a float32 computation of its loss
and gradient may be off by, for the parity tests of the device programs (tests/test_device*.py): each step a loop
took (the runtime's, torch's) is checked at the values it held then against :class:`ExactLM` on that step's batch.

Why per step and not the loops' values after the steps: AdamW divides each coordinate's step by its own gradient's
size, so a coordinate whose gradient is near ``eps`` moves by up to ``lr / eps`` times its gradient's rounding, and
that difference reaches every later gradient through the Hessian; no rounding bound of the trajectories is less
than the steps themselves. At each step's own values both loops compute one function, which is what is bounded.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from fp_bounds import assert_within, cross_entropy_bound, gamma

F32 = torch.float32
IGNORE = -100  # the label of a token the loss leaves out (fedfusion.train.instruct)
State = dict[str, torch.Tensor]
Step = tuple[State, State]  # the values a loop held at a step and the gradient it computed there


@dataclass
class Exact:
    """A step's loss and gradient in float64, with the first-order bounds on a float32 computation's error."""

    loss: float
    grads: State
    loss_bound: float
    grad_bounds: State


def _rms_norm(self: Any, x: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm's forward without its float32 cast, so the reference stays float64."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


class ExactLM:
    """The next-token loss and gradient of a model of ``config`` in float64, at any values of its trained tensors:
    all of ``base`` (a wire state), or with ``plan`` a window of it (the frozen rest as ``base`` holds it, the
    window's values written in, as :class:`~fedfusion.models.full_forward.WindowModel` trains it); and how far a
    float32 computation of them from the same inputs may be off, whatever the order of its sums.

    Loss: the forward is a chain of matrix products ``y = x W^T`` (GPT-2's ``x W``), each entry within
    ``gamma_k (|x||W|)`` of exact (``k`` the layer's input width; :mod:`fp_bounds`); to first order each product's
    error reaches the loss through ``dL/dy``, so the products contribute at most
    ``sum_layers <|dL/dy|, gamma_k |x||W|>``. The ops between them (norms, rotary tables, attention's own products
    and softmax, activations, residual adds) round the entries those products consume a bounded number of times at
    the same magnitudes: doubling the products' term stands for them (stated, not derived op by op). The last step,
    the mean cross-entropy, is :func:`fp_bounds.cross_entropy_bound`.

    Gradient: an entry's gradient is a sum over the ``N`` tokens of products of ``dL/dy`` and the layer's input
    (``|dY|^T |X|`` its magnitudes; for a norm's weight ``sum |dY| |x_hat|``, for a bias ``sum |dY|``; for an
    embedding row the sum over its tokens of the residual stream's gradient, which is what the normalisations
    reading the stream send back, each term of their backward taken absolutely: :func:`_norm_input`). Its error,
    to first order, gathers the roundings of the path from the loss to it and back: forward through every layer
    (its input width), backward through every layer (its output width), then the ``N`` tokens' sum, so
    ``gamma_chain`` with ``chain`` their total, applied to that magnitude (stated: the magnitudes along the path
    are taken at the gradient's own)."""

    def __init__(self, config: Any, base: State, plan: Any = None, model: torch.nn.Module | None = None,
                 trained: dict[str, str] | None = None, dtype: torch.dtype = F32, roundings: int = 0) -> None:
        """``model`` and ``trained``: a model to take as it is (in float64; its frozen tensors its own) and, for each
        name a loop trains, the model's parameter that holds it (a LoRA adapter's factors); ``config`` and ``base``
        are then unused. ``dtype``: the precision of the computations bounded (float64: two float64 computations
        of one step, each within the bound); ``roundings``: further roundings of each gradient entry by the loop
        beyond the model's own (a micro-batch's share scaling it)."""
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        from fedfusion.models.build import config_aliases, tied_aliases
        from fedfusion.models.families import family_of
        from fedfusion.models.slicing import tensor_slices

        self.trained = trained or {}
        self.config, self.plan, self.dtype, self.roundings = config, plan, dtype, roundings
        self.aliases = {} if model is not None else config_aliases(config)
        self.base = {k: v.double() for k, v in base.items()}
        self.slices = tensor_slices([n for n in self.base if n not in self.aliases], config, plan) if plan else {}
        self.model = (model if model is not None else family_of(config).build(config)).double().eval()
        self.model.requires_grad_(True)  # every layer's output gradient, for the magnitudes
        self.tied = tied_aliases(self.model)
        self.names = {m: n for n, m in self.model.named_modules()}
        self.seen: list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor]] = []
        for module in self.model.modules():
            if isinstance(module, LlamaRMSNorm):
                module.forward = _rms_norm.__get__(module)
            if list(module.parameters(recurse=False)):
                assert _kind(module), f"no gradient magnitude for {type(module).__name__}"
                module.register_forward_hook(self._record)

    def _record(self, module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], y: torch.Tensor) -> None:
        y.retain_grad()
        self.seen.append((module, inputs[0], y))

    def at(self, theta: State, batch: torch.Tensor | tuple[torch.Tensor, ...]) -> Exact:
        """The loss and gradient at trained values ``theta`` (by name; a window's by sub-model name) on ``batch``:
        token windows, or instruction rows ``(ids, labels, mask)`` whose loss is on the labelled tokens only."""
        from fedfusion.models.slicing import extract

        self._load(theta)
        self.model.zero_grad(set_to_none=True)
        self.seen.clear()
        if isinstance(batch, torch.Tensor):
            logits, labels = self.model(input_ids=batch[:, :-1]).logits, batch[:, 1:]
        else:
            ids, labels, mask = batch
            logits, labels = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1], labels[:, 1:]
        logits, labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE)
        loss.backward()
        products, chain, size = 0.0, labels.numel(), dict[str, torch.Tensor]()
        # the residual stream's gradient (the embeddings') is the sum of what each normalisation reading it sends back
        stream = sum(_norm_input(m, x, y.grad.abs()) for m, x, y in self.seen if _kind(m) == "norm")
        for module, x, y in self.seen:
            name, dy = self.names[module], stream if _kind(module) == "lookup" else y.grad.abs()
            for key, value in _magnitudes(module, x, dy).items():
                size[f"{name}.{key}"] = value
            if _kind(module) == "matmul":
                w = module.weight.detach().abs()
                w = w.T if isinstance(module, torch.nn.Linear) else w  # (in, out)
                products += gamma(w.shape[0], self.dtype) * float((dy * (x.detach().abs() @ w)).sum())
                chain += sum(w.shape)
        for alias, key in self.tied.items():  # a tied tensor's gradient sums both uses
            size[key] = size[key] + size.pop(alias)
        grads = {n: p.grad for n, p in self.model.named_parameters()}
        if self.plan:
            grads, size = extract(grads, self.config, self.plan), extract(size, self.config, self.plan)
        name = {k: self.trained.get(k, k) for k in theta}
        kept = labels != IGNORE
        return Exact(float(loss.detach()), {k: grads[name[k]] for k in theta},
                     cross_entropy_bound(logits[kept], labels[kept], self.dtype) + 2 * products,
                     {k: gamma(chain + self.roundings, self.dtype) * size[name[k]] for k in theta})

    def _load(self, theta: State) -> None:
        """The model holding ``theta``: written into the trained parameters, or into the base (a window's into its
        coordinates) and loaded."""
        from fedfusion.models.build import full_state
        from fedfusion.models.slicing import scatter

        if self.trained:
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for k, value in theta.items():
                    params[self.trained[k]].copy_(value)
            return
        state = {k: v.clone() for k, v in self.base.items()}
        for name, sl in self.slices.items():
            scatter(state[name], sl.index, theta[sl.sub_name].double(), accumulate=False)
        if not self.plan:
            state.update({k: v.double() for k, v in theta.items()})
        self.model.load_state_dict(full_state(state, self.aliases))


def float64_norms(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every LlamaRMSNorm computing in its input's dtype: HF's casts to float32 whatever the model's
    dtype, so a "float64" model would round its normalisations (and their backward) to float32, and two float64
    computations of one step could differ by a float32 ulp wherever an input sits on a float32 rounding boundary;
    with this a float64 step rounds in float64 only, and float64's bounds apply."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for module in model.modules():
        if isinstance(module, LlamaRMSNorm):
            module.forward = _rms_norm.__get__(module)
    return model


def adamw_first_step_bound(grad: torch.Tensor, grad_diff: torch.Tensor, param: torch.Tensor, lr: float,
                           eps: float = 1e-8, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Entry-wise bound on ``|p_a - p_b|`` after torch's AdamW's first step from the same values, ``p_a`` (``param``)
    with gradient ``g_a`` (``grad``), ``p_b`` with ``g_b``, ``|g_a - g_b| <= grad_diff``, in ``dtype``.

    The decay ``p (1 - lr wd)`` is one computation on equal inputs: equal. The first step's moments are
    ``m_hat = g``, ``v_hat = g^2`` (bias-corrected), so the update is ``h(g) = lr g / (|g| + eps)``, with
    ``|h'(g)| = lr eps / (|g| + eps)^2``, largest where ``|g|`` is least: over the segment from ``g_a`` to ``g_b``,
    ``|g| >= max(|g_a| - grad_diff, 0)``, hence the first term (to first order: the optimizer's constants are
    rounded, 1 + O(u) each). Each side then rounds its update at most 12 times relative to ``|h| <= lr`` (the two
    moments, sqrt, the bias corrections, eps, the division, the scaling: ``gamma_12 lr``) and the final add once
    relative to the new value (``u |p|`` of either side's: ``gamma_2 |p_a|``); twice each for the two sides."""
    g, d = grad.detach().double().abs(), torch.as_tensor(grad_diff, dtype=torch.float64)
    through = lr * eps * d / ((g - d).clamp_min(0) + eps) ** 2
    return through + 2 * gamma(12, dtype) * lr + 2 * gamma(2, dtype) * param.detach().double().abs()


def _kind(module: torch.nn.Module) -> str | None:
    """How a module's parameters enter the loss: a matrix product, a lookup, a normalisation's scale (None: unknown)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, (torch.nn.Linear, Conv1D)):
        return "matmul"
    if isinstance(module, torch.nn.Embedding):
        return "lookup"
    return "norm" if isinstance(module, (LlamaRMSNorm, torch.nn.LayerNorm)) else None


def _hat(module: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A normalisation's normalised input ``x_hat`` and ``1 / rms`` (of the centred input for LayerNorm)."""
    x = x.detach()
    if isinstance(module, torch.nn.LayerNorm):
        x = x - x.mean(-1, keepdim=True)
        eps = module.eps
    else:
        eps = module.variance_epsilon
    inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * inv, inv


def _norm_input(module: Any, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The magnitudes of a normalisation's input gradient ``(w dy - x_hat mean(w dy x_hat)) / rms`` (LayerNorm also
    subtracts ``mean(w dy)``), each term taken absolutely: the sums its backward rounds."""
    hat, inv = _hat(module, x)
    w = module.weight.detach().abs() * dy
    out = w + hat.abs() * (w * hat.abs()).mean(-1, keepdim=True)
    if isinstance(module, torch.nn.LayerNorm):
        out = out + w.mean(-1, keepdim=True)
    return out * inv


def _magnitudes(module: Any, x: torch.Tensor, dy: torch.Tensor) -> State:
    """The magnitudes that each of the module's parameters' gradient sums over the tokens (``dy``: ``|dL/dy|``)."""
    kind, dy2 = _kind(module), dy.reshape(-1, dy.shape[-1])
    out = {"bias": dy2.sum(0)} if getattr(module, "bias", None) is not None else {}
    if kind == "matmul":
        xs = x.detach().abs().reshape(-1, x.shape[-1])
        return {**out, "weight": dy2.T @ xs if isinstance(module, torch.nn.Linear) else xs.T @ dy2}
    if kind == "lookup":
        ids = x.expand(dy.shape[:-1]).reshape(-1)  # GPT-2's positions: one row for the batch
        return {**out, "weight": torch.zeros_like(module.weight).index_add_(0, ids, dy2)}
    return {**out, "weight": (dy2 * _hat(module, x)[0].abs().reshape(dy2.shape)).sum(0)}


def batches(windows: torch.Tensor, steps: int, batch: int, seed: int) -> list[torch.Tensor]:
    """The batches the training loops draw, step by step (their seeded generator)."""
    gen = torch.Generator().manual_seed(seed)
    return [windows[torch.randint(len(windows), (batch,), generator=gen)] for _ in range(steps)]


def assert_steps(exact: ExactLM, steps: Sequence[Step], losses: Sequence[float], drawn: Sequence[torch.Tensor],
                 times: float = 1.0) -> float:
    """Every step's loss and gradient, at the values the loop held then, within ``times`` the bounds of the exact
    ones on that step's batch (2 where the loop computes in the reference's own precision: float64 against float64,
    each within the bound of the exact value). Returns the worst ratio of difference to bound."""
    assert len(steps) == len(losses) == len(drawn)
    worst = 0.0
    for (theta, grads), loss, batch in zip(steps, losses, drawn):
        want = exact.at(theta, batch)
        worst = max(worst, assert_within(torch.tensor(loss), torch.tensor(want.loss), times * want.loss_bound))
        assert set(grads) == set(want.grads)
        for k, g in grads.items():
            worst = max(worst, assert_within(g, want.grads[k], times * want.grad_bounds[k]))
    return worst


@contextmanager
def optimizer_steps(params: dict[str, torch.nn.Parameter]) -> Iterator[list[Step]]:
    """The values of ``params`` and their gradients at each torch optimizer step taken inside the block."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    seen: list[Step] = []

    def record(*_: Any) -> None:
        seen.append(({k: p.detach().clone() for k, p in params.items()},
                     {k: p.grad.detach().clone() for k, p in params.items()}))

    hook = register_optimizer_step_pre_hook(record)
    try:
        yield seen
    finally:
        hook.remove()


@contextmanager
def runtime_steps(runner: Any) -> Iterator[list[Step]]:
    """The values a :class:`~fedfusion.phone.runtime.ProgramRunner` held and the gradient it computed at each of its
    forward-backward passes inside the block."""
    seen: list[Step] = []
    step = runner.forward_backward

    def recorded(*inputs: torch.Tensor) -> tuple[float, State]:
        before = {k: v.clone() for k, v in runner.params.items()}
        loss, grads = step(*inputs)
        seen.append((before, {k: g.clone() for k, g in grads.items()}))
        return loss, grads

    runner.forward_backward = recorded
    try:
        yield seen
    finally:
        del runner.forward_backward


def assert_replayed(start: State, steps: Sequence[Step], final: State, optimizer: str, lr: float) -> None:
    """The runtime's loop stepped by the gradients it computed: the phone's optimizer, replayed from ``start`` over
    them, passes through every step's values and ends at ``final``, bit for bit (its parity with torch.optim:
    tests/test_device.py), having moved."""
    from fedfusion.phone.runtime import ClientOptimizer

    replay, opt = {k: v.clone() for k, v in start.items()}, ClientOptimizer(optimizer, lr)
    for values, grads in steps:
        assert all(torch.equal(replay[k], v) for k, v in values.items())
        opt.step(replay, grads)
    assert all(torch.equal(replay[k], final[k]) for k in start)
    assert any(not torch.equal(replay[k], v) for k, v in start.items())


def _norm_error(module: Any, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Entry-wise first-order bound on the rounding error of a normalisation's output in ``dtype``, its input
    ``x`` exact: its statistics sum ``n`` entries (the last dim; a GroupNorm's group), so the mean is off by
    ``gamma_n mean|x|`` (reaching the output as ``|w| mean|x| / sigma``), the variance, ``+ eps``, the reciprocal
    square root and the products by ``gamma_{n+5}`` relatively (``|w x_hat|``), the bias add once more: all within
    ``gamma_{n+7} (|w| (mean|x| / sigma + |x_hat|) + |b|)`` (an RMSNorm centres nothing: its mean term is 0)."""
    x = x.detach().double()
    w = module.weight.detach().double().abs() if getattr(module, "weight", None) is not None else torch.ones(())
    b = module.bias.detach().double().abs() if getattr(module, "bias", None) is not None else torch.zeros(())
    if isinstance(module, torch.nn.GroupNorm):
        groups = x.reshape(x.shape[0], module.num_groups, -1)
        centred = groups - groups.mean(-1, keepdim=True)
        inv = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + module.eps)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        hat = (centred * inv).reshape(x.shape).abs()
        spread = (groups.abs().mean(-1, keepdim=True) * inv).expand_as(groups).reshape(x.shape)
        return gamma(groups.shape[-1] + 7, dtype) * (w.reshape(shape) * (spread + hat) + b.reshape(shape))
    hat, inv = _hat(module, x)
    spread = x.abs().mean(-1, keepdim=True) * inv if isinstance(module, torch.nn.LayerNorm) else torch.zeros(())
    return gamma(x.shape[-1] + 7, dtype) * (w * (spread + hat.abs()) + b)


def _product_error(module: Any, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Entry-wise bound on the rounding error of a matrix product or convolution's output in ``dtype``, its input
    ``x`` exact: ``gamma_{k+1} (|x| |W| + |b|)``, ``k`` the length of each output entry's sum (a convolution's
    ``in_channels / groups x kernel``), the bias add one rounding more (fp_bounds.matmul_bound's argument)."""
    from transformers.pytorch_utils import Conv1D

    x, w = x.detach().double().abs(), module.weight.detach().double().abs()
    b = module.bias.detach().double().abs() if module.bias is not None else None
    if isinstance(module, torch.nn.Conv2d):
        k = w[0].numel()
        size = torch.nn.functional.conv2d(x, w, b, module.stride, module.padding, module.dilation, module.groups)
    else:
        k = w.shape[0] if isinstance(module, Conv1D) else w.shape[1]
        size = x @ (w if isinstance(module, Conv1D) else w.T) + (b if b is not None else 0)
    return gamma(k + 1, dtype) * size


def output_bound(run: Any, x: torch.Tensor, root: torch.nn.Module, dtype: torch.dtype = torch.float64,
                 chunk: int = 256) -> torch.Tensor:
    """Entry-wise first-order bound on how far ``run(x)`` (a computation in ``dtype`` by the modules under ``root``
    from exact inputs ``x``, its examples along the first dim of ``x`` and of the output, each computed from its own)
    may be off the exact value, whatever the order of its sums.

    The rounding of every matrix product and convolution (:func:`_product_error`) and normalisation
    (:func:`_norm_error`) reaches each output entry through that entry's derivative with respect to the op's output,
    so an entry is off by at most ``sum_ops <|d out_i / d y|, error(y)>``; the ops between them (attention's products
    and softmax, rotary tables, activations, residual adds, pooling) round the entries those ops consume a bounded
    number of times at the same magnitudes: doubling stands for them, as in :class:`ExactLM` (stated, not derived op
    by op). The derivatives are each entry's own: ``x`` is run as ``chunk`` copies stacked along the batch, copy
    ``r``'s backward seeded at the ``r``-th entry of every example, so one backward yields ``chunk`` rows of the
    Jacobian of every example. First order: a kink (ReLU, max-pooling) is taken on the side the computed value sits.
    Two computations of one exact value, each within its bound, are within the sum of the two bounds of each other."""
    from transformers.pytorch_utils import Conv1D

    norms = (torch.nn.LayerNorm, torch.nn.GroupNorm)

    def is_norm(module: torch.nn.Module) -> bool:
        return isinstance(module, norms) or type(module).__name__.endswith("RMSNorm")

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], y: torch.Tensor) -> None:
        # HF's RMSNorm computes in float32 whatever its input (float64_norms: in its input's dtype)
        own = torch.float32 if type(module).__name__.endswith("RMSNorm") and "forward" not in vars(module) else dtype
        # the examples along the first dim (or leading dims flattened into it: OPT's MLP): one copy's rows
        assert y.shape[0] % chunk == 0, "an op's output does not keep the examples first"
        x = inputs[0][: y.shape[0] // chunk]
        seen.append((y, _norm_error(module, x, own) if is_norm(module) else _product_error(module, x, dtype)))

    watched = [m for m in root.modules() if isinstance(m, (torch.nn.Linear, Conv1D, torch.nn.Conv2d)) or is_norm(m)]
    examples = x.shape[0]
    with torch.no_grad():
        shape = tuple(run(x).shape)
    size = math.prod(shape) // examples  # each example's output entries
    chunk = min(chunk, size)
    bound = torch.zeros(examples, size, dtype=torch.float64)
    for start in range(0, size, chunk):
        hooks = [m.register_forward_hook(record) for m in watched]
        seen.clear()
        try:
            with torch.enable_grad():
                full = run(x.repeat(chunk, *(1,) * (x.dim() - 1)))
        finally:
            for hook in hooks:
                hook.remove()
        assert seen, "no product or normalisation under root ran"
        out = full.reshape(chunk, examples, size)
        rows = torch.arange(start, min(start + chunk, size))
        seed = torch.zeros_like(out)
        seed[torch.arange(len(rows)), :, rows] = 1
        grads = torch.autograd.grad(out, [y for y, _ in seen], seed, allow_unused=True)
        for g, (_, error) in zip(grads, seen):
            if g is not None:
                terms = (g.detach().double().reshape(chunk, examples, -1).abs() * error.reshape(examples, -1)).sum(-1)
                bound[:, rows] += terms[: len(rows)].T
    return 2 * bound.reshape(shape)
