"""What a way of training costs on a device tier: peak training memory (:func:`estimate_memory`), the fits against a
tier's memory, and a plan row's price of one round's work (:func:`priced`). Every method's plan view prices its tiers
with these (``fedfusion.fusion.<method>.plan``), so the model sits below the methods.

Memory model (:func:`estimate_memory`), per training step of ``batch`` sequences of ``seq`` tokens:

- **weights**: every parameter at 4 bytes (fp32). With LoRA the frozen base is stored at ``base_bits``:
  the decoder's linear layers quantised (4 bit: 4.5 bits per weight, 8 bit: 8.5, counting
  bitsandbytes' per-block scales), embeddings, norms and lm_head at 16 bit, or everything at 16/32 bit.
- **gradients**: 4 bytes per trainable parameter (all of them; with LoRA only the adapters).
- **optimizer**: AdamW's two fp32 moments, 8 bytes per trainable parameter; its step allocates one more
  trainable-sized temporary, ``sqrt(v)``, as torch's multi-tensor AdamW (its default on CUDA) does. Backward has
  freed the activations by then, so the peak counts the larger of the activations and that temporary. On CPU
  torch defaults to the single-tensor AdamW, whose temporaries are two of the largest tensor's size at a time, so
  there this term overcounts (the whole 135M target with checkpointing: 13 % above its live tensors' peak,
  ``benchmarks/results/cpu_memory.md``).
- **tied gradients**: with the embedding trained and tied to the head, backward's last moment holds two more
  vocabulary x hidden gradients (:func:`tied_grad_bytes`); like the step, after the activations are freed.
- **dense matrices** of a rank-r update that does not ride on a linear layer (``dense``, from
  ``fedfusion.fusion.submodel.plan.rank_dense_bytes``: each matrix and its gradient): the matrix a layer keeps for
  backward (half of ``dense``; none is kept by an embedding used only for its lookup, so there this overcounts) is
  live through the loss, with all the activations; at the head's backward its gradient joins it, with the layers'
  activations but, of the loss's buffers, only the logits' float32 gradient. The peak is the larger moment.
- **activations** kept for backward: per token and layer ``10*hidden + 3*intermediate + 2*heads*seq``
  values (attention inputs/outputs, norms, SwiGLU branches, attention scores and probabilities), 4 bytes
  each, 2 with a 16-bit or quantised LoRA base (a full-forward window computes in float32 whatever its frozen
  target's bits: :mod:`fedfusion.models.frozen`); no fused attention. With activation checkpointing
  (``train.checkpoint``) each layer keeps only its input (``hidden`` values per token) and one layer's values
  are live at a time in backward. Per token the
  logits: ``vocab`` values in the model's dtype, the loss's float32 copy where that dtype is narrower, the
  float32 log-softmax cross-entropy keeps and its float32 gradient (12 bytes per vocabulary entry at fp32, 14
  at 16 bits: on a
  135M base with a 49k vocabulary this is a fifth of the peak, measured on CUDA in
  ``benchmarks/results/cuda_lora.md``). On CPU these overcount: torch's SDPA kernel there (flash attention)
  keeps no attention probabilities, and the loss's forward, where most ways peak, holds the logits and their
  log-softmax but no gradient yet (``benchmarks/results/cpu_memory.md``: up to 11 % above the live tensors' peak).

A plan fits a device when its estimate is within ``usable`` (default 0.9) of the catalog's
``memory_gb`` (already the memory an app may use), the rest left for allocator fragmentation, the
runtime and the data pipeline. glibc's default malloc can take more: it keeps freed activation-sized blocks in the
process's heap, and a way's peak resident memory there runs up to 1.64 times the estimate (a rank window;
``benchmarks/results/cpu_memory.md``, where with glibc's mmap threshold fixed every way is within 15 %).

Time and energy per round come from :func:`fedfusion.devices.energy.price_work`, the cost model the run's ledger
prices every client with: the tier's training FLOPs (``6 x params x tokens``) and the bytes it moves each
round (what the server sends it, what it sends back), split into compute and transfer; joules are drawn
from the wall (charger losses included), as the ledger's ``energy_j``. Bytes are the arrays' data only; a
message adds a few hundred bytes of names and headers per array.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig

from fedfusion.devices.catalog import Device
from fedfusion.devices.energy import price_work

LORA_RANKS = (64, 32, 16, 8, 4, 2, 1)


BASE_BITS = (32, 16, 8, 4)  # preferred first: full precision, bf16, 8-bit, 4-bit


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


USABLE = 0.9


_BITS_STORED = {32: 32.0, 16: 16.0, 8: 8.5, 4: 4.5}  # bits per quantised weight, block scales included


FROZEN_BITS = {"float32": 32, "float16": 16, "int8": 8, "int4": 4}


def llama_params(config: LlamaConfig) -> int:
    """Parameter count of a Llama config (untied embeddings unless the config ties them)."""
    h, i, v, layers = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    kv = config.num_key_value_heads or config.num_attention_heads  # LlamaConfig's own default: one per head
    attn = h * d * (2 * config.num_attention_heads + 2 * kv)
    per_layer = attn + 3 * h * i + 2 * h
    heads = 1 if config.tie_word_embeddings else 2
    return layers * per_layer + heads * v * h + h


def param_count(config: PretrainedConfig) -> int:
    """Parameters of a causal-LM config: closed form for Llama-style configs, else counted on the meta device."""
    if isinstance(config, LlamaConfig):
        return llama_params(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def dims(config: PretrainedConfig) -> tuple[int, int, int, int, int, int]:
    """(hidden, intermediate, heads, kv heads, head_dim, layers) of a transformer config."""
    h = config.hidden_size
    inter = getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", None) \
        or getattr(config, "n_inner", None) or 4 * h
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or h // heads
    return h, inter, heads, kv, d, config.num_hidden_layers


def lora_params(config: PretrainedConfig, rank: int, modules: Sequence[str] = LORA_MODULES) -> int:
    """Trainable parameters of rank-``rank`` LoRA adapters on ``modules`` of every decoder layer (Llama names)."""
    h, inter, heads, kv, d, layers = dims(config)
    shapes = {"q_proj": (h, heads * d), "k_proj": (h, kv * d), "v_proj": (h, kv * d), "o_proj": (heads * d, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    unknown = [m for m in modules if m not in shapes]
    if unknown:
        raise ValueError(f"lora modules: unknown module {unknown[0]!r}; known: {', '.join(shapes)}")
    if rank < 1:
        raise ValueError(f"lora rank: must be >= 1, got {rank}")
    return layers * sum(rank * (shapes[m][0] + shapes[m][1]) for m in modules)


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak training memory, by part, in bytes (see the module docstring)."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    params: int  # all parameters of the model trained (base included)
    trainable: int
    step: int = 0  # the optimizer step's temporaries: live after backward has freed the activations
    tied: int = 0  # the tied embedding's gradients before they are summed (tied_grad_bytes), as late as the step
    with_dense: int = 0  # the activations' larger moment with a rank-r update's dense matrices (0: none)

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + max(self.activations, self.step, self.tied, self.with_dense)


def estimate_memory(
    config: PretrainedConfig, batch: int, seq: int, lora_rank: int | None = None, base_bits: int = 32,
    lora_modules: Sequence[str] = LORA_MODULES, compute_bytes: int = 2, window: int | None = None,
    checkpoint: bool = False, dense: int = 0,
) -> MemoryEstimate:
    """Peak training memory of full fine-tuning (``lora_rank=None``, fp32), LoRA on a ``base_bits`` base, or a
    full-forward window of ``window`` parameters (fp32, with its AdamW state) on a frozen ``base_bits`` target.

    A 4/8-bit base keeps its non-linear weights (embeddings, norms) and its activations in the compute dtype,
    ``compute_bytes`` per value (bitsandbytes' compute dtype: 4 for float32, 2 for float16/bfloat16); a
    32- or 16-bit base keeps them in its own precision; a window computes in float32. ``checkpoint``: activation
    checkpointing (each layer's input kept, one layer's activations live at a time). ``dense``: the bytes a rank-r
    update's dense matrices take at once (``fedfusion.fusion.submodel.plan.rank_dense_bytes``; with ``window``)."""
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be >= 1, got {batch}, {seq}")
    if base_bits not in _BITS_STORED:
        raise ValueError(f"base_bits: must be one of {', '.join(map(str, _BITS_STORED))}, got {base_bits}")
    if lora_rank is None and window is None and base_bits not in (32, 16):
        raise ValueError("base_bits: full training keeps its weights in 32 or 16 bits; 8 and 4 need lora_rank or window")
    h, inter, heads, kv, d, layers = dims(config)
    params = param_count(config)
    one_layer = layer_activation_values(batch * seq, seq, h, inter, heads)
    layer_values = batch * seq * layers * h + one_layer if checkpoint else layers * one_layer
    if lora_rank is None and window is None:  # 16: pure bfloat16 training, AdamW's moments in bfloat16 too
        b = base_bits // 8
        return MemoryEstimate(b * params, b * params, 2 * b * params,
                              b * layer_values + _logit_bytes(config, batch, seq, b), params, params, b * params,
                              tied=tied_grad_bytes(config, b))
    trainable = lora_params(config, lora_rank, lora_modules) if lora_rank is not None else int(window or 0)
    linear = linear_params(config)
    act_bytes = 4 if window is not None else base_bits // 8 if base_bits >= 16 else compute_bytes
    if base_bits >= 16:
        weights = params * base_bits / 8
    else:
        weights = linear * _BITS_STORED[base_bits] / 8 + (params - linear) * act_bytes
    activations = act_bytes * layer_values + _logit_bytes(config, batch, seq, act_bytes)
    with_dense = 0
    if dense:  # through the loss: the kept dense matrix; at the head's backward: it, its gradient, the logits' gradient
        with_dense = max(activations + dense // 2, act_bytes * layer_values + 4 * batch * seq * config.vocab_size + dense)
    return MemoryEstimate(int(weights) + 4 * trainable, 4 * trainable, 8 * trainable, activations,
                          params + (trainable if window is None else 0), trainable, 4 * trainable,
                          with_dense=with_dense)


def layer_activation_values(tokens: int, seq: int, hidden: int, intermediate: int, heads: int) -> int:
    """Values one decoder layer keeps for its backward over ``tokens`` tokens in windows of ``seq``: ten
    hidden-wide tensors (norm inputs and outputs, q, k, v, the attention output, residuals), three MLP-wide ones
    and the attention probabilities and scores (heads x seq per token)."""
    return tokens * (10 * hidden + 3 * intermediate + 2 * heads * seq)


def tied_grad_bytes(config: PretrainedConfig, grad_bytes: int) -> int:
    """What a trained embedding tied to the head adds at backward's end: the head's gradient (from the logits) and
    the input embedding's are separate vocabulary x hidden buffers that autograd then sums, out of place, into the
    shared weight's gradient, so two such buffers are live beside the gradients already counted (measured with
    activation checkpointing on SmolLM2-135M's shape, whole and a slice, where this moment is the peak:
    ``benchmarks/results/cpu_memory.md``). The activations are freed by then. 0 for an untied model."""
    return 2 * grad_bytes * config.vocab_size * config.hidden_size if config.tie_word_embeddings else 0


def linear_params(config: PretrainedConfig) -> int:
    """Values of the decoder layers' projection matrices (what a quantised base or frozen target holds narrow)."""
    h, inter, heads, kv, d, layers = dims(config)
    return layers * (h * heads * d * 2 + h * kv * d * 2 + 3 * h * inter)


def _logit_bytes(config: PretrainedConfig, batch: int, seq: int, act_bytes: int) -> int:
    """The logits' bytes at the loss: the model's output (``act_bytes`` per value), its float32 copy where the
    output is narrower (``fedfusion.train.loop.lm_loss`` and ``fedfusion.train.instruct.response_loss`` upcast), the
    float32 log-softmax the cross-entropy keeps for backward and the float32 gradient backward starts from
    (``benchmarks/results/cuda_windows.md``: with activation checkpointing it is a visible part of the peak)."""
    per_value = act_bytes + (4 if act_bytes < 4 else 0) + 4 + 4  # + the loss's float32 gradient, live with them
    return batch * seq * config.vocab_size * per_value


def training_memory_bytes(config: PretrainedConfig, batch: int, seq: int, checkpoint: bool = False) -> int:
    """fp32 AdamW training estimate: weights + grads + 2 moments, plus stored activations and logits."""
    return estimate_memory(config, batch, seq, checkpoint=checkpoint).total


def usable_bytes(device: Device, usable: float) -> float:
    """The bytes of ``device``'s memory a plan may fill: ``usable`` of the catalog's ``memory_gb``."""
    if not 0 < usable <= 1:
        raise ValueError(f"usable: must be in (0, 1], got {usable}")
    return device.memory_gb * 2**30 * usable


@dataclass(frozen=True)
class LoraFit:
    """A LoRA assignment that fits: adapter rank, bits of the frozen base, estimated bytes."""

    rank: int
    base_bits: int
    memory: MemoryEstimate


def fit_lora_rank(
    config: PretrainedConfig, device: Device, batch: int, seq: int, ranks: Sequence[int] = LORA_RANKS,
    base_bits: Sequence[int] = BASE_BITS, modules: Sequence[str] = LORA_MODULES, usable: float = USABLE,
    compute_bytes: int = 2,
) -> LoraFit | None:
    """The most precise base (in ``base_bits`` order) on which some rank fits, with the largest rank that
    fits on it; None if no (rank, precision) fits. Precision comes first: the base dominates memory,
    the adapters barely count."""
    budget = usable_bytes(device, usable)
    if not ranks:
        raise ValueError("ranks: give at least one LoRA rank")
    for bits in base_bits:
        for rank in sorted(ranks, reverse=True):
            est = estimate_memory(config, batch, seq, lora_rank=rank, base_bits=bits, lora_modules=modules,
                                  compute_bytes=compute_bytes)
            if est.total <= budget:
                return LoraFit(rank, bits, est)
    return None


def mb(n: float) -> float:
    return round(n / 2**20, 1)


# a plan row's cost columns, as :func:`priced` fills them
PLAN_COSTS = ("MB down", "MB up", "compute s", "transfer s", "s/round", "compute J", "transfer J", "J/round")


def priced(device: Device, flops: float, bytes_down: int, bytes_up: int) -> dict[str, float]:
    """A plan row's cost columns: ``price_work`` of one round's FLOPs and transfers on ``device``, time and
    wall joules split into compute and transfer (the totals are the ledger's ``virtual_s`` and ``energy_j``)."""
    cost = price_work(device, flops, bytes_down, bytes_up)
    return {"MB down": bytes_down / 2**20, "MB up": bytes_up / 2**20,
            "compute s": cost.compute_s, "transfer s": cost.comm_s, "s/round": cost.virtual_s,
            "compute J": cost.compute_wall_j, "transfer J": cost.radio_wall_j, "J/round": cost.wall_j}


UNPRICED = dict.fromkeys(PLAN_COSTS)  # the cost columns of a row that trains nothing
