"""Where each model family keeps its slicing axes: per-parameter rules read by the slicing engine.

A family says, for every parameter of its Hugging Face model, which leading dimension belongs to which
axis and over which axes the tensor contracts (those get the HeteroFL scaler folded in), plus how a
plan shrinks its config. The engine (:mod:`fedfusion.models.slicing`) does the indexing, renaming and averaging
the same way for every family.

Axes (names used in recipes and :func:`fedfusion.models.slicing.plan_slice`):

- ``heads``: attention units. Llama/Mistral/Qwen2: one kv head with its query heads (GQA groups stay
  whole); GPT-2/OPT: one head. GPT-2 and OPT compute ``head_dim = hidden / heads``, so there the
  attention width *is* the hidden width: ``heads`` and ``hidden`` are sliced together, with
  ``heads x head_dim`` hidden dims kept.
- ``neurons``: MLP intermediate neurons.
- ``hidden``: residual-stream dims: embeddings (token and position), every norm, every projection's
  input dims, the rows written back into the residual stream, the (possibly tied) lm_head. The scaler
  for contractions over hidden dims is folded into the consuming projections, and for the lm_head into
  the final norm's weight and bias, so tied embeddings stay tied.
- ``depth``: decoder layers (the engine renames kept layers to 0..n-1).
- ``channels``: CNN GroupNorm groups (a group's channels in every conv block, see :mod:`fedfusion.models.cnn`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification, PretrainedConfig

from fedfusion.models.cnn import FedCNNConfig


@dataclass(frozen=True)
class Dim:
    """One tensor dimension on an axis: each unit owns ``block`` consecutive coordinates, repeated in
    each of ``parts`` equal parts (GPT-2's fused q|k|v columns have 3 parts)."""

    axis: str
    block: int = 1
    parts: int = 1


@dataclass(frozen=True)
class Rule:
    """How one parameter is sliced: its leading dims (None = whole; missing trailing dims are whole) and
    the axes it contracts over (each folds in full/kept units as the scaler)."""

    dims: tuple[Dim | None, ...] = ()
    contracts: tuple[str, ...] = ()


WHOLE = Rule()


class Family:
    """Base: a model family's axes, rules and config arithmetic."""

    name = ""
    model_types: tuple[str, ...] = ()
    axes: tuple[str, ...] = ()  # in planning order; ``heads`` before ``hidden`` (GPT-2/OPT couple them)
    default_axes: tuple[str, ...] = ()
    layer_key: re.Pattern | None = None  # group 2 = the layer index in a parameter name
    hidden_follows_heads = False
    auto: type[AutoModelForCausalLM] | type[AutoModelForImageClassification] = AutoModelForCausalLM

    def sizes(self, config: PretrainedConfig) -> dict[str, int]:
        """Units per axis (depth: number of layers)."""
        raise NotImplementedError

    def head_dim(self, config: PretrainedConfig) -> int:
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def check(self, config: PretrainedConfig, axes: tuple[str, ...]) -> None:
        """Raise ValueError if this config cannot be sliced along ``axes``."""
        unknown = [a for a in axes if a not in self.axes]
        if unknown:
            raise ValueError(f"axes {unknown}: a {self.name} model slices only {', '.join(self.axes)}")
        if self.hidden_follows_heads and ("heads" in axes) != ("hidden" in axes):
            raise ValueError(
                f"axes: a {self.name} model has head_dim = hidden / heads, so 'heads' and 'hidden' must be sliced together"
            )

    def rule(self, name: str, config: PretrainedConfig) -> Rule:
        """The slicing rule of parameter ``name``; ValueError for a parameter this family does not know."""
        raise NotImplementedError

    def sub_config(self, config: PretrainedConfig, counts: dict[str, int], layers: tuple[int, ...]) -> PretrainedConfig:
        """A copy of ``config`` with ``counts`` units per axis and the per-layer settings of ``layers``."""
        raise NotImplementedError

    def growth_factor(self, name: str, config: PretrainedConfig, c: float) -> float:
        """What growing a small model into the target multiplies its tensor ``name`` by when the residual stream's
        kept dims grow by ``c = sqrt(N / n)`` (:mod:`fedfusion.models.growth`); 1 when no hidden dim is added."""
        if c == 1.0:
            return 1.0
        raise ValueError(f"growth: a {self.name} model normalises with LayerNorm over its hidden dims, which new zero "
                         "dims would shift; grow it along heads, neurons or depth only")

    def build(self, config: PretrainedConfig):
        """A freshly initialised model of ``config`` (the class ordinary HF code would pick)."""
        return self.auto.from_config(config)

    def param_count(self, config: PretrainedConfig) -> int:
        """Distinct parameters of a model of ``config`` (built on the meta device: no memory, no init)."""
        with torch.device("meta"):
            return sum(p.numel() for p in self.build(config).parameters())


def _copy(config: PretrainedConfig) -> PretrainedConfig:
    return type(config).from_dict(config.to_dict())


def _unknown(family: str, name: str) -> ValueError:
    return ValueError(f"parameter {name!r}: not a {family} parameter the slicer knows")


H = Dim("hidden")


class LlamaFamily(Family):
    """Llama, Mistral, Qwen2: RMSNorm, SwiGLU MLP, RoPE, GQA (optional q/k/v, o, MLP biases)."""

    name = "llama"
    model_types = ("llama", "mistral", "qwen2")
    axes = ("heads", "neurons", "hidden", "depth")
    default_axes = ("heads", "neurons")
    layer_key = re.compile(r"(^|\.)layers\.(\d+)\.")

    def sizes(self, config):
        return {"heads": config.num_key_value_heads, "neurons": config.intermediate_size,
                "hidden": config.hidden_size, "depth": config.num_hidden_layers}

    def rule(self, name, config):
        d = self.head_dim(config)
        group = config.num_attention_heads // config.num_key_value_heads
        unit = {"q_proj": group * d, "k_proj": d, "v_proj": d}
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return Rule((None, H))
        if name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
            return Rule((H,))
        if name.endswith("norm.weight"):  # the final norm carries the lm_head's hidden scaler
            return Rule((H,), ("hidden",))
        match = re.search(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.(weight|bias)$", name)
        if not match:
            raise _unknown(self.name, name)
        proj, kind = match.groups()
        if proj in unit:
            heads = Dim("heads", unit[proj])
            return Rule((heads, H), ("hidden",)) if kind == "weight" else Rule((heads,))
        if proj == "o_proj":
            return Rule((H, Dim("heads", group * d)), ("heads",)) if kind == "weight" else Rule((H,))
        if proj in ("gate_proj", "up_proj"):
            return Rule((Dim("neurons"), H), ("hidden",)) if kind == "weight" else Rule((Dim("neurons"),))
        return Rule((H, Dim("neurons")), ("neurons",)) if kind == "weight" else Rule((H,))

    def growth_factor(self, name, config, c):
        """Writes into the residual stream (token embedding, o_proj, down_proj; the lm_head when tied) grow by ``c``
        so every RMSNorm sees the same mean square over N dims (zeros included) as over n; norms shrink by ``c`` so
        what layers read is unchanged, the final norm once more when the lm_head (the embedding) grew."""
        if c == 1.0:
            return 1.0
        tied = bool(getattr(config, "tie_word_embeddings", False))
        if re.search(r"(embed_tokens\.weight|\.(o_proj|down_proj)\.(weight|bias))$", name) or (
                tied and name.endswith("lm_head.weight")):
            return c
        if name.endswith("norm.weight"):
            final = self.layer_key is not None and self.layer_key.search(name) is None
            return 1 / c**2 if final and tied else 1 / c
        return 1.0

    def sub_config(self, config, counts, layers):
        group = config.num_attention_heads // config.num_key_value_heads
        sub = _copy(config)
        sub.head_dim = self.head_dim(config)  # pinned: a head keeps its size whatever the hidden width
        sub.num_key_value_heads = counts["heads"]
        sub.num_attention_heads = counts["heads"] * group
        sub.intermediate_size = counts["neurons"]
        sub.hidden_size = counts["hidden"]
        sub.num_hidden_layers = len(layers)
        if getattr(config, "layer_types", None) is not None:
            sub.layer_types = [config.layer_types[i] for i in layers]
        return sub


class GPT2Family(Family):
    """GPT-2: LayerNorm with bias, learned positions, Conv1D weights stored (in, out), fused q|k|v."""

    name = "gpt2"
    model_types = ("gpt2",)
    axes = ("heads", "neurons", "hidden", "depth")
    default_axes = ("heads", "neurons", "hidden")
    layer_key = re.compile(r"(^|\.)h\.(\d+)\.")
    hidden_follows_heads = True

    def sizes(self, config):
        return {"heads": config.n_head, "neurons": config.n_inner or 4 * config.n_embd,
                "hidden": config.n_embd, "depth": config.n_layer}

    def check(self, config, axes):
        super().check(config, axes)
        if "depth" in axes and config.scale_attn_by_inverse_layer_idx:
            raise ValueError("axes: depth slicing would change scale_attn_by_inverse_layer_idx's per-layer scale")

    def rule(self, name, config):
        d = self.head_dim(config)
        if name.endswith(("wte.weight", "wpe.weight", "lm_head.weight")):
            return Rule((None, H))
        if re.search(r"\.ln_[12]\.(weight|bias)$", name):
            return Rule((H,))
        if re.search(r"\.ln_f\.(weight|bias)$", name):
            return Rule((H,), ("hidden",))
        match = re.search(r"\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.(weight|bias)$", name)
        if not match:
            raise _unknown(self.name, name)
        proj, kind = match.groups()
        qkv, heads, neurons = Dim("heads", d, parts=3), Dim("heads", d), Dim("neurons")
        return {
            ("attn.c_attn", "weight"): Rule((H, qkv), ("hidden",)), ("attn.c_attn", "bias"): Rule((qkv,)),
            ("attn.c_proj", "weight"): Rule((heads, H), ("heads",)), ("attn.c_proj", "bias"): Rule((H,)),
            ("mlp.c_fc", "weight"): Rule((H, neurons), ("hidden",)), ("mlp.c_fc", "bias"): Rule((neurons,)),
            ("mlp.c_proj", "weight"): Rule((neurons, H), ("neurons",)), ("mlp.c_proj", "bias"): Rule((H,)),
        }[(proj, kind)]

    def sub_config(self, config, counts, layers):
        sub = _copy(config)
        sub.n_head, sub.n_inner, sub.n_embd, sub.n_layer = counts["heads"], counts["neurons"], counts["hidden"], len(layers)
        return sub


class OPTFamily(Family):
    """OPT (the seed paper's family): q/k/v/out_proj and fc1/fc2 with biases, LayerNorm with bias,
    learned positional embeddings (offset 2), tied lm_head."""

    name = "opt"
    model_types = ("opt",)
    axes = ("heads", "neurons", "hidden", "depth")
    default_axes = ("heads", "neurons", "hidden")
    layer_key = re.compile(r"(^|\.)layers\.(\d+)\.")
    hidden_follows_heads = True

    def sizes(self, config):
        return {"heads": config.num_attention_heads, "neurons": config.ffn_dim,
                "hidden": config.hidden_size, "depth": config.num_hidden_layers}

    def check(self, config, axes):
        super().check(config, axes)
        pre_norm = config.do_layer_norm_before and not config._remove_final_layer_norm
        if "hidden" in axes and (config.word_embed_proj_dim != config.hidden_size or not pre_norm
                                 or not config.layer_norm_elementwise_affine):
            raise ValueError(
                "axes: hidden slicing of OPT needs the pre-norm layout of OPT-125m (do_layer_norm_before, an affine "
                "final LayerNorm, word_embed_proj_dim == hidden_size)"
            )

    def rule(self, name, config):
        d = self.head_dim(config)
        if name.endswith(("embed_tokens.weight", "embed_positions.weight", "lm_head.weight")):
            return Rule((None, H))
        if name.endswith(("project_in.weight", "project_out.weight")):
            return WHOLE  # only present when word_embed_proj_dim != hidden_size, where hidden is never sliced
        if self.layer_key.search(name) is None and re.search(r"final_layer_norm\.(weight|bias)$", name):
            return Rule((H,), ("hidden",))
        if re.search(r"(self_attn_layer_norm|final_layer_norm)\.(weight|bias)$", name):
            return Rule((H,))
        match = re.search(r"\.(q_proj|k_proj|v_proj|out_proj|fc1|fc2)\.(weight|bias)$", name)
        if not match:
            raise _unknown(self.name, name)
        proj, kind = match.groups()
        heads, neurons = Dim("heads", d), Dim("neurons")
        if proj in ("q_proj", "k_proj", "v_proj"):
            return Rule((heads, H), ("hidden",)) if kind == "weight" else Rule((heads,))
        if proj == "out_proj":
            return Rule((H, heads), ("heads",)) if kind == "weight" else Rule((H,))
        if proj == "fc1":
            return Rule((neurons, H), ("hidden",)) if kind == "weight" else Rule((neurons,))
        return Rule((H, neurons), ("neurons",)) if kind == "weight" else Rule((H,))

    def sub_config(self, config, counts, layers):
        sub = _copy(config)
        if config.word_embed_proj_dim == config.hidden_size:
            sub.word_embed_proj_dim = counts["hidden"]
        sub.hidden_size, sub.num_attention_heads = counts["hidden"], counts["heads"]
        sub.ffn_dim, sub.num_hidden_layers = counts["neurons"], len(layers)
        return sub


class CNNFamily(Family):
    """:class:`fedfusion.models.cnn.FedCNN`: a unit is one GroupNorm group, i.e. ``channels[l] / groups``
    consecutive channels of block ``l``; every block keeps the same groups."""

    name = "cnn"
    model_types = (FedCNNConfig.model_type,)
    axes = ("channels",)
    default_axes = ("channels",)
    auto = AutoModelForImageClassification

    def sizes(self, config):
        return {"channels": config.groups}

    def rule(self, name, config):
        blocks = [c // config.groups for c in config.channels]
        match = re.fullmatch(r"blocks\.(\d+)\.(conv|norm)\.(weight|bias)", name)
        if match:
            layer, kind = int(match.group(1)), match.group(2) + "." + match.group(3)
            out = Dim("channels", blocks[layer])
            if kind != "conv.weight" or layer == 0:
                return Rule((out,))
            return Rule((out, Dim("channels", blocks[layer - 1])), ("channels",))
        if name == "head.weight":
            return Rule((None, Dim("channels", blocks[-1])), ("channels",))
        if name == "head.bias":
            return WHOLE
        raise _unknown(self.name, name)

    def sub_config(self, config, counts, layers):
        sub = _copy(config)
        sub.channels = [c // config.groups * counts["channels"] for c in config.channels]
        sub.groups = counts["channels"]
        return sub


FAMILIES: tuple[Family, ...] = (LlamaFamily(), GPT2Family(), OPTFamily(), CNNFamily())
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def family_of(config: PretrainedConfig) -> Family:
    """The family that slices ``config``, by its ``model_type``."""
    model_type = getattr(config, "model_type", None)
    if model_type not in _BY_TYPE:
        raise ValueError(f"model_type {model_type!r}: width slicing supports {', '.join(sorted(_BY_TYPE))}")
    return _BY_TYPE[model_type]


def config_from_dict(data: dict) -> PretrainedConfig:
    """A config of any supported family from its ``to_dict()`` (e.g. the JSON a client receives)."""
    data = dict(data)
    model_type = data.pop("model_type", None)
    if model_type not in _BY_TYPE:
        raise ValueError(f"model_type {model_type!r}: width slicing supports {', '.join(sorted(_BY_TYPE))}")
    return AutoConfig.for_model(model_type, **data)
