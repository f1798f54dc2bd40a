"""On-device training programs for full-forward windows (``fusion.forward=full``): the device runs the whole frozen
target and trains only a window of its units (heads, neurons, and with ``window_shared`` the embeddings and norms)
with the exact gradient of the target's loss, as :class:`fedfusion.models.full_forward.WindowModel` does in torch.

What changes each round, and how the program takes it:

- the window's **values** (a tier's window has one shape for the whole run: every policy gives a width the same
  number of units) are the program's trainable parameters, loaded into its parameter memory each round by name,
  like a width slice's weights (:class:`fedfusion.phone.runtime.ProgramRunner`);
- the window's **positions** (the rolling policy moves them every round) are program **inputs**, given again with
  every step's batch: the window's unit indices per sliced axis, as :class:`~fedfusion.wire.specs.WindowSpec`
  carries them; the program expands them into each tensor's coordinates (``units * block + arange(block)``, per
  part) and writes the window's values there with ``index_copy`` (whose backward is an ``index_select`` of the
  gradient: the window's exact gradient);
- the **frozen target** (other clients' folds change it every round) lives in the program's data file (``.ptd``),
  which the runtime reads in place. ExecuTorch's training API exposes as writable memory only the parameters that
  get a gradient, and making the target a parameter would compute and hold its whole gradient each step; as an
  input, the runtime would copy it into its planned memory at every step, a second copy beside the device's. So the
  program holds it as constants in its data file, each tensor in a segment of its own (the manifest's
  ``window.frozen``: name, offset, bytes), and a device writes each round's target into those places and reloads
  the program (:meth:`fedfusion.phone.runtime.ProgramRunner.set_frozen`): the data file is its one copy.

The frozen target is held as it travelled (``fusion.frozen_dtype``, the program's too): int8 (or packed int4) codes
and float16 scales of every matrix, float16 vectors (float16 or float32 tensors for those formats), named as the
wire names them. The program dequantises them itself (:func:`_dequantized`: casts and a multiply, exact), so a
device never holds a float32 copy of it, and fetches it only when a task names another
(:mod:`fedfusion.phone.gateway` sends it only then). Tensors the window covers whole (the shared tensors with
``window_shared``) are parameters only, not in the data file.

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
from fedfusion.phone.program import DTYPES, FROZEN_FILE, LM_LOSS, ROUND, DeviceExportError, DeviceProgram, _lower, _manifest, example_inputs
from fedfusion.wire.keys import FROZEN
from fedfusion.wire.quantize import BLOCK, CODES, SHAPE, encode
from fedfusion.wire.specs import WindowSpec

UNITS = "units/"  # the prefix of a window position input's name: units/<axis>
FROZEN_TARGET_DATA = "the frozen target (a placeholder until a device writes the round's)"
FROZEN_BUFFER = "frozen_"  # the program's buffers holding the frozen target: frozen_<i>, in its wire keys' order
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
    """How one frozen target tensor lies among the program's constants in its data file (as it travelled): its name,
    and for quantised codes the tensor's shape and whether the codes are packed int4 (two to a uint8); dense tensors
    are one constant."""

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
    """The exported computation: a batch of token windows and the window's positions in; the target's mean
    next-token loss, with the window's values (the only parameters) written into the frozen target (buffers, as it
    travelled: the program's data file), out."""

    def __init__(self, config: PretrainedConfig, window: State, written: list[_Written], axes: list[str],
                 frozen: list[_Frozen], sent: State) -> None:
        super().__init__()
        self.window = torch.nn.ParameterDict({w.key: torch.nn.Parameter(window[w.name].clone()) for w in written})
        self.written, self.axes, self.frozen = written, axes, frozen
        self.sent = list(sent)  # the frozen target's wire keys, in the buffers' order
        for i, value in enumerate(sent.values()):
            self.register_buffer(f"{FROZEN_BUFFER}{i}", value.clone())
        model = family_of(config).build(config).requires_grad_(False)
        self._model = [model]  # a list: the target's own tensors are replaced, never parameters of the program

    def forward(self, tokens: torch.Tensor, *units_in: torch.Tensor) -> torch.Tensor:
        units = dict(zip(self.axes, units_in))
        buffers = dict(self.named_buffers())
        parts = iter(buffers[f"{FROZEN_BUFFER}{i}"] for i in range(len(self.sent)))
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


