"""The dependent phases of one training step of a Llama in the units mode, from its shape alone.

Per decoder layer, all-linear offload has 8 phases (forward ``[q|k|v]``, ``o``, ``[gate|up]``, ``down``; backward
the same four in reverse, each with its input and weight gradient in one message), MLP-only 4; all-linear adds
``lm_head`` forward and backward. The list equals what ``install`` + ``UnitEngine`` record for a real step
(a test checks it), so the timeline can price models too large to run here.
"""

from __future__ import annotations

from fedfusion.units.messages import Spec
from fedfusion.units.plan import GemmShape

Phase = tuple[list[GemmShape], list[Spec]]

def linear_phases(tokens: int, d_in: int, d_out: int, name: str = "W", frozen: bool = False) -> tuple[Phase, Phase]:
    """Forward ``Y = X W^T`` and backward ``dX = dY W``, ``dW = dY^T X`` of a (fused) linear layer ``name``
    (``frozen``: no weight gradient, as when fine-tuning adapters on a frozen base)."""
    backward: Phase = ([GemmShape(tokens, d_in, d_out)], [("dY", False, name, False)])
    if not frozen:
        backward = (backward[0] + [GemmShape(d_out, d_in, tokens)], backward[1] + [("dY", True, "X", False)])
    return ([GemmShape(tokens, d_out, d_in)], [("X", False, name, True)]), backward


def llama_phases(*, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
                 tokens: int, mode: str = "all", frozen: bool = False) -> list[Phase]:
    """The phases of one forward and backward pass over ``tokens`` tokens, in the order the server runs them;
    weights are named ``W<group>`` in the order ``install`` numbers the groups (``frozen``: no weight gradients)."""
    head_dim = hidden // heads
    groups = [(hidden, hidden + 2 * kv_heads * head_dim), (hidden, hidden)] if mode == "all" else []
    groups += [(hidden, 2 * intermediate), (intermediate, hidden)]
    per_layer = [[linear_phases(tokens, d_in, d_out, f"W{layer * len(groups) + g}", frozen)
                  for g, (d_in, d_out) in enumerate(groups)] for layer in range(layers)]
    head = [linear_phases(tokens, hidden, vocab, f"W{layers * len(groups)}", frozen)] if mode == "all" else []
    forward = [f for layer in per_layer for f, _ in layer] + [f for f, _ in head]
    backward = [b for _, b in head] + [b for layer in reversed(per_layer) for _, b in reversed(layer)]
    return forward + backward
