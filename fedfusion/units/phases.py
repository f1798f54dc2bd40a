"""The dependent phases of one training step of a Llama in the units mode, from its shape alone.

Per decoder layer, all-linear offload has 8 phases (forward ``[q|k|v]``, ``o``, ``[gate|up]``, ``down``; backward
the same four in reverse, each with its input and weight gradient in one message), MLP-only 4; all-linear adds
``lm_head`` forward and backward. The list equals what ``install`` + ``UnitEngine`` record for a real step
(a test checks it), so the timeline can price models too large to run here. :func:`server_flops` counts the
rest of the step, what the server computes itself.
"""

from __future__ import annotations

from typing import Any

from fedfusion.units.messages import Spec
from fedfusion.units.plan import GemmShape

Phase = tuple[list[GemmShape], list[Spec]]
WEIGHT_GRADIENT: Spec = ("dY", True, "X", False)  # ``dW = dY^T X``: what ``install``'s backward names it

def linear_phases(tokens: int, d_in: int, d_out: int, name: str = "W", frozen: bool = False) -> tuple[Phase, Phase]:
    """Forward ``Y = X W^T`` and backward ``dX = dY W``, ``dW = dY^T X`` of a (fused) linear layer ``name``
    (``frozen``: no weight gradient, as when fine-tuning adapters on a frozen base)."""
    backward: Phase = ([GemmShape(tokens, d_in, d_out)], [("dY", False, name, False)])
    if not frozen:
        backward = (backward[0] + [GemmShape(d_out, d_in, tokens)], backward[1] + [WEIGHT_GRADIENT])
    return ([GemmShape(tokens, d_out, d_in)], [("X", False, name, True)]), backward


def llama_phases(*, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
                 tokens: int, mode: str = "all", frozen: bool = False, gated: bool = True) -> list[Phase]:
    """The phases of one forward and backward pass over ``tokens`` tokens, in the order the server runs them;
    weights are named ``W<group>`` in the order ``install`` numbers the groups (``frozen``: no weight gradients;
    ``gated=False``: an OPT/GPT-style MLP, ``fc1`` (hidden -> intermediate) and ``fc2``, instead of SwiGLU's fused
    ``[gate|up]`` (hidden -> 2 x intermediate) and ``down``)."""
    head_dim = hidden // heads
    groups = [(hidden, hidden + 2 * kv_heads * head_dim), (hidden, hidden)] if mode == "all" else []
    groups += [(hidden, 2 * intermediate if gated else intermediate), (intermediate, hidden)]
    per_layer = [[linear_phases(tokens, d_in, d_out, f"W{layer * len(groups) + g}", frozen)
                  for g, (d_in, d_out) in enumerate(groups)] for layer in range(layers)]
    head = [linear_phases(tokens, hidden, vocab, f"W{layers * len(groups)}", frozen)] if mode == "all" else []
    forward = [f for layer in per_layer for f, _ in layer] + [f for f, _ in head]
    backward = [b for _, b in head] + [b for layer in reversed(per_layer) for _, b in reversed(layer)]
    return forward + backward


# Forward FLOPs per element of the server's element-wise work (backward counted at twice the forward): estimates
# from the operations torch runs, stated so each priced item follows a formula.
NORM_FLOPS = 4  # RMSNorm: square, mean, scale by the reciprocal root, weight
ROPE_FLOPS = 3  # rotary embedding of q and k: two products and a sum
SOFTMAX_FLOPS = 5  # attention probabilities (scale, max, exp, sum, divide) and the loss's log-softmax over the vocabulary
SWIGLU_FLOPS = 5  # SiLU (about 4) and the product with the up projection
RELU_FLOPS = 1  # an ungated MLP's activation (OPT's ReLU)
# per parameter and step: AdamW's weight decay, both moments, the root and the update; SGD's decay and update
OPTIMIZER_FLOPS = {"adamw": 13, "sgd": 4}


def server_flops(*, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, tokens: int,
                 seq: int, params: int, mode: str = "all", optimizer: str = "adamw",
                 gated: bool = True) -> dict[str, float]:
    """What the server computes itself in one step over ``tokens`` tokens in windows of ``seq`` (forward and
    backward, 3x the forward) and one ``optimizer`` step on ``params`` parameters, by item:

    - ``attention``: the attention cores, ``QK^T`` and ``PV``: ``3 * 4 * tokens * seq * hidden`` per layer;
    - ``elementwise``: per token and layer two norms, RoPE on q and k, the attention softmax, SwiGLU (``gated``;
      else ReLU) and two residual sums, the final norm and the loss's softmax over the vocabulary, each at its
      constant above, x3;
    - ``linear``: the GEMMs of the linear layers ``mode`` leaves on the server (``mlp``: attention projections and
      ``lm_head``; ``all``: none), the FLOPs of :func:`llama_phases`' missing phases;
    - ``optimizer``: ``OPTIMIZER_FLOPS[optimizer] * params``.

    Embeddings (a gather and its scatter-add) are not counted."""
    shape: dict[str, Any] = dict(hidden=hidden, intermediate=intermediate, layers=layers, heads=heads,
                                 kv_heads=kv_heads, vocab=vocab, tokens=tokens, gated=gated)
    kv = kv_heads * (hidden // heads)
    mlp = (SWIGLU_FLOPS if gated else RELU_FLOPS) * intermediate
    per_token = layers * (2 * NORM_FLOPS * hidden + ROPE_FLOPS * (hidden + kv) + SOFTMAX_FLOPS * heads * seq
                          + mlp + 2 * hidden) + NORM_FLOPS * hidden + SOFTMAX_FLOPS * vocab
    offloaded = sum(g.flops for shapes, _ in llama_phases(**shape, mode=mode) for g in shapes)
    every = sum(g.flops for shapes, _ in llama_phases(**shape, mode="all") for g in shapes)
    return {"attention": 3.0 * 4 * tokens * seq * hidden * layers, "elementwise": 3.0 * per_token * tokens,
            "linear": float(every - offloaded), "optimizer": float(OPTIMIZER_FLOPS[optimizer] * params)}
