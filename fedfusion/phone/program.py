"""On-device training programs: a tier's trainable sub-model as an ExecuTorch program that computes its loss and
every parameter's gradient (forward + backward) on a phone, with the manifest a device needs to feed it.

Why ExecuTorch: it is PyTorch's on-device runtime and the only maintained one that trains (ONNX Runtime's training
packages stopped at 1.19.2). The path is ``torch.export`` -> ``_export_forward_backward`` (the joint graph: loss
plus gradients as outputs) -> ``to_edge`` -> ``to_executorch``.

Three kinds of program, one path (:func:`_lower`):

- a width slice (:func:`export_program`): every parameter is trained. The program is weight-free: its parameters
  live in an external data file (``.ptd``) beside it, which the device loads once; each round's weights travel as
  named tensors and are copied into the program's parameter memory (:mod:`fedfusion.phone.runtime`).
- a LoRA adapter on a frozen base (:func:`export_lora_program`): only the adapter's factors are trained, and they
  stay in the program; the frozen base is the data file, kept on the device between rounds and checked by its
  sha256 (the manifest's ``data``). Each round only the factors travel.
- a full-forward window (:func:`fedfusion.phone.window.export_window_program`): the window's values are trained and
  stay in the program; the data file holds the frozen target, which changes every round, so the device writes each
  new one into its places there (the manifest's ``window.frozen``) and loads the program again.

A program's shape is fixed (batch and sequence length), so one program
serves a tier for the whole run: every slicing policy gives a tier's width the same sub-model shape, only which
target units fill it changes. The optimizer is not in the program: the runtime ships only SGD, so a device steps
AdamW (or SGD) in its own code over the gradients the program returns, as the manifest describes.

Needs the optional extra ``fedfusion[device]`` (``executorch``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from fedfusion.config.sections import TrainConfig
from fedfusion.models.build import tied_aliases
from fedfusion.models.families import config_from_dict, family_of
from fedfusion.train.instruct import response_loss
from fedfusion.train.loop import lm_loss

if TYPE_CHECKING:  # peft imports bitsandbytes: only a LoRA export loads it
    from peft import PeftModel

METHOD = "forward"  # the program's training method (ExecuTorch TrainingModule's method name)
MANIFEST_VERSION = 1
WRAPPER = "lm"  # the exported module's attribute holding the model; stripped from parameter names
LM_LOSS = "mean next-token cross-entropy over tokens[:, :-1] -> tokens[:, 1:]"
IMAGE_LOSS = "mean cross-entropy of the logits against labels"
RESPONSE_LOSS = ("mean next-token cross-entropy over response tokens: logits[:, :-1] against labels[:, 1:], "
                 "labels -100 ignored; right-padded rows, attention_mask 0 on padding")
FROZEN_FILE = "frozen_base"  # the data file's tag: a LoRA program's frozen base, a window program's frozen target
TRAINABLE_DATA, FROZEN_DATA = "trainable parameters' initial values", "frozen base"
GROUP = 32  # inputs per scale of a quantised frozen Linear
# torch.optim.AdamW's defaults, which fedfusion.train.loop.make_optimizer uses: a device must step the same way
ADAMW_BETAS, ADAMW_EPS = (0.9, 0.999), 1e-8
# a manifest's dtype names (a window program's frozen target comes as it travelled: int8 / packed int4 codes, float16)
DTYPES = {torch.float32: "float32", torch.int64: "int64", torch.float16: "float16", torch.int8: "int8", torch.uint8: "uint8"}
ROUND = "round"  # an input's ``per`` in a manifest: given once a round and held for its steps, not each batch


class DeviceExportError(ValueError):
    """A model that cannot become an on-device training program; the message names the family and the op."""


class _LMLoss(torch.nn.Module):
    """The exported computation for a causal LM: token windows in, mean next-token loss out."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.lm = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.lm, tokens)[0]