def _frozen_sent(state: State, names: list[str], frozen_dtype: str) -> tuple[list[_Frozen], State]:
    """The frozen tensors ``names`` of ``state`` as the program holds them in ``frozen_dtype``: their
    :class:`_Frozen` and the tensors by wire key, named, shaped and typed as :func:`fedfusion.wire.quantize.encode`
    sends them (each quantised matrix's codes and scales, dense tensors whole; the shapes are the program's own).
    Their values are distinct seeded fills: the exporter stores equal constants once, and each must have its own
    place in the data file for a device to write the round's target there."""
    sent = {k: v for k, v in encode({n: state[n] for n in names}, frozen_dtype).items() if not k.endswith(SHAPE)}
    layout = [_Frozen(n, tuple(state[n].shape), sent[n + CODES].dtype == torch.uint8) if n + CODES in sent
              else _Frozen(n) for n in names]
    gen = torch.Generator().manual_seed(0)
    fills = {}
    for k, v in sent.items():
        if v.is_floating_point():  # float16 scales and vectors: positive, so a scale never divides by zero
            fills[FROZEN + k] = (torch.rand(v.shape, generator=gen) + 0.5).to(v.dtype)
        else:
            fills[FROZEN + k] = torch.randint(-127 if v.dtype == torch.int8 else 0, 128 if v.dtype == torch.int8
                                              else 256, v.shape, generator=gen, dtype=v.dtype)
    return layout, fills


def _frozen_places(ptd: bytes, sent: State) -> list[dict[str, Any]]:
    """Where each frozen tensor of ``sent`` (by wire key, in the program's buffer order) lies in the data file
    ``ptd``: its key there, byte offset and length, shape and dtype, the places a device writes a round's target
    into (:meth:`fedfusion.phone.runtime.ProgramRunner.set_frozen`). Each must be a segment of its own, of exactly
    its bytes, holding the export's fill (else :class:`DeviceExportError`)."""
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorHeader, _deserialize_to_flat_tensor

    header = FlatTensorHeader.from_bytes(ptd[8:])
    flat = _deserialize_to_flat_tensor(ptd[:header.flatbuffer_offset + header.flatbuffer_size])
    segments = {d.key: flat.segments[d.segment_index] for d in flat.named_data}
    places, seen = [], set()
    for i, (name, value) in enumerate(sent.items()):
        keys = [k for k in segments if k.endswith(f"{FROZEN_BUFFER}{i}")]
        raw = value.contiguous().view(torch.uint8).numpy().tobytes()
        if len(keys) != 1:
            raise DeviceExportError(f"window program: the data file names the frozen tensor {name} {len(keys)} times")
        segment = segments[keys[0]]
        offset = header.segment_base_offset + segment.offset
        if segment.size != len(raw) or offset in seen or ptd[offset:offset + len(raw)] != raw:
            raise DeviceExportError(f"window program: the frozen tensor {name} has no place of its own in the data "
                                    "file (ExecuTorch shared or changed its bytes)")
        seen.add(offset)
        places.append({"name": name, "key": keys[0], "offset": offset, "bytes": len(raw), "shape": list(value.shape),
                       "dtype": DTYPES[value.dtype]})
    return places


