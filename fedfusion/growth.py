"""Function-preserving growth: a trained small model placed inside the target so that the target computes exactly
what the small model computes (logits equal to float rounding), and can then learn more.

The small model is a slice of the target (a :class:`~fedfusion.slicing.SlicePlan`: the units it holds on each
axis, e.g. the static prefix that ``smallest-only`` training trains). Growing writes its weights into those
coordinates of a freshly initialised target and silences everything else:

- **new heads and MLP neurons** (and whole **new layers**): their input weights keep the target's random
  initialisation, their output weights (the projections that write into the residual stream: ``o_proj`` /
  ``down_proj``, GPT-2's ``c_proj``, OPT's ``out_proj`` / ``fc2``, with their biases) start at zero. A new unit
  adds nothing to the residual stream, so the function is unchanged; its output weights get a non-zero
  gradient at once (its activations are random and differ from unit to unit), so new units do not stay
  identical or silent after the first step. This is MSG's masked growth (arXiv 2305.02869) with the mask
  folded into a zero initialisation, the choice that keeps growth exact for any width, not only integer
  multiples (HyperCloning, arXiv 2409.12903, duplicates units and so needs integer ratios and noise).
- **new residual dims** (Llama-style RMSNorm models only): the new dims of the token embedding and of every
  residual write start at zero, so they stay zero through the network; the kept dims of those writes are
  multiplied by ``c = sqrt(N / n)`` so every RMSNorm sees the same mean square (``eps`` acts as before), and
  every norm weight is divided by ``c`` so what the layers read is unchanged (the final norm once more with
  tied embeddings, whose lm_head grew by ``c``). LayerNorm models
  (GPT-2, OPT) subtract the mean over the hidden dims, which zero dims would shift: their hidden axis is not
  grown (a ValueError says so).

No Flower import: the schedule that uses it is :mod:`fedfusion.fusion.submodel`'s ``grow`` round.
"""

from __future__ import annotations

import math

import torch
from transformers import PretrainedConfig

from fedfusion.slice_families import family_of
from fedfusion.slicing import SlicePlan, scatter, sliced_shape, tensor_slices

State = dict[str, torch.Tensor]
_UNIT_AXES = ("heads", "neurons")
_EMBEDDINGS = ("embed_tokens.weight",)


def writers(config: PretrainedConfig, names: list[str]) -> set[str]:
    """The parameters that write into the residual stream: every weight whose slicing rule contracts over heads
    or neurons (an attention or MLP output projection), and that module's bias."""
    family = family_of(config)
    weights = {n for n in names if n.endswith(".weight") and set(family.rule(n, config).contracts) & set(_UNIT_AXES)}
    return weights | {n[: -len("weight")] + "bias" for n in weights if n[: -len("weight")] + "bias" in names}


def hidden_factor(config: PretrainedConfig, plan: SlicePlan) -> float:
    """sqrt(N / n) for a plan that keeps n of the target's N residual dims (1 when it keeps them all);
    ValueError for a LayerNorm family whose hidden dims the plan slices."""
    family = family_of(config)
    total, kept = family.sizes(config).get("hidden"), plan.units("hidden")
    if total is None or kept is None or len(kept) == total:
        return 1.0
    if family.name != "llama":
        raise ValueError(f"growth: a {family.name} model normalises with LayerNorm over its hidden dims, which new "
                         "zero dims would shift; grow it along heads, neurons or depth only")
    return math.sqrt(total / len(kept))


def grow(small: State, config: PretrainedConfig, plan: SlicePlan, base: State) -> State:
    """The target state (``base``'s shapes, ``config``'s family) that computes what ``small`` computes.

    ``small``: the state of the plan's sub-model (``sub_config(config, plan)``), e.g. ``extract(target, config,
    plan)`` of a smallest-only federation; ``base``: a fresh target initialisation, which new units' input
    weights keep. Raises ValueError when ``small`` does not match the plan or the family cannot grow that axis."""
    c = hidden_factor(config, plan)
    slices = tensor_slices(base, config, plan)
    expected = {sl.sub_name for sl in slices.values()}
    if set(small) != expected:
        missing, extra = sorted(expected - set(small))[:3], sorted(set(small) - expected)[:3]
        raise ValueError(f"growth: the small model's keys differ from the plan's sub-model: missing {missing}, extra {extra}")
    silent = writers(config, list(base))
    if c != 1.0:  # the token embedding writes the residual stream (and is the lm_head when tied)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        silent |= {n for n in base if n.endswith(_EMBEDDINGS) or (tied and n.endswith("lm_head.weight"))}
    out: State = {}
    for name, init in base.items():
        value = torch.zeros_like(init) if name in silent else init.detach().clone()
        if name in slices:
            sl = slices[name]
            src = small[sl.sub_name].to(value.dtype)
            if tuple(src.shape) != (shape := sliced_shape(value.shape, sl.index)):
                raise ValueError(f"growth: {sl.sub_name} has shape {tuple(src.shape)}, its slice of {name} {shape}")
            if c != 1.0:
                src = src * _hidden_scale(name, config, name in silent, c)
            scatter(value, sl.index, src, accumulate=False)
        out[name] = value
    return out


def _hidden_scale(name: str, config: PretrainedConfig, writes: bool, c: float) -> float:
    """What a kept tensor is multiplied by when the residual stream's kept dims grow by ``c``: writes by ``c``;
    norms by ``1 / c`` (they see ``c`` times the input at the same mean square); the final norm once more when
    the lm_head is the (grown) embedding."""
    if writes:
        return c
    if not name.endswith("norm.weight"):
        return 1.0
    final = "hidden" in family_of(config).rule(name, config).contracts
    return 1 / c**2 if final and getattr(config, "tie_word_embeddings", False) else 1 / c

