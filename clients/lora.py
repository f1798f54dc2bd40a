"""Client role for LoRA fusion: a frozen pretrained base (optionally 4-/8-bit), peft LoRA adapters of this
client's rank, trained on its instruction pairs (response tokens), or on facts data (``data.source=facts``) on its
documents' token windows (every token).

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
transformers' progress bars ("Loading weights", "Writing model shards") are off in a process that imports this
role: every simulated client printed its own for every base it loaded, and the run shows its own progress.
"""

from __future__ import annotations

import time
from functools import lru_cache

import torch
from fedfusion.clients.node import Stateless
from fedfusion.clients.privacy import private_training
from fedfusion.clients.submodel import inject_faults, set_threads
from flwr.app import ConfigRecord
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from fedfusion.data.instruct import instruct_clients
from fedfusion.data.population import client_windows, windows_spec
from fedfusion.devices.meters import HostMeter, gpu_index
from fedfusion.fusion.lora.spec import AdapterSpec, LoRABaseSpec, QuantizeSpec
from fedfusion.models.adapters import merged_update
from fedfusion.models.pretrained import load_base, load_base_tokenizer
from fedfusion.train.adapter import AdapterSetting, train_adapter
from fedfusion.train.instruct import RESPONSE, InstructData, encode_pairs, evaluate_instruct
from fedfusion.train.loop import LM, evaluate_lm
from fedfusion.wire.keys import NUM_EXAMPLES
from fedfusion.wire.specs import ClientSpec, RoundSpec, TrainSpec

Node = Stateless  # this role keeps nothing on its node (fedfusion.clients.node)

hf_logging.disable_progress_bar()


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
    """This client's number of training pairs (or windows), for the capability query (its client and LoRA base
    specs)."""
    return len(_data(spec, partition, "train"))


def _data(spec: ConfigRecord, partition: int, split: str) -> InstructData | torch.Tensor:
    """This client's instruction pairs, or for a population's data spec (facts) its documents' token windows."""
    client = ClientSpec.from_config(spec)
    if windows_spec(client.data_spec):
        return client_windows(client.data_spec, partition, client.seq_len, split)
    return client_data(client.data_spec, partition, LoRABaseSpec.from_config(spec).base, client.seq_len, split)


def _base(spec: ConfigRecord, accelerator: str) -> PreTrainedModel:
    base = LoRABaseSpec.from_config(spec)
    return frozen_base(base.base, QuantizeSpec.from_config(spec).quantize, base.dtype, accelerator)


def train(arrays: dict[str, torch.Tensor], spec: ConfigRecord, partition: int, accelerator: str = "cpu",
          node: Stateless | None = None) -> tuple[dict, dict]:
    """Train this client's adapter as ``spec`` says; returns the adapter tensors and reply metrics."""
    corrupt, delay = inject_faults(spec, partition)
    set_threads(spec)
    data = _data(spec, partition, "train")
    adapter, lora, train = AdapterSpec.from_config(spec), LoRABaseSpec.from_config(spec), TrainSpec.from_config(spec)
    seed = RoundSpec.from_config(spec).seed
    base = _base(spec, accelerator)
    setting = AdapterSetting(adapter.rank, adapter.alpha, tuple(lora.target_modules), lora.lora_dropout)
    meter = HostMeter(gpu_index(base.device))  # the host's own meters (labelled, not priced)
    factors, result = train_adapter(base, arrays, data, setting, seed, steps=train.local_steps, lr=train.lr,
                                    batch_size=train.batch_size, weight_decay=train.weight_decay,
                                    loss=LM if isinstance(data, torch.Tensor) else RESPONSE,
                                    dp=private_training(spec), meter=meter)
    stats = {**result.metrics(), **meter.metrics()}
    if corrupt:
        next(iter(factors.values())).view(-1)[0] = float("nan")
    time.sleep(delay)
    return factors, {NUM_EXAMPLES: len(data), **stats}


def evaluate(arrays: dict[str, torch.Tensor], spec: ConfigRecord, partition: int, accelerator: str = "cpu") -> dict:
    """Response loss of base + the global update (sent as frozen ``m.merged_*`` arrays) on this
    client's held-out pairs (facts: the language-model loss on its held-out windows)."""
    set_threads(spec)
    data = _data(spec, partition, "held_out")
    base = _base(spec, accelerator)
    with merged_update(base, arrays):
        scores = evaluate_lm(base, data) if isinstance(data, torch.Tensor) else evaluate_instruct(base, data)
        return {NUM_EXAMPLES: len(data), **scores}
