"""On-device training programs for full-forward windows (``fusion.forward=full``): the device runs the whole frozen
target and trains only a window of its units (heads, neurons, and with ``window_shared`` the embeddings and norms)
with the exact gradient of the target's loss, as :class:`fedfusion.models.full_forward.WindowModel` does in torch.

What changes each round, and how the program takes it:

- the window's **values** (a tier's window has one shape for the whole run: every policy gives a width the same
  number of units) are the program's trainable parameters, loaded into its parameter memory each round by name,
  like a width slice's weights (:class:`fedfusion.phone.runtime.ProgramRunner`);
- the **frozen target** (other clients' folds change it every round) and the window's **positions** (the rolling
  policy moves them every round) are program **inputs**, given again with every step's batch. ExecuTorch's
  training API exposes as writable memory only the parameters that get a gradient (``named_parameters()`` lists
  the joint graph's ``GRADIENT_TO_PARAMETER`` outputs); frozen weights baked into the program or its data file
  are read-only constants. Making the target a parameter would compute and hold its whole gradient each step, so
  inputs are the one place a per-round frozen target fits. The positions are the window's unit indices per sliced
  axis, as :class:`~fedfusion.wire.specs.WindowSpec` carries them; the program expands them into each tensor's
  coordinates (``units * block + arange(block)``, per part) and writes the window's values there with
  ``index_copy`` (whose backward is an ``index_select`` of the gradient: the window's exact gradient).

The frozen target enters the program as it travelled (``fusion.frozen_dtype``, the program's too): int8 (or
packed int4) codes and float16 scales of every matrix, float16 vectors (float16 or float32 tensors for those
formats), named as the wire names them. The program dequantises them itself (:func:`_dequantized`: casts and a
multiply, exact), so a device keeps the target only as it arrived, keyed by its hash, until a task names another
(:mod:`fedfusion.phone.gateway` sends it only then), and never holds a float32 copy of it; the runtime copies the
inputs into the program's planned memory at each step, so that memory holds the narrow target a second time.
Tensors the window covers whole (the shared tensors with ``window_shared``) are parameters only, not inputs.

A core window (``fusion.window_core``) exports where each window is drawn outside the core
(``fusion.window_outside_core``): core + window then has one shape every round. Not built: windows over the depth
axis (the window's layers would change which target tensor each of its tensors is), a core whose window rolls over
every unit (its union with the core changes size), ``core_forward=small`` and ``fusion.window_rank`` (low-rank
updates): ``fedfusion export-device`` refuses them in one line (:func:`fedfusion.phone.commands.check_window`).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from fedfusion.config.sections import TrainConfig
from fedfusion.models.build import config_aliases, wire_state
from fedfusion.models.families import config_from_dict, family_of
from fedfusion.models.full_forward import window_plan
from fedfusion.models.slicing import SlicePlan, axis_sizes, extract, tensor_slices
from fedfusion.phone.program import DTYPE_BYTES, DTYPES, LM_LOSS, ROUND, DeviceExportError, DeviceProgram, _lower, _manifest, example_inputs
from fedfusion.wire.keys import FROZEN
from fedfusion.wire.quantize import BLOCK, CODES, SHAPE, encode
from fedfusion.wire.specs import WindowSpec

UNITS = "units/"  # the prefix of a window position input's name: units/<axis>
WINDOW_DATA = "the window's initial values"
State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class _Written:
    """How one window tensor is written into the target: its name, its parameter's key, and the one dim its
    window slices (None: the window holds it whole) with that dim's axis, block, parts and units on the axis."""

    name: str
    key: str
    dim: int | None = None
    axis: str = ""
    block: int = 1
    parts: int = 1
    size: int = 0


@dataclass(frozen=True)
class _Frozen:
    """How one frozen target tensor arrives among the program's inputs: its name, and for quantised codes the
    tensor's shape and whether the codes are packed int4 (two to a uint8); dense tensors come as one input."""

    name: str
    shape: tuple[int, ...] | None = None
    packed4: bool = False


def _dequantized(codes: torch.Tensor, scale: torch.Tensor, shape: tuple[int, ...], packed4: bool) -> torch.Tensor:
    """The float32 tensor of ``shape`` that wire codes and their float16 block scales stand for, as
    :func:`fedfusion.wire.quantize.dequantize` computes it, by core ATen ops the portable runtime has (casts, a
    multiply; a packed int4 byte is split with a divide, a floor and a subtract). Exact: a small integer times a
    float16 scale is a float32, so the program's values equal the torch client's bit for bit."""
    values = codes.float()
    if packed4:  # low nibble first, each stored +8
        high = torch.floor(values / 16)
        values = torch.stack([values - 16 * high, high], 1).flatten() - 8
    blocks = values.view(scale.shape[0], BLOCK) * scale.float().unsqueeze(1)
    return blocks.flatten()[:math.prod(shape)].view(shape)


