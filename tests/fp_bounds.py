"""Worst-case rounding-error bounds for the suite's floating-point tolerances.

A test that compares two computations of the same quantity in floating point bounds their difference by what the
arithmetic can make, never by a constant that one machine's rounding happened to meet. The bounds are Higham's
(*Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 3.1 and 3.5): with ``u`` the unit roundoff and
``gamma_n = n u / (1 - n u)``, a sum of ``n`` terms computed in any order is off by at most
``gamma_{n-1} sum |x_i|``, and each entry of a product ``A @ B`` with inner dimension ``k``, computed in any order
and blocking (FMA included), by at most ``gamma_k (|A| |B|)_ij``. Two computations that each meet a bound differ by
at most twice it.
"""

from __future__ import annotations

import math

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon of ``dtype``: the largest relative error of one rounding."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype) -> float:
    """Higham's ``gamma_n``: the relative error bound of ``n`` successive roundings."""
    nu = n * unit_roundoff(dtype)
    assert nu < 1, f"gamma_{n} undefined in {dtype}: n u >= 1"
    return nu / (1 - nu)


def matmul_bound(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Entry-wise bound on ``|fl(a @ b) - a @ b|`` in ``dtype`` (default the operands'): ``gamma_k |a| |b|``,
    evaluated in float64 so the bound itself carries no rounding of note."""
    k = a.shape[-1]
    return gamma(k, dtype or a.dtype) * (a.detach().abs().double() @ b.detach().abs().double())


def sum_bound(terms: int, abs_sum: float, dtype: torch.dtype) -> float:
    """Bound on the error of a sum of ``terms`` numbers whose magnitudes add to ``abs_sum``, in any order."""
    return gamma(max(terms - 1, 1), dtype) * abs_sum


def product_error(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|c - a @ b|`` entry-wise, the product exact (float64 operands of float32 or narrower values: exact to
    well below the bounds here)."""
    return (c.detach().double() - a.detach().double() @ b.detach().double()).abs()


def assert_product_within_bound(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, times: float = 1.0,
                                dtype: torch.dtype | None = None) -> float:
    """``c`` is ``a @ b`` computed in ``dtype`` (default ``c``'s): every entry within ``times`` x ``gamma_k |a||b|``
    of the exact product of the operands. Returns the worst ratio of error to bound (0 where both are 0)."""
    err, bound = product_error(c, a, b), times * matmul_bound(a, b, dtype or c.dtype)
    assert (err <= bound).all(), f"worst error / bound {float((err / bound).nan_to_num(0, float('inf')).max()):.3g}"
    return float((err / bound.clamp_min(torch.finfo(torch.float64).tiny)).max()) if err.numel() else 0.0


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | float) -> float:
    """``|got - want| <= bound`` entry-wise, the difference taken in float64 (exact for float32 or narrower
    values). Returns the worst ratio of difference to bound (0 where both are 0)."""
    err = (got.detach().double() - want.detach().double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).detach()
    assert (err <= bound).all(), f"worst difference / bound {float((err / bound).nan_to_num(0, float('inf')).max()):.3g}"
    return float((err / bound.clamp_min(torch.finfo(torch.float64).tiny)).max()) if err.numel() else 0.0


def assert_same_product(got: torch.Tensor, want: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    """``got`` and ``want``: two computations of ``a @ b`` in their dtype (any order, blocking or tiling), each within
    ``gamma_k |a| |b|`` of the exact product, so within twice it of each other. Returns the worst ratio of
    difference to bound."""
    return assert_within(got, want, 2 * matmul_bound(a, b, got.dtype))


def log_softmax_bound(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Entry-wise bound on ``|fl(log_softmax(x)) - log_softmax(x)|`` along the last dim, ``x`` exact in ``dtype``:
    ``(x - max) - log sum exp(x - max)`` rounds the shift, each ``exp`` (within 2 ulps: glibc's and SLEEF's
    documented accuracy), the sum of ``V`` positive terms, the log and the final subtraction, so
    ``gamma_{V+6} (2 |x - max| + log V + 1)`` covers them all."""
    x = x.detach().double()
    v = x.shape[-1]
    shift = (x - x.amax(-1, keepdim=True)).abs()
    return gamma(v + 6, dtype) * (2 * shift + math.log(v) + 1)


def cross_entropy_bound(logits: torch.Tensor, labels: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """Bound on the error of the mean next-token cross-entropy of ``logits`` (tokens, vocabulary) at ``labels``,
    computed in ``dtype`` from these exact logits: each token's ``-log_softmax`` is within
    :func:`log_softmax_bound` at its label, and the mean of ``N`` such terms adds :func:`sum_bound` over their
    magnitudes (the division by ``N`` rounds once more, within ``gamma_1`` of the result: inside ``gamma_{N}``)."""
    logits = logits.detach().double()
    per = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    n = per.numel()
    terms = float(log_softmax_bound(logits, dtype).gather(1, labels[:, None]).mean())
    return terms + sum_bound(n + 1, float(per.abs().sum()), dtype) / n