class _ImageLoss(torch.nn.Module):
    """The exported computation for the image CNN: images and labels in, mean cross-entropy out."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.lm = model

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.lm(pixel_values=images).logits, labels)


class _ResponseLoss(torch.nn.Module):
    """The exported computation of a LoRA adapter: instruction rows in, the LoRA client's response-only loss out
    (:func:`fedfusion.train.instruct.response_loss`)."""

    def __init__(self, model: PreTrainedModel | PeftModel) -> None:
        super().__init__()
        self.lm = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return response_loss(self.lm, input_ids, labels, attention_mask)[0]


class _TiedHead(torch.nn.Module):
    """An output layer that reads the input embedding's weight without holding it: torch.export lists a tied
    weight under both names and leaves the second without a gradient, so the program keeps one parameter whose
    gradient sums both uses, as eager torch's does."""

    def __init__(self, embedding: torch.nn.Embedding) -> None:
        super().__init__()
        self.source = [embedding]  # a list, so the embedding is not registered twice

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.source[0].weight)


def _untie(model: PreTrainedModel) -> None:
    """Give a model with a tied lm_head a :class:`_TiedHead` (bias-free heads only: GPT-2, OPT)."""
    if not tied_aliases(model):
        return
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if not isinstance(embedding, torch.nn.Embedding) or head.weight is not embedding.weight or head.bias is not None:
        raise DeviceExportError(f"{model.config.model_type} model: tied weights other than a bias-free lm_head")
    model.set_output_embeddings(_TiedHead(embedding))


def _inputs(config: PretrainedConfig, batch_size: int, seq_len: int) -> tuple[list[dict[str, Any]], str, type]:
    """The program's input specs (name, shape, dtype), its loss and the wrapper that computes it."""
    if family_of(config).name == "cnn":
        size = config.image_size
        return ([{"name": "images", "shape": [batch_size, config.in_channels, size, size], "dtype": "float32"},
                 {"name": "labels", "shape": [batch_size], "dtype": "int64"}], IMAGE_LOSS, _ImageLoss)
    return [{"name": "tokens", "shape": [batch_size, seq_len + 1], "dtype": "int64"}], LM_LOSS, _LMLoss