def _coordinates(units: torch.Tensor, w: _Written) -> torch.Tensor:
    """The coordinates ``units`` own along ``w``'s dim (what :func:`fedfusion.models.slicing.tensor_slices` gives)."""
    index = (units.unsqueeze(1) * w.block + torch.arange(w.block)).reshape(-1)
    if w.parts == 1:
        return index
    return torch.cat([index + p * w.size * w.block for p in range(w.parts)])


class _WindowLoss(torch.nn.Module):
    """The exported computation: a batch of token windows, the window's positions and the frozen target (as it
    travelled) in; the target's mean next-token loss, with the window's values (the only parameters) written in, out."""

    def __init__(self, config: PretrainedConfig, window: State, written: list[_Written], axes: list[str],
                 frozen: list[_Frozen]) -> None:
        super().__init__()
        self.window = torch.nn.ParameterDict({w.key: torch.nn.Parameter(window[w.name].clone()) for w in written})
        self.written, self.axes, self.frozen = written, axes, frozen
        model = family_of(config).build(config).requires_grad_(False)
        self._model = [model]  # a list: the target's own tensors are replaced, never parameters of the program

    def forward(self, tokens: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        units = dict(zip(self.axes, rest))
        parts = iter(rest[len(self.axes):])
        tensors = {}
        for f in self.frozen:
            data = next(parts)
            tensors[f.name] = data.float() if f.shape is None else _dequantized(data, next(parts), f.shape, f.packed4)
        for w in self.written:
            value = self.window[w.key]
            tensors[w.name] = value if w.dim is None else tensors[w.name].index_copy(
                w.dim, _coordinates(units[w.axis], w), value)
        out = torch.func.functional_call(self._model[0], tensors, args=(), kwargs={"input_ids": tokens[:, :-1]})
        logits = out.logits.float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def window_program_key(config: PretrainedConfig, plan: SlicePlan, batch_size: int, seq_len: int,
                       frozen_dtype: str) -> str:
    """A name for a window's program before exporting it: a hash of the target config, the window's shape (units
    per axis, shared or not), the input shape, the frozen target's format and the ExecuTorch version."""
    from executorch.version import __version__ as et_version

    shape = {a: len(plan.units(a) or ()) for a in family_of(config).axes}
    text = json.dumps(["window", config.to_dict(), shape, plan.shared, batch_size, seq_len, frozen_dtype, et_version],
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _layout(config: PretrainedConfig, names: list[str], plan: SlicePlan) -> tuple[list[_Written], list[str], list[str]]:
    """The window's tensors as :class:`_Written`, the axes it slices (each a units input) and the frozen tensors the
    program takes (every target tensor the window does not hold whole)."""
    family, sizes = family_of(config), axis_sizes(config)
    if len(plan.units("depth") or ()) != sizes.get("depth", 0):
        raise DeviceExportError("full-forward window over the depth axis: its layers change each round, and with "
                                "them which target tensor each window tensor is; a program takes windows of units")
    sliced = [a for a in family.axes if len(plan.units(a) or ()) < sizes[a]]
    written = []
    for i, (name, sl) in enumerate(tensor_slices(names, config, plan).items()):
        dims = [d for d, index in enumerate(sl.index) if index is not None]
        if not dims:
            written.append(_Written(name, f"w{i}"))
            continue
        if len(dims) > 1:
            raise DeviceExportError(f"full-forward window: {name} is sliced on {len(dims)} dims; a program writes "
                                    "a window tensor along one")
        rule = family.rule(name, config).dims[dims[0]]
        assert rule is not None  # a sliced dim lies on an axis
        written.append(_Written(name, f"w{i}", dims[0], rule.axis, rule.block, rule.parts, sizes[rule.axis]))
    whole = {w.name for w in written if w.dim is None}
    return written, sliced, [n for n in names if n not in whole]


def frozen_format(frozen: Mapping[str, torch.Tensor]) -> str:
    """The ``fusion.frozen_dtype`` a frozen target travelled in, read from its tensors (int8 codes: int8, packed
    uint8 codes: int4, else its floating tensors' dtype): the format of the program that takes it."""
    codes = {t.dtype for k, t in frozen.items() if k.endswith(CODES)}
    dense = {t.dtype for t in frozen.values() if t.is_floating_point()}
    if codes:
        return "int4" if codes == {torch.uint8} else "int8"
    if dense == {torch.float16} or dense == {torch.float32}:
        return DTYPES[dense.pop()]
    raise ValueError(f"a frozen target's tensors are {sorted(map(str, dense))}: not one wire format")


def _frozen_inputs(state: State, names: list[str], frozen_dtype: str) -> tuple[list[_Frozen], list[dict[str, Any]]]:
    """The frozen tensors ``names`` of ``state`` as the program takes them in ``frozen_dtype``: their
    :class:`_Frozen` and input specs, named, shaped and typed as :func:`fedfusion.wire.quantize.encode` sends them
    (each quantised matrix's codes and scales, dense tensors whole; the shapes are the program's own)."""
    sent = {k: v for k, v in encode({n: state[n] for n in names}, frozen_dtype).items() if not k.endswith(SHAPE)}
    layout = [_Frozen(n, tuple(state[n].shape), sent[n + CODES].dtype == torch.uint8) if n + CODES in sent
              else _Frozen(n) for n in names]
    specs = [{"name": FROZEN + k, "shape": list(v.shape), "dtype": DTYPES[v.dtype], "per": ROUND} for k, v in sent.items()]
    return layout, specs


def export_window_program(config: PretrainedConfig, plan: SlicePlan, batch_size: int, seq_len: int,
                          train: TrainConfig | None = None, seed: int = 0, frozen_dtype: str = "int8") -> DeviceProgram:
    """Export the training program of a full-forward window of ``plan``'s shape (only its unit counts per axis
    and ``shared`` matter: positions are inputs) in a target of ``config``, for batches of ``batch_size`` x
    ``seq_len`` tokens and a frozen target that travels in ``frozen_dtype`` (``fusion.frozen_dtype``, whose default
    is int8). The ``ptd`` holds the window's initial values (a seeded target's): a device always receives the
    round's before training."""
    family = family_of(config).name
    key = window_program_key(config, plan, batch_size, seq_len, frozen_dtype)
    config = config_from_dict(config.to_dict())  # a copy: the eager attention below must not leak to the caller
    config._attn_implementation = "eager"  # SDPA's fused backward is not a core ATen op
    torch.manual_seed(seed)
    state = wire_state(family_of(config).build(config).state_dict(), config_aliases(config))
    names = list(state)
    written, axes, frozen = _layout(config, names, plan)
    window = extract(state, config, plan)  # by target name: a window keeps every layer
    layout, frozen_specs = _frozen_inputs(state, frozen, frozen_dtype)
    module = _WindowLoss(config, window, written, axes, layout).train()
    specs = [{"name": "tokens", "shape": [batch_size, seq_len + 1], "dtype": "int64"},
             *({"name": UNITS + a, "shape": [len(plan.units(a) or ())], "dtype": "int64", "per": ROUND} for a in axes),
             *frozen_specs]
    start = time.perf_counter()
    pte, ptd, planned = _lower(module, example_inputs({"inputs": specs}), family)
    params = [{"name": w.name, "fqn": f"window.{w.key}", "shape": list(window[w.name].shape),
               "dtype": DTYPES[window[w.name].dtype]} for w in written]
    manifest = _manifest(pte, ptd, planned, key, family, config, specs, LM_LOSS, params, train,
                         time.perf_counter() - start, WINDOW_DATA)
    manifest["window"] = {"per_layer": {a: len(plan.units(a) or ()) for a in axes}, "shared": plan.shared,
                          "target_params": sum(t.numel() for t in state.values()), "frozen_dtype": frozen_dtype,
                          "frozen_bytes": sum(math.prod(i["shape"]) * DTYPE_BYTES[i["dtype"]] for i in frozen_specs)}
    return DeviceProgram(pte, ptd, manifest)


def window_round(manifest: dict[str, Any], received: Mapping[str, torch.Tensor], spec: WindowSpec,
                 frozen: Mapping[str, torch.Tensor]) -> tuple[State, State]:
    """What a device feeds a window program from one round's full-forward payload: (the window's values, by
    parameter name, to load; the round's inputs, by input name, to hold): the frozen target as it travelled
    (``frozen``: its :data:`FROZEN` keys, the tensors themselves, no copy) and the window's unit indices per sliced
    axis from ``spec``. A target in another format than the program's is refused (ValueError naming both)."""
    if spec.rank or spec.core:
        raise ValueError("a window program trains a window of units: no rank-r update (window_rank) and no core "
                         "in the small model's forward pass (core_forward=small)")
    if not any(k.startswith(FROZEN) for k in frozen):
        raise ValueError(f"a full-forward payload carries the frozen target under {FROZEN!r} keys; none arrived")
    plan = window_plan(spec)
    weights = {p["name"]: received[p["name"]].float() for p in manifest["parameters"]}
    inputs = {}
    for i in manifest["inputs"]:
        if i.get("per") != ROUND:
            continue
        name = i["name"]
        if name.startswith(UNITS):
            inputs[name] = torch.tensor(plan.units(name.removeprefix(UNITS)) or (), dtype=torch.int64)
        elif name in frozen:
            inputs[name] = frozen[name]
        else:
            got = frozen_format({k: v for k, v in frozen.items() if k.startswith(FROZEN)})
            raise ValueError(f"the frozen target travelled as {got}; this program takes it as "
                             f"{manifest['window']['frozen_dtype']} (fusion.frozen_dtype), and lacks {name}")
    return weights, inputs
