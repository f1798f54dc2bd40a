"""Function-preserving growth: a trained small model placed inside the target so that the target computes exactly
what the small model computes (logits equal to float rounding), and can then learn more.

The small model is a slice of the target (a :class:`~fedfusion.models.slicing.SlicePlan`: the units it holds on each
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

The factors live with each family (:meth:`~fedfusion.models.families.Family.growth_factor`) and a plan marked
``grown`` applies them in :func:`~fedfusion.models.slicing.tensor_slices`, so extracting the small model from the grown
target, training it as an ordinary slice and folding it back keep the target equal to it: a grow-then-fuse run
(:class:`~fedfusion.fusion.submodel.method.SubModelMethod`'s ``grow_round``) starts from :func:`silence`. No Flower.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import PretrainedConfig

from fedfusion.models.families import family_of
from fedfusion.models.slicing import SlicePlan, extract, scatter, sliced_shape, tensor_slices

State = dict[str, torch.Tensor]
_UNIT_AXES = ("heads", "neurons")


def writers(config: PretrainedConfig, names: list[str]) -> set[str]:
    """The parameters that write into the residual stream: every weight whose slicing rule contracts over heads
    or neurons (an attention or MLP output projection), and that module's bias."""
    family = family_of(config)
    weights = {n for n in names if n.endswith(".weight") and set(family.rule(n, config).contracts) & set(_UNIT_AXES)}
    return weights | {n[: -len("weight")] + "bias" for n in weights if n[: -len("weight")] + "bias" in names}


def grown_plan(plan: SlicePlan) -> SlicePlan:
    """``plan`` as the small model grown into the target holds it: extracting it gives the small model back."""
    return replace(plan, scale=False, grown=True, shared=True)


def silence(config: PretrainedConfig, plan: SlicePlan, state: State) -> State:
    """``state`` grown from its own ``plan`` slice: the units outside it silenced (their residual writes zeroed),
    so the target computes what that slice computes. The start of a grow-then-fuse run."""
    return grow(extract(state, config, grown_plan(plan)), config, plan, state)


def grow(small: State, config: PretrainedConfig, plan: SlicePlan, base: State) -> State:
    """The target state (``base``'s shapes, ``config``'s family) that computes what ``small`` computes.

    ``small``: the state of the plan's sub-model (``sub_config(config, plan)``), e.g. a smallest-only federation's
    model; ``base``: a target initialisation, whose values new units' input weights keep. Raises ValueError when
    ``small`` does not match the plan or the family cannot grow that axis."""
    slices = tensor_slices(base, config, grown_plan(plan))
    expected = {sl.sub_name for sl in slices.values()}
    if set(small) != expected:
        missing, extra = sorted(expected - set(small))[:3], sorted(set(small) - expected)[:3]
        raise ValueError(f"growth: the small model's keys differ from the plan's sub-model: missing {missing}, extra {extra}")
    silent = writers(config, list(base)) | {n for n, sl in slices.items() if sl.scale < 1.0}  # + grown embeddings
    out: State = {}
    for name, init in base.items():
        value = torch.zeros_like(init) if name in silent else init.detach().clone()
        if name in slices:
            sl = slices[name]
            src = small[sl.sub_name].to(value.dtype)
            if tuple(src.shape) != (shape := sliced_shape(value.shape, sl.index)):
                raise ValueError(f"growth: {sl.sub_name} has shape {tuple(src.shape)}, its slice of {name} {shape}")
            scatter(value, sl.index, src / sl.scale, accumulate=False)
        out[name] = value
    return out
