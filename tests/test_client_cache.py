"""What a simulated client keeps between messages (clients/cache.py and the per-process data caches): the same
result as building afresh, and a key that misses when anything that determines the object differs."""

from __future__ import annotations

import json

import torch
from fedfusion.clients import submodel
from fedfusion.clients.cache import ENV, ModelCache, model_bytes
from flwr.app import ConfigRecord
from transformers import LlamaForCausalLM

from fedfusion.models.build import model_from_state
from fedfusion.train.loop import train_steps
from fedfusion.wire.specs import ModelSpec, TrainSpec
from tests.conftest import tiny_config


def _state(seed: int, **sizes: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(**sizes)).state_dict()


def _trained(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    windows = torch.randint(0, 50, (8, 9), generator=torch.Generator().manual_seed(seed))
    train_steps(model, windows, steps=3, lr=0.01, batch_size=4, seed=seed)  # type: ignore[arg-type]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_cached_model_trains_exactly_as_a_fresh_one():
    """A model reused for a second message (after training on another) holds that message's state and trains
    to the same bits as a model built for it alone: nothing of the first message survives."""
    cache, config = ModelCache(), tiny_config()
    first, second = _state(1), _state(2)
    model = cache.model("k", lambda: model_from_state(config, first), first)
    _trained(model, seed=5)
    again = cache.model("k", lambda: model_from_state(config, second), second)
    assert again is model and (cache.hits, cache.misses) == (1, 1)
    assert all(p.grad is None for p in again.parameters())  # the first message's gradients are gone
    assert all(torch.equal(again.state_dict()[k], v) for k, v in second.items())
    expected = _trained(model_from_state(config, second), seed=7)
    got = _trained(again, seed=7)
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_the_cache_is_keyed_bounded_and_can_be_switched_off(monkeypatch):
    cache = ModelCache(max_models=2)
    small, wide = tiny_config(), tiny_config(hidden=64, heads=4, kv_heads=4, inter=96)
    a, b = _state(1), _state(1, hidden=64, heads=4, kv_heads=4, inter=96)
    one = cache.model(("submodel", "small"), lambda: model_from_state(small, a), a)
    other = cache.model(("submodel", "wide"), lambda: model_from_state(wide, b), b)
    assert one is not other and cache.misses == 2  # a different key is a miss
    cache.model(("smallmodel", "small"), lambda: model_from_state(small, a), a)
    assert len(cache.models) == 2 and ("submodel", "small") not in cache.models  # least recently used out
    tight = ModelCache(max_bytes=model_bytes(one) - 1)
    tight.model("k", lambda: model_from_state(small, a), a)
    assert not tight.models  # larger than the byte budget: never kept
    monkeypatch.setenv(ENV, "0")
    off = ModelCache()
    assert off.model("k", lambda: model_from_state(small, a), a) is not off.model("k", lambda: model_from_state(small, a), a)
    assert not off.models


def test_the_submodel_role_keys_its_model_by_config_accelerator_and_checkpointing(monkeypatch):
    cache = ModelCache()
    monkeypatch.setattr(submodel, "MODELS", cache)
    config = tiny_config()

    def spec(cfg, checkpoint: bool = False) -> ConfigRecord:
        return ConfigRecord({**ModelSpec(cfg.to_dict()).to_config(), TrainSpec.key("checkpoint"): checkpoint})

    state = _state(3)
    m1 = submodel._model(state, spec(config))
    assert submodel._model(_state(4), spec(config)) is m1  # same config: reloaded, not rebuilt
    assert torch.equal(m1.state_dict()["model.norm.weight"], _state(4)["model.norm.weight"])
    assert submodel._model(state, spec(config, checkpoint=True)) is not m1
    other = tiny_config(inter=96)
    assert submodel._model(_state(3, inter=96), spec(other)) is not m1
    assert json.loads(json.dumps(config.to_dict(), sort_keys=True))  # the key is the config as it travels
    assert cache.misses == 3 and cache.hits == 1


def test_client_data_is_cached_per_spec_and_a_different_spec_misses():
    """The tokenised windows of a client are built once per (data spec, partition, seq_len, split) in a process;
    another data spec (here another seed, which draws other speakers) or partition is a miss with its own data."""
    from fedfusion.config.recipe import load_recipe
    from fedfusion.data.population import client_windows, data_spec

    recipe = load_recipe("quickstart")
    spec = data_spec(recipe.data_source())
    recipe.seed = 1
    other = data_spec(recipe.data_source())
    first = client_windows(spec, 0, 64, "train")
    before = client_windows.cache_info()
    assert client_windows(spec, 0, 64, "train") is first
    assert client_windows.cache_info().hits == before.hits + 1
    assert not torch.equal(client_windows(other, 0, 64, "train")[:4], first[:4])
    assert client_windows(spec, 1, 64, "train") is not first
    assert client_windows.cache_info().misses == before.misses + 2
