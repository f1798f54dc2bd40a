"""Client role for LoRA fusion: a frozen pretrained base (optionally 4-/8-bit), peft LoRA adapters of this
client's rank, trained on its instruction pairs.

Arrays a train message may carry, per adapted module ``m`` (its path in the base, e.g.
``model.layers.0.self_attn.q_proj``):
- ``m.lora_A`` (k, in), ``m.lora_B`` (out, k): the adapter to start from, in this client's scaling
  (``alpha / rank``), k <= rank; components beyond k start fresh (peft's init: random A, zero B). Absent:
  a fresh adapter (the first round, or FLoRA).
- ``m.merged_A`` (K, in), ``m.merged_B`` (out, K), or their product ``m.merged_W`` (out, in) where that is
  smaller: a frozen update ``B @ A`` added to the base's output (FLoRA's merged rounds; for evaluation,
  the whole global update). Applied with forward hooks, so it works on a quantised base whose weights
  cannot simply be added to.

The reply carries ``m.lora_A`` (rank, in) and ``m.lora_B`` (out, rank) float32 (adapter tensors only)
and the metrics ``num-examples``, ``train_loss``, ``train_tokens``, ``train_s``.

The base and the encoded data are cached per process (Ray actors persist across rounds); the adapter is
removed from the cached base after every message (``unload``), so one process can serve any rank.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import torch
from fedfusion.clients.submodel import inject_faults
from flwr.app import ConfigRecord
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedfusion.instruct import (
    InstructData,
    encode_pairs,
    evaluate_instruct,
    instruct_clients,
    train_instruct,
)
from fedfusion.pretrained import load_base, load_base_tokenizer

_PEFT_PREFIX = "base_model.model."


@lru_cache(maxsize=3)
def frozen_base(base: str, quantize: int, dtype: str, device: str = "cpu") -> PreTrainedModel:
    """The frozen base, loaded once per (base, bits, dtype, device) in this process."""
    return load_base(base, quantize=quantize, dtype=dtype, device=device)


@lru_cache(maxsize=2)
def base_tokenizer(base: str) -> PreTrainedTokenizerBase:
    """The base's tokenizer, loaded once per process."""
    return load_base_tokenizer(base)


@lru_cache(maxsize=32)
def client_data(data_spec: str, partition: int, base: str, seq_len: int, split: str) -> InstructData:
    """This client's ``train`` or ``held_out`` pairs encoded for ``base`` (cached)."""
    clients = instruct_clients(data_spec)
    if not 0 <= partition < len(clients):
        raise ValueError(f"partition-id {partition} is outside the population of {len(clients)} clients")
    return encode_pairs(base_tokenizer(base), getattr(clients[partition], split), seq_len)


def num_examples(spec: ConfigRecord, partition: int) -> int:
    """This client's number of training pairs, for the capability query (``data-spec``, ``base``, ``seq-len``)."""
    return len(client_data(str(spec["data-spec"]), partition, str(spec["base"]), int(spec["seq-len"]), "train"))


def target_modules(spec: ConfigRecord) -> list[str]:
    """The module names to adapt, from the spec's comma-separated ``target-modules``."""
    names = [n.strip() for n in str(spec["target-modules"]).split(",") if n.strip()]
    if not names:
        raise ValueError("target-modules is empty")
    return names


def attach_adapter(base: PreTrainedModel, rank: int, alpha: float, modules: list[str], dropout: float,
                   seed: int) -> PeftModel:
    """peft LoRA of ``rank``/``alpha`` (scaling alpha / rank) on ``modules`` of ``base``; seeded init."""
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, lora_dropout=dropout, bias="none",
                        use_rslora=False, task_type="CAUSAL_LM")
    return get_peft_model(base, config)


def lora_layers(model: PeftModel) -> dict[str, LoraLayer]:
    """The LoRA layers of ``model`` by their module path in the base."""
    return {name.removeprefix(_PEFT_PREFIX): module for name, module in model.named_modules()
            if isinstance(module, LoraLayer)}