def export_window_program(config: PretrainedConfig, plan: SlicePlan, batch_size: int, seq_len: int,
                          train: TrainConfig | None = None, seed: int = 0, frozen_dtype: str = "int8") -> DeviceProgram:
    """Export the training program of a full-forward window of ``plan``'s shape (only its unit counts per axis
    and ``shared`` matter: positions are inputs) in a target of ``config``, for batches of ``batch_size`` x
    ``seq_len`` tokens and a frozen target that travels in ``frozen_dtype`` (``fusion.frozen_dtype``, whose default
    is int8). The ``ptd`` holds the frozen target's places (filled with placeholders: a device writes each round's
    target there before training) and the manifest's ``window.frozen`` says where each tensor lies."""
    family = family_of(config).name
    key = window_program_key(config, plan, batch_size, seq_len, frozen_dtype)
    config = config_from_dict(config.to_dict())  # a copy: the eager attention below must not leak to the caller
    config._attn_implementation = "eager"  # SDPA's fused backward is not a core ATen op
    torch.manual_seed(seed)
    state = wire_state(family_of(config).build(config).state_dict(), config_aliases(config))
    names = list(state)
    written, axes, frozen = _layout(config, names, plan)
    window = extract(state, config, plan)  # by target name: a window keeps every layer
    layout, sent = _frozen_sent(state, frozen, frozen_dtype)
    module = _WindowLoss(config, window, written, axes, layout, sent).train()
    specs = [{"name": "tokens", "shape": [batch_size, seq_len + 1], "dtype": "int64"},
             *({"name": UNITS + a, "shape": [len(plan.units(a) or ())], "dtype": "int64", "per": ROUND} for a in axes)]
    start = time.perf_counter()
    pte, ptd, planned = _lower(module, example_inputs({"inputs": specs}), family, FROZEN_FILE)
    places = _frozen_places(ptd, sent)
    params = [{"name": w.name, "fqn": f"window.{w.key}", "shape": list(window[w.name].shape),
               "dtype": DTYPES[window[w.name].dtype]} for w in written]
    manifest = _manifest(pte, ptd, planned, key, family, config, specs, LM_LOSS, params, train,
                         time.perf_counter() - start, FROZEN_TARGET_DATA)
    manifest["window"] = {"per_layer": {a: len(plan.units(a) or ()) for a in axes}, "shared": plan.shared,
                          "target_params": sum(t.numel() for t in state.values()), "frozen_dtype": frozen_dtype,
                          "frozen_bytes": sum(p["bytes"] for p in places), "frozen": places}
    return DeviceProgram(pte, ptd, manifest)


def window_round(manifest: dict[str, Any], received: Mapping[str, torch.Tensor],
                 spec: WindowSpec) -> tuple[State, State]:
    """What a device gives a window program from one round's full-forward payload: (the window's values, by
    parameter name, to load; the round's inputs, by input name, to hold: the window's unit indices per sliced axis
    from ``spec``). The frozen target goes into the program's data file (:func:`window_frozen`)."""
    if spec.rank or spec.core:
        raise ValueError("a window program trains a window of units: no rank-r update (window_rank) and no core "
                         "in the small model's forward pass (core_forward=small)")
    plan = window_plan(spec)
    weights = {p["name"]: received[p["name"]].float() for p in manifest["parameters"]}
    inputs = {i["name"]: torch.tensor(plan.units(i["name"].removeprefix(UNITS)) or (), dtype=torch.int64)
              for i in manifest["inputs"] if i.get("per") == ROUND}
    return weights, inputs


def window_frozen(manifest: dict[str, Any], frozen: Mapping[str, torch.Tensor]) -> State:
    """The frozen target a window program's data file takes, from a payload's :data:`FROZEN` keys as they
    travelled (the tensors themselves, no copy), by wire key, for
    :meth:`fedfusion.phone.runtime.ProgramRunner.set_frozen`. None, or a target in another format than the
    program's, is refused (ValueError naming both)."""
    if not any(k.startswith(FROZEN) for k in frozen):
        raise ValueError(f"a full-forward payload carries the frozen target under {FROZEN!r} keys; none arrived")
    places = [p["name"] for p in manifest["window"]["frozen"]]
    lacking = [name for name in places if name not in frozen]
    if lacking:
        got = frozen_format({k: v for k, v in frozen.items() if k.startswith(FROZEN)})
        raise ValueError(f"the frozen target travelled as {got}; this program takes it as "
                         f"{manifest['window']['frozen_dtype']} (fusion.frozen_dtype), and lacks {lacking[0]}")
    return {name: frozen[name] for name in places}
