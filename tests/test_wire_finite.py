"""fedfusion.wire.finite.all_finite: the one-sum check agrees with the elementwise one on every kind of bad value."""

from __future__ import annotations

import pytest
import torch

from fedfusion.wire.finite import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_one_bad_value_anywhere_is_caught(dtype: torch.dtype, bad: float) -> None:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(5, 7, 3, generator=gen).to(dtype)
    assert all_finite(base)
    for at in (0, 52, base.numel() - 1):
        t = base.clone()
        t.view(-1)[at] = bad
        view = t[:, 1:]  # a strided view: the bad value in it or not, as the elementwise check says
        assert not all_finite(t) and all_finite(view) == bool(torch.isfinite(view).all())


def test_opposite_infinities_and_an_overflowing_sum_are_decided_elementwise() -> None:
    """inf + -inf sums to NaN: caught; finite values whose sum overflows (float32's max, four times) are finite."""
    assert not all_finite(torch.tensor([float("inf"), -float("inf"), 1.0]))
    big = torch.full((4,), torch.finfo(torch.float32).max)
    assert not bool(torch.isfinite(big.sum())) and all_finite(big)
    half = torch.full((3,), 60000.0, dtype=torch.float16)  # each finite, their float16 sum is not
    assert not bool(torch.isfinite(half.sum())) and all_finite(half)


def test_empty_integer_and_boolean_tensors_are_finite() -> None:
    assert all_finite(torch.zeros(0)) and all_finite(torch.arange(10)) and all_finite(torch.ones(3, dtype=torch.bool))