def example_inputs(manifest: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """Zero tensors of the program's input shapes (what a device feeds before its first real batch)."""
    dtypes = {v: k for k, v in DTYPES.items()}
    return tuple(torch.zeros(i["shape"], dtype=dtypes[i["dtype"]]) for i in manifest["inputs"])


def _to_core_aten(program: torch.export.ExportedProgram, family: str) -> None:
    """Rewrite the joint graph's non-core ops that have a core equivalent, in place. SiLU's backward allocates
    with ``empty_permuted`` (identity layout), which is plain ``empty``: the values are overwritten right after."""
    graph = program.graph
    for node in list(graph.nodes):
        if node.target != torch.ops.aten.empty_permuted.default:
            continue
        size, layout = node.args[0], list(node.args[1])
        if layout != list(range(len(layout))):
            raise DeviceExportError(f"{family} model: aten.empty_permuted with layout {layout} has no core ATen "
                                    "equivalent this exporter knows")
        with graph.inserting_before(node):
            empty = graph.call_function(torch.ops.aten.empty.memory_format, (size,), dict(node.kwargs))
        empty.meta = dict(node.meta)
        node.replace_all_uses_with(empty)
        graph.erase_node(node)
    program.graph_module.recompile()


def _failure(family: str, exc: Exception) -> DeviceExportError:
    """A DeviceExportError naming the family and, where ExecuTorch names it, the operator it lacks."""
    text = str(exc)
    op = re.search(r"Operator (\S+) is not in Core ATen", text)
    if op:
        return DeviceExportError(f"{family} model: operator {op.group(1)} is not in ExecuTorch's core ATen opset, "
                                 "so it has no on-device training program")
    node = re.search(r"While executing %\S+ : .*?target=([^\]]+)\]", text)
    if node:
        return DeviceExportError(f"{family} model: ExecuTorch cannot emit operator {node.group(1)} of the training "
                                 "graph, so it has no on-device training program")
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    return DeviceExportError(f"{family} model: export to an on-device training program failed: {first[:300]}")


@dataclass(frozen=True)
class DeviceProgram:
    """An exported training program: ``pte`` (the forward+backward graph; a LoRA program's also holds the adapter's
    initial factors, a window program's the window's), ``ptd`` (its external data, loaded beside it: a slice's
    trainable parameters' initial values, a LoRA program's frozen base, or a window program's frozen target, which a
    device writes into it each time the target changes) and the manifest that says how to feed and step it."""

    pte: bytes
    ptd: bytes
    manifest: dict[str, Any]

    @property
    def program_id(self) -> str:
        return str(self.manifest["program_id"])

    def save(self, out: Path) -> dict[str, Path]:
        """Write ``<id>.pte``, ``<id>.ptd`` and ``<id>.json`` into ``out``; returns the paths by kind."""
        out.mkdir(parents=True, exist_ok=True)
        paths = {kind: out / f"{self.program_id}.{kind}" for kind in ("pte", "ptd", "json")}
        paths["pte"].write_bytes(self.pte)
        paths["ptd"].write_bytes(self.ptd)
        paths["json"].write_text(json.dumps(self.manifest, indent=1) + "\n")
        return paths

    @classmethod
    def load(cls, out: Path, program_id: str) -> DeviceProgram:
        """The program :meth:`save` wrote into ``out`` under ``program_id``."""
        manifest = json.loads((out / f"{program_id}.json").read_text())
        return cls((out / f"{program_id}.pte").read_bytes(), (out / f"{program_id}.ptd").read_bytes(), manifest)


def program_key(config: PretrainedConfig, batch_size: int, seq_len: int) -> str:
    """A name for the program of this shape before exporting it (a gateway caches programs by it): a hash of the
    sub-model config, the input shape and the ExecuTorch version."""
    from executorch.version import __version__ as et_version

    text = json.dumps([config.to_dict(), batch_size, seq_len, et_version], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def lora_program_key(base: str, target_modules: list[str], rank: int, alpha: float, bits: int, batch_size: int,
                     seq_len: int) -> str:
    """A name for a LoRA adapter's program before exporting it (a gateway caches programs by it): a hash of the
    base's name (``lora.base``), the adapter, the base's bits, the input shape and the ExecuTorch version."""
    from executorch.version import __version__ as et_version

    text = json.dumps([base, sorted(target_modules), rank, float(alpha), bits, batch_size, seq_len, et_version])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _lower(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], family: str,
           frozen_file: str | None = None) -> tuple[bytes, bytes, int]:
    """``module`` (inputs -> loss) as an ExecuTorch training program: the program's bytes, its one external data
    file and the bytes of its planned (non-constant) memory.

    ``frozen_file`` None: every parameter is trained and goes to the data file (a slice). A name: only the
    parameters that get a gradient are trained; they stay in the program, and every frozen weight and buffer goes
    to the data file (a frozen base), which is then the same bytes for any adapter on that base.
    """
    from executorch.exir import ExecutorchBackendConfig, to_edge
    from torch.export import export
    from torch.export.experimental import _export_forward_backward
    from torch.export.exported_program import OutputKind

    try:
        joint = _export_forward_backward(export(module, inputs, strict=False))
        _to_core_aten(joint, family)
        edge = to_edge(joint)
        if frozen_file is None:
            config = ExecutorchBackendConfig(external_mutable_weights=True)
        else:
            signature = edge.exported_program().graph_signature
            grads = {s.target for s in signature.output_specs if s.kind == OutputKind.GRADIENT_TO_PARAMETER}
            trained = {node for node, fqn in signature.inputs_to_parameters.items() if fqn in grads}
            config = ExecutorchBackendConfig(
                external_constants=lambda node: None if node.target in trained else frozen_file)
        program = edge.to_executorch(config)
    except DeviceExportError:
        raise
    except Exception as exc:  # torch.export and ExecuTorch raise many types; each becomes one clear message
        raise _failure(family, exc) from exc
    with tempfile.TemporaryDirectory() as tmp:
        program.write_tensor_data_to_file(tmp)
        data = list(Path(tmp).iterdir())
        if len(data) != 1:
            raise DeviceExportError(f"{family} model: expected one external weight file, ExecuTorch wrote {len(data)}")
        ptd = data[0].read_bytes()
    planned = sum(program.executorch_program.execution_plan[0].non_const_buffer_sizes)
    return bytes(program.buffer), ptd, planned


def _manifest(pte: bytes, ptd: bytes, planned: int, key: str, family: str, config: PretrainedConfig,
              specs: list[dict[str, Any]], loss: str, params: list[dict[str, Any]], train: TrainConfig | None,
              export_s: float, holds: str) -> dict[str, Any]:
    """The manifest every program carries (see docs/devices.md); ``holds`` says what its data file is."""
    from executorch.version import __version__ as et_version

    train = train or TrainConfig()
    return {
        "version": MANIFEST_VERSION,
        "program_id": hashlib.sha256(pte).hexdigest()[:16],
        "key": key,
        "executorch": et_version,
        "method": METHOD,
        "family": family,
        "model_config": json.loads(config.to_json_string()),
        "inputs": specs,
        "loss": loss,
        "outputs": "[loss]; named_gradients() and named_parameters() by parameter name",
        "parameters": params,
        "data": {"holds": holds, "sha256": hashlib.sha256(ptd).hexdigest(), "bytes": len(ptd)},
        "planned_bytes": planned,
        "optimizer": {"name": train.optimizer, "lr": train.lr, "weight_decay": train.weight_decay,
                      "betas": list(ADAMW_BETAS), "eps": ADAMW_EPS, "local_steps": train.local_steps},
        "export_s": round(export_s, 2),
    }


def export_program(config: PretrainedConfig, batch_size: int, seq_len: int, train: TrainConfig | None = None,
                   seed: int = 0) -> DeviceProgram:
    """Export the training program of a model of ``config`` for batches of ``batch_size`` x ``seq_len`` tokens.

    ``train`` (the recipe's train section) fills the manifest's optimizer and its hyper-parameters; a round's task
    repeats them, so the manifest's are the defaults a device starts with. The parameters in the ``ptd`` are a
    seeded initialisation: a device always receives the round's weights before training.
    """
    family = family_of(config).name
    key = program_key(config, batch_size, seq_len)
    config = config_from_dict(config.to_dict())  # a copy: the eager attention below must not leak to the caller
    config._attn_implementation = "eager"  # SDPA's fused backward is not a core ATen op
    torch.manual_seed(seed)
    model = family_of(config).build(config).train()
    params = dict(model.named_parameters())  # tied weights appear once, under the name the wire state keeps
    _untie(model)
    specs, loss_text, wrapper = _inputs(config, batch_size, seq_len)
    start = time.perf_counter()
    pte, ptd, planned = _lower(wrapper(model), example_inputs({"inputs": specs}), family)
    described = [{"name": name, "shape": list(p.shape), "dtype": DTYPES[p.dtype]} for name, p in params.items()]
    manifest = _manifest(pte, ptd, planned, key, family, config, specs, loss_text, described, train,
                         time.perf_counter() - start, TRAINABLE_DATA)
    return DeviceProgram(pte, ptd, manifest)


def export_lora_program(base: PreTrainedModel, target_modules: list[str], rank: int, alpha: float, batch_size: int,
                        seq_len: int, train: TrainConfig | None = None, seed: int = 0, bits: int = 0,
                        base_name: str = "") -> DeviceProgram:
    """Export the training program of a rank-``rank`` LoRA adapter (scaling ``alpha / rank``) on ``target_modules``
    of the frozen ``base``, for instruction batches of ``batch_size`` x ``seq_len`` tokens.

    The program trains the adapter's factors only. The frozen base goes to the data file (``ptd``), which depends on
    the base (and ``bits``) alone, so a device downloads it once and keeps it, checked by its sha256; each round only
    the factors travel, named as the wire names them (``m.lora_A`` (rank, in), ``m.lora_B`` (out, rank)).
    ``bits`` 8 or 4 holds the base's Linear weights as integers with float32 scales, dequantised in the program
    (:class:`_FrozenQuantLinear`); the embedding (and a head tied to it) and the norms stay float32. ``base`` itself is left as it was;
    ``base_name`` (``lora.base``) names it in the program's key.
    """
    from fedfusion.models.adapters import attach_adapter, factor, lora_layers

    family = family_of(base.config).name
    model = copy.deepcopy(base)
    model.config._attn_implementation = "eager"  # SDPA's fused backward is not a core ATen op
    model.requires_grad_(False)
    peft = attach_adapter(model, rank, alpha, list(target_modules), 0.0, seed).train()
    if bits:
        quantize_frozen(peft, bits)
    params = []
    fqns = {id(p): name for name, p in peft.named_parameters()}
    for name, layer in lora_layers(peft).items():
        for which in ("lora_A", "lora_B"):
            weight = factor(layer, which)
            params.append({"name": f"{name}.{which}", "fqn": f"{WRAPPER}.{fqns[id(weight)]}",
                           "shape": list(weight.shape), "dtype": DTYPES[weight.dtype]})
    specs = [{"name": n, "shape": [batch_size, seq_len], "dtype": "int64"} for n in ("input_ids", "labels", "attention_mask")]
    start = time.perf_counter()
    pte, ptd, planned = _lower(_ResponseLoss(peft), example_inputs({"inputs": specs}), family, FROZEN_FILE)
    key = lora_program_key(base_name, list(target_modules), rank, alpha, bits, batch_size, seq_len)
    manifest = _manifest(pte, ptd, planned, key, family, base.config, specs, RESPONSE_LOSS, params, train,
                         time.perf_counter() - start, FROZEN_DATA)
    manifest["adapter"] = {"rank": rank, "alpha": float(alpha), "target_modules": list(target_modules), "base_bits": bits,
                           "base_params": sum(p.numel() for p in base.parameters())}
    return DeviceProgram(pte, ptd, manifest)


class _FrozenQuantLinear(torch.nn.Module):
    """A frozen Linear held as ``bits``-bit integers with one float32 scale per group of ``GROUP`` inputs
    (symmetric), dequantised by plain core ATen ops the portable runtime has (a cast, a multiply; 4-bit codes come
    two to a uint8 and are split with a divide, a floor and a subtract). No int4 dtype or quantized op is needed."""

    def __init__(self, linear: torch.nn.Linear, bits: int) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        out, inp = w.shape
        group = GROUP if inp % GROUP == 0 else inp
        top = 2 ** (bits - 1) - 1  # 127 or 7
        groups = w.view(out, inp // group, group)
        scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-12) / top
        codes = torch.round(groups / scale).clamp(-top, top).view(out, inp)
        if bits == 8:
            self.register_buffer("codes", codes.to(torch.int8))
        else:  # offset to 1..15; column j and j + in/2 share a byte (high and low nibble)
            half = inp // 2
            self.register_buffer("codes", ((codes[:, :half] + 8) * 16 + codes[:, half:] + 8).to(torch.uint8))
        self.register_buffer("scale", scale)
        self.codes: torch.Tensor
        self.scale: torch.Tensor
        self.bits, self.shape, self.group = bits, (out, inp), group
        self.bias = linear.bias

    def dequantized(self) -> torch.Tensor:
        """The dequantised float32 weight."""
        codes = self.codes.to(torch.float32)
        if self.bits == 4:
            high = torch.floor(codes / 16)
            codes = torch.cat([high, codes - 16 * high], dim=1) - 8
        out, inp = self.shape
        return (codes.view(out, inp // self.group, self.group) * self.scale).view(out, inp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.dequantized(), self.bias)


def quantize_frozen(model: torch.nn.Module, bits: int) -> int:
    """Replace every frozen Linear of ``model`` (the base layers under LoRA adapters included, the adapters' own
    factors not) by a :class:`_FrozenQuantLinear` of ``bits`` (8 or 4); returns how many were replaced. A head
    tied to the float32 embedding stays tied: quantising it would add a copy, not save one."""
    if bits not in (4, 8):
        raise ValueError(f"a device base holds 4 or 8 bits, not {bits}")
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    swaps = [(parent, child, module) for parent in model.modules() for child, module in parent.named_children()
             if type(module) is torch.nn.Linear and not module.weight.requires_grad
             and id(module.weight) not in embedded and (bits == 8 or module.in_features % 2 == 0)]
    for parent, child, module in swaps:
        setattr(parent, child, _FrozenQuantLinear(module, bits))
    return len(swaps)
