"""On-device training programs: a tier's trainable sub-model as an ExecuTorch program that computes its loss and
every parameter's gradient (forward + backward) on a phone, with the manifest a device needs to feed it.

Why ExecuTorch: it is PyTorch's on-device runtime and the only maintained one that trains (ONNX Runtime's training
packages stopped at 1.19.2). The path is ``torch.export`` -> ``_export_forward_backward`` (the joint graph: loss
plus gradients as outputs) -> ``to_edge`` -> ``to_executorch``.

The program is weight-free: its trainable parameters live in an external data file (``.ptd``) beside it, which
the device loads once; each round's weights travel as named tensors and are copied into the program's parameter
memory (:mod:`fedfusion.phone.runtime`). A program's shape is fixed (batch and sequence length), so one program
serves a tier for the whole run: every slicing policy gives a tier's width the same sub-model shape, only which
target units fill it changes. The optimizer is not in the program: the runtime ships only SGD, so a device steps
AdamW (or SGD) in its own code over the gradients the program returns, as the manifest describes.

Needs the optional extra ``fedfusion[device]`` (``executorch``).
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from fedfusion.config.recipe import TrainConfig
from fedfusion.models.build import tied_aliases
from fedfusion.models.families import config_from_dict, family_of
from fedfusion.train.loop import lm_loss

METHOD = "forward"  # the program's training method (ExecuTorch TrainingModule's method name)
MANIFEST_VERSION = 1
WRAPPER = "lm"  # the exported module's attribute holding the model; stripped from parameter names
LM_LOSS = "mean next-token cross-entropy over tokens[:, :-1] -> tokens[:, 1:]"
IMAGE_LOSS = "mean cross-entropy of the logits against labels"
# torch.optim.AdamW's defaults, which fedfusion.train.loop.make_optimizer uses: a device must step the same way
ADAMW_BETAS, ADAMW_EPS = (0.9, 0.999), 1e-8
DTYPES = {torch.float32: "float32", torch.int64: "int64"}


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
    """An exported training program: ``pte`` (the forward+backward graph, weight-free), ``ptd`` (its trainable
    parameters' initial values, loaded beside it) and the manifest that says how to feed and step it."""

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


def export_program(config: PretrainedConfig, batch_size: int, seq_len: int, train: TrainConfig | None = None,
                   seed: int = 0) -> DeviceProgram:
    """Export the training program of a model of ``config`` for batches of ``batch_size`` x ``seq_len`` tokens.

    ``train`` (the recipe's train section) fills the manifest's optimizer and its hyper-parameters; a round's task
    repeats them, so the manifest's are the defaults a device starts with. The parameters in the ``ptd`` are a
    seeded initialisation: a device always receives the round's weights before training.
    """
    from executorch.exir import ExecutorchBackendConfig, to_edge
    from executorch.version import __version__ as et_version
    from torch.export import export
    from torch.export.experimental import _export_forward_backward

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
    try:
        joint = _export_forward_backward(export(wrapper(model), example_inputs({"inputs": specs}), strict=False))
        _to_core_aten(joint, family)
        program = to_edge(joint).to_executorch(ExecutorchBackendConfig(external_mutable_weights=True))
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
    pte = bytes(program.buffer)
    train = train or TrainConfig()
    manifest: dict[str, Any] = {
        "version": MANIFEST_VERSION,
        "program_id": hashlib.sha256(pte).hexdigest()[:16],
        "key": key,
        "executorch": et_version,
        "method": METHOD,
        "family": family,
        "model_config": json.loads(config.to_json_string()),
        "inputs": specs,
        "loss": loss_text,
        "outputs": "[loss]; named_gradients() and named_parameters() by parameter name",
        "parameters": [{"name": name, "shape": list(p.shape), "dtype": DTYPES[p.dtype]} for name, p in params.items()],
        "optimizer": {"name": train.optimizer, "lr": train.lr, "weight_decay": train.weight_decay,
                      "betas": list(ADAMW_BETAS), "eps": ADAMW_EPS, "local_steps": train.local_steps},
        "export_s": round(time.perf_counter() - start, 2),
    }
    return DeviceProgram(pte, ptd, manifest)
