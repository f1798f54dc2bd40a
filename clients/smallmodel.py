"""Client role for distillation fusion: train this device's small family model on local text.

The message carries the family's global weights, its Hugging Face config (any causal-LM family:
``model_type`` llama, gpt2, ...) and its tokenizer (empty = the target's tokenizer; otherwise a
``tokenizers`` JSON string), so the client needs no server state.
"""

from __future__ import annotations

import json
from functools import lru_cache

import torch
from fedfusion.clients.submodel import (
    client_windows,
    inject_faults,
    local_steps,
    trained_reply,
)
from flwr.app import ConfigRecord
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from fedfusion.data import encode_text, lm_windows
from fedfusion.models import full_state, tied_aliases
from fedfusion.population import population_data
from fedfusion.training import evaluate_lm, train_steps
from fedfusion.transfer import wrap_tokenizer

MODEL_TYPES = ("llama", "gpt2")


def family_config(
    model_type: str, tokenizer: PreTrainedTokenizerBase, hidden_size: int, num_layers: int, num_heads: int,
    num_kv_heads: int | None = None, intermediate_size: int | None = None, max_position: int = 512,
) -> PretrainedConfig:
    """The config of a small family: a Llama (RMSNorm, SwiGLU, RoPE, GQA) or a GPT-2 (LayerNorm, GELU,
    learned positions), sized to ``tokenizer``'s vocabulary. ``intermediate_size`` defaults to 4 x hidden."""
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}")
    if hidden_size % num_heads:
        raise ValueError(f"num_heads {num_heads} does not divide hidden_size {hidden_size}")
    ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
           "eos_token_id": tokenizer.eos_token_id}
    inner = intermediate_size or 4 * hidden_size
    if model_type == "gpt2":
        return GPT2Config(vocab_size=len(tokenizer), n_embd=hidden_size, n_layer=num_layers, n_head=num_heads,
                          n_inner=inner, n_positions=max_position, **ids)
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=inner, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads or num_heads,
        head_dim=hidden_size // num_heads, max_position_embeddings=max_position, tie_word_embeddings=False, **ids,
    )


def small_model(config_json: str, state: dict[str, torch.Tensor] | None = None) -> PreTrainedModel:
    """A causal LM of the family config (JSON of ``PretrainedConfig.to_dict()``), holding ``state`` if given."""
    config = dict(json.loads(config_json))
    model_type = config.pop("model_type", None)
    if not model_type:
        raise ValueError("model-config has no model_type")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
    if state is not None:
        model.load_state_dict(full_state(state, tied_aliases(model)), strict=True)
    return model


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
    return family_windows(str(spec["data-spec"]), partition, int(spec["seq-len"]), split,
                          str(spec.get("tokenizer-json", "")))


def train(state: dict[str, torch.Tensor], spec: ConfigRecord, partition: int,
          accelerator: str = "cpu") -> tuple[dict, dict]:
    """Train the family model in ``state`` as ``spec`` says; returns the new state and reply metrics."""
    faults = inject_faults(spec, partition)  # an injected crash happens before any work
    torch.set_num_threads(int(spec["threads"]))
    windows = _windows(spec, partition, "train")
    model = small_model(str(spec["model-config"]), state).to(accelerator)
    return trained_reply(model, windows, faults, lambda: train_steps(model, windows, **local_steps(spec)))


def evaluate(state: dict[str, torch.Tensor], spec: ConfigRecord, partition: int, accelerator: str = "cpu") -> dict:
    """Score the family model in ``state`` on this client's held-out text (in the family's tokens)."""
    torch.set_num_threads(int(spec["threads"]))
    windows = _windows(spec, partition, "held_out")
    return {"num-examples": int(windows.shape[0]),
            **evaluate_lm(small_model(str(spec["model-config"]), state).to(accelerator), windows)}
