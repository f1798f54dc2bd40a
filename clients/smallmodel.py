"""Client role for distillation fusion: train this device's small family model on local text.

The message carries the family's global weights, its Hugging Face config (any causal-LM family:
``model_type`` llama, gpt2, ...) and its tokenizer (empty = the target's tokenizer; otherwise a
``tokenizers`` JSON string), so the client needs no server state.
"""

from __future__ import annotations

import json
from functools import lru_cache

import torch
from fedfusion.clients.cache import MODELS
from fedfusion.clients.node import Stateless
from fedfusion.clients.submodel import inject_faults, local_steps, set_threads, trained_reply
from flwr.app import ConfigRecord
from transformers import PreTrainedModel

from fedfusion.data.population import client_windows, population_data
from fedfusion.data.text import encode_text, lm_windows
from fedfusion.fusion.distill.spec import FamilySpec
from fedfusion.models.build import small_model
from fedfusion.train.loop import evaluate_lm, train_steps
from fedfusion.train.transfer import wrap_tokenizer
from fedfusion.wire.keys import NUM_EXAMPLES
from fedfusion.wire.specs import ClientSpec, ModelSpec

Node = Stateless  # this role keeps nothing on its node (fedfusion.clients.node)


@lru_cache(maxsize=64)
def family_windows(data_spec: str, partition: int, seq_len: int, split: str, tokenizer_json: str) -> torch.Tensor:
    """Token windows of one client's text in its family's tokenizer (cached: Ray actors persist)."""
    if not tokenizer_json:
        return client_windows(data_spec, partition, seq_len, split)
    clients = population_data(data_spec)
    if not 0 <= partition < len(clients):
        raise ValueError(f"partition-id {partition} is outside the population of {len(clients)} clients")
    return lm_windows(encode_text(wrap_tokenizer(tokenizer_json), getattr(clients[partition], split)), seq_len)


def _windows(spec: ConfigRecord, partition: int, split: str) -> torch.Tensor:
    client = ClientSpec.from_config(spec)
    return family_windows(client.data_spec, partition, client.seq_len, split, FamilySpec.from_config(spec).tokenizer_json)


def _model(state: dict[str, torch.Tensor], spec: ConfigRecord, accelerator: str) -> PreTrainedModel:
    """The family's model holding ``state``, built once per (config, accelerator) in this process
    (:mod:`fedfusion.clients.cache`)."""
    config = json.dumps(ModelSpec.from_config(spec).model_config)

    def build() -> PreTrainedModel:
        model = small_model(config, state)
        return model.to(accelerator)  # type: ignore[arg-type]  # transformers' functools.wraps on .to reads as unbound

    return MODELS.model(("smallmodel", config, accelerator), build, state)  # type: ignore[return-value]


def train(state: dict[str, torch.Tensor], spec: ConfigRecord, partition: int, accelerator: str = "cpu",
          node: Stateless | None = None) -> tuple[dict, dict]:
    """Train the family model in ``state`` as ``spec`` says; returns the new state and reply metrics."""
    faults = inject_faults(spec, partition)  # an injected crash happens before any work
    set_threads(spec)
    windows = _windows(spec, partition, "train")
    model = _model(state, spec, accelerator)
    return trained_reply(model, windows, faults, lambda: train_steps(model, windows, **local_steps(spec)))


def evaluate(state: dict[str, torch.Tensor], spec: ConfigRecord, partition: int, accelerator: str = "cpu") -> dict:
    """Score the family model in ``state`` on this client's held-out text (in the family's tokens)."""
    set_threads(spec)
    windows = _windows(spec, partition, "held_out")
    return {NUM_EXAMPLES: int(windows.shape[0]), **evaluate_lm(_model(state, spec, accelerator), windows)}
