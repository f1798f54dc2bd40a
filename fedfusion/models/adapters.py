"""peft LoRA adapters on a frozen base, as the LoRA client role trains them, in plain torch/peft (no Flower):
attach one, read and load its factors as wire arrays, and add a frozen global update ``B @ A`` with forward
hooks (which works on a quantised base whose weights cannot simply be added to).

Wire names: ``m.lora_A`` (rank, in) and ``m.lora_B`` (out, rank) per adapted module ``m`` (its path in the
base, e.g. ``model.layers.0.self_attn.q_proj``); ``m.merged_A`` / ``m.merged_B`` or ``m.merged_W`` for a
frozen update (see :mod:`fedfusion.clients.lora`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers import PreTrainedModel

_PEFT_PREFIX = "base_model.model."


def attach_adapter(base: PreTrainedModel, rank: int, alpha: float, modules: list[str], dropout: float,
                   seed: int) -> PeftModel:
    """peft LoRA of ``rank``/``alpha`` (scaling alpha / rank) on ``modules`` of ``base``; seeded init."""
    torch.manual_seed(seed)
    # peft annotates lora_alpha as int, but uses it as a number (scaling = alpha / rank): a float alpha is kept as is
    config = LoraConfig(r=rank, lora_alpha=alpha,  # type: ignore[arg-type]
                        target_modules=modules, lora_dropout=dropout, bias="none", use_rslora=False, task_type="CAUSAL_LM")
    return get_peft_model(base, config)


def lora_layers(model: PeftModel) -> dict[str, LoraLayer]:
    """The LoRA layers of ``model`` by their module path in the base."""
    return {name.removeprefix(_PEFT_PREFIX): module for name, module in model.named_modules()
            if isinstance(module, LoraLayer)}


def adapter_factors(model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapter's tensors as reply arrays: ``m.lora_A`` (rank, in) and ``m.lora_B`` (out, rank), float32."""
    out = {}
    for name, layer in lora_layers(model).items():
        out[f"{name}.lora_A"] = factor(layer, "lora_A").detach().float().cpu().clone()
        out[f"{name}.lora_B"] = factor(layer, "lora_B").detach().float().cpu().clone()
    return out


def factor(layer: LoraLayer, which: str) -> torch.Tensor:
    """The weight of a LoRA layer's ``lora_A`` or ``lora_B`` Linear of its one (``default``) adapter."""
    linear = getattr(layer, which)["default"]
    if not isinstance(linear, torch.nn.Linear):
        raise TypeError(f"{which} of a LoRA layer is a {type(linear).__name__}, not a Linear")
    return linear.weight


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
            wa, wb = factor(layer, "lora_A"), factor(layer, "lora_B")
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
            factors: tuple[torch.Tensor, ...]
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
