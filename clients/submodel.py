"""Client role for sub-model fusion: rebuild the sub-model from the message spec, train or evaluate it."""

from __future__ import annotations

import json
from functools import lru_cache

import torch
from flwr.app import ConfigRecord
from transformers import LlamaConfig

from fedfusion.data import encode_text, lm_windows
from fedfusion.models import load_tokenizer, model_from_state
from fedfusion.population import population_data
from fedfusion.training import evaluate_lm, train_steps


@lru_cache(maxsize=64)
def client_windows(spec: str, partition: int, seq_len: int, split: str) -> torch.Tensor:
    """Token windows of one client's ``train`` or ``held_out`` text (cached: Ray actors persist)."""
    clients = population_data(spec)
    if not 0 <= partition < len(clients):
        raise ValueError(f"partition-id {partition} is outside the population of {len(clients)} clients")
    text = getattr(clients[partition], split)
    return lm_windows(encode_text(load_tokenizer(json.loads(spec)["tokenizer"]), text), seq_len)


def _model(state: dict[str, torch.Tensor], spec: ConfigRecord):
    return model_from_state(LlamaConfig.from_dict(json.loads(str(spec["model-config"]))), state)


def train(state: dict[str, torch.Tensor], spec: ConfigRecord, partition: int) -> tuple[dict, dict]:
    """Train the sub-model in ``state`` as ``spec`` says; returns the new state and reply metrics."""
    torch.set_num_threads(int(spec["threads"]))
    windows = client_windows(str(spec["data-spec"]), partition, int(spec["seq-len"]), "train")
    model = _model(state, spec)
    stats = train_steps(
        model, windows, steps=int(spec["local-steps"]), lr=float(spec["lr"]),
        batch_size=int(spec["batch-size"]), seed=int(spec["seed"]), weight_decay=float(spec["weight-decay"]),
    )
    new_state = {k: v.detach() for k, v in model.state_dict().items()}
    return new_state, {"num-examples": int(windows.shape[0]), **stats}


def evaluate(state: dict[str, torch.Tensor], spec: ConfigRecord, partition: int) -> dict:
    """Score the model in ``state`` on this client's held-out text."""
    torch.set_num_threads(int(spec["threads"]))
    windows = client_windows(str(spec["data-spec"]), partition, int(spec["seq-len"]), "held_out")
    return {"num-examples": int(windows.shape[0]), **evaluate_lm(_model(state, spec), windows)}