def adapter_factors(model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapter's tensors as reply arrays: ``m.lora_A`` (rank, in) and ``m.lora_B`` (out, rank), float32."""
    out = {}
    for name, layer in lora_layers(model).items():
        out[f"{name}.lora_A"] = layer.lora_A["default"].weight.detach().float().cpu().clone()
        out[f"{name}.lora_B"] = layer.lora_B["default"].weight.detach().float().cpu().clone()
    return out


def load_factors(model: PeftModel, arrays: dict[str, torch.Tensor]) -> None:
    """Copy received ``m.lora_A``/``m.lora_B`` into the first k components of each adapter."""
    layers = lora_layers(model)
    received = {k.rsplit(".", 1)[0] for k in arrays if k.endswith((".lora_A", ".lora_B"))}
    if not received:
        return
    if received != set(layers):
        raise ValueError(f"adapter arrays name modules {sorted(received ^ set(layers))} that the adapted base "
                         "does not match")
    with torch.no_grad():
        for name, layer in layers.items():
            a, b = arrays[f"{name}.lora_A"], arrays[f"{name}.lora_B"]
            wa, wb = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            k = a.shape[0]
            if k > wa.shape[0] or a.shape[1] != wa.shape[1] or b.shape != (wb.shape[0], k):
                raise ValueError(f"{name}: received A {tuple(a.shape)}, B {tuple(b.shape)} do not fit adapter "
                                 f"A {tuple(wa.shape)}, B {tuple(wb.shape)}")
            wa[:k] = a.to(wa.dtype)
            wb[:, :k] = b.to(wb.dtype)


@contextmanager
def merged_update(model: PreTrainedModel, arrays: dict[str, torch.Tensor]) -> Iterator[int]:
    """Add the frozen ``m.merged_B @ m.merged_A`` (or ``m.merged_W``) to the outputs of the base modules ``m``
    while inside; yields the number of modules hooked."""
    names = sorted({k.rsplit(".", 1)[0] for k in arrays if k.endswith((".merged_A", ".merged_W"))})
    modules = dict(model.named_modules())
    hooks = []
    try:
        for name in names:
            if name not in modules:
                raise ValueError(f"merged update names module {name!r}, which the base does not have")
            if f"{name}.merged_W" in arrays:
                factors = (arrays[f"{name}.merged_W"].to(model.device).T,)
            else:  # x A^T B^T: never forms the (out, in) product
                factors = (arrays[f"{name}.merged_A"].to(model.device).T, arrays[f"{name}.merged_B"].to(model.device).T)

            def add(module, inputs, output, factors=factors):
                x = inputs[0].to(factors[0].dtype)
                for f in factors:
                    x = x @ f
                return output + x.to(output.dtype)

            hooks.append(modules[name].register_forward_hook(add))
        yield len(hooks)
    finally:
        for hook in hooks:
            hook.remove()


def _base(spec: ConfigRecord, accelerator: str) -> PreTrainedModel:
    return frozen_base(str(spec["base"]), int(spec.get("quantize", 0)), str(spec.get("dtype", "float32")), accelerator)


def train(arrays: dict[str, torch.Tensor], spec: ConfigRecord, partition: int,
          accelerator: str = "cpu") -> tuple[dict, dict]:
    """Train this client's adapter as ``spec`` says; returns the adapter tensors and reply metrics."""
    corrupt, delay = inject_faults(spec, partition)
    torch.set_num_threads(int(spec.get("threads", 1)))
    base_name = str(spec["base"])
    data = client_data(str(spec["data-spec"]), partition, base_name, int(spec["seq-len"]), "train")
    base = _base(spec, accelerator)
    with merged_update(base, arrays):  # hooks sit on the base layers, which peft keeps as base_layer
        model = attach_adapter(base, int(spec["rank"]), float(spec["alpha"]), target_modules(spec),
                               float(spec.get("lora-dropout", 0.0)), int(spec["seed"]))
        try:
            load_factors(model, arrays)
            stats = train_instruct(model, data, steps=int(spec["local-steps"]), lr=float(spec["lr"]),
                                   batch_size=int(spec["batch-size"]), seed=int(spec["seed"]),
                                   weight_decay=float(spec.get("weight-decay", 0.0)))
            factors = adapter_factors(model)
            sent = [k for k in arrays if k.endswith((".lora_A", ".lora_B"))]
            if sent:  # reply in the order received: Flower's DP mods compare the key lists as sent
                factors = {k: factors[k] for k in sent}
        finally:
            model.unload()  # the cached base loses the adapter layers again
    if corrupt:
        next(iter(factors.values())).view(-1)[0] = float("nan")
    time.sleep(delay)
    return factors, {"num-examples": len(data), **stats}


def evaluate(arrays: dict[str, torch.Tensor], spec: ConfigRecord, partition: int, accelerator: str = "cpu") -> dict:
    """Response loss of base + the global update (sent as frozen ``m.merged_*`` arrays) on this
    client's held-out pairs."""
    torch.set_num_threads(int(spec.get("threads", 1)))
    data = client_data(str(spec["data-spec"]), partition, str(spec["base"]), int(spec["seq-len"]), "held_out")
    base = _base(spec, accelerator)
    with merged_update(base, arrays):
        return {"num-examples": len(data), **evaluate_instruct(base, data)}
