"""One AdamW step through sub-matrix units equals a local torch step (MLP-only and all-linear offload)."""

from __future__ import annotations

import pytest
import torch
from fp_bounds import assert_product_within_bound
from transformers import LlamaConfig, LlamaForCausalLM

from fedfusion.units import UnitDevice, UnitEngine, install
from fedfusion.units.accumulate import StepSum
from fedfusion.units.messages import Gemm

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny GEMMs on one thread, restored after

CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
              vocab_size=50, max_position_embeddings=64)


def devices(count: int) -> list[UnitDevice]:
    """Uneven devices: speeds, links and memory differ by up to 8x."""
    return [UnitDevice(f"d{i}", memory_bytes=2e5 * (1 + i % 4), flops=1e9 * (1 + 3 * (i % 3)),
                       down_bps=1e6 * (1 + i % 2), up_bps=2e5 * (1 + i % 5), rtt_s=0.02 * (1 + i % 3))
            for i in range(count)]


def model(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).to(dtype)


def adamw_step(m: torch.nn.Module, ids: torch.Tensor) -> float:
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    return float(loss.detach())


def ids() -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))


def compare(count: int, mode: str, layouts: tuple[str, ...], max_groups: int | None) -> tuple[float, UnitEngine]:
    """(max |d theta| between a local float64 AdamW step and one through units, engine); every parameter moved."""
    local, units = model(torch.float64), model(torch.float64)
    before = {k: v.detach().clone() for k, v in local.named_parameters()}
    engine = UnitEngine(devices(count), layouts=layouts, max_groups=max_groups)
    install(units, engine, mode)
    loss_l, loss_u = adamw_step(local, ids()), adamw_step(units, ids())
    assert abs(loss_l - loss_u) <= 1e-10 * abs(loss_l)
    worst = 0.0
    pu = dict(units.named_parameters())
    for name, p in local.named_parameters():
        worst = max(worst, (p.detach() - pu[name].detach()).abs().max().item())
        assert not torch.equal(p.detach(), before[name])  # every parameter took the step
    return worst, engine


Product = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def record_products(engine: UnitEngine) -> list[Product]:
    """Every product ``engine.phase`` returns from now on, as ``(A, B, C)`` copied as computed (a later optimizer
    step changes the weights in place), ``C`` the engine's value of ``A @ B``; a weight gradient summed on the
    devices over a step's micro-batches (``accumulate``) with its micro-batches' operands concatenated along the
    inner dimension (``StepSum.whole``), whose product is that sum. Thread-safe (micro-batches in flight)."""
    products: list[Product] = []
    sums: dict[int, StepSum] = {}
    phase, join = engine.phase, engine._join

    def joined(g: Gemm) -> tuple[StepSum, int, bool]:
        out = join(g)
        sums[id(g)] = out[0]
        return out

    def recorded(gemms: list[Gemm]) -> list[torch.Tensor | None]:
        outs = phase(gemms)
        for g, c in zip(gemms, outs):
            s = sums.pop(id(g), None)
            if c is not None:
                a, b = s.whole() if s is not None else (g.a.logical(), g.b.logical())
                products.append((a.detach().clone(), b.detach().clone(), c.detach().clone()))
        return outs

    engine.phase, engine._join = recorded, joined  # type: ignore[method-assign]
    return products


def assert_products_within_rounding(products: list[Product], dtype: torch.dtype = torch.float32) -> float:
    """Every product in ``dtype`` and within Higham's ``gamma_k |A| |B|`` of the exact product of its operands (any
    summation order, blocking, k-split or micro-batch sum: a sum over micro-batches is one inner product of the
    concatenated length). Returns the worst ratio of error to bound."""
    worst = 0.0
    for a, b, c in products:
        assert c.dtype == dtype
        worst = max(worst, assert_product_within_bound(c, a, b))
    return worst


@pytest.mark.parametrize("mode", ["mlp", "all"])
@pytest.mark.parametrize("count,layouts,max_groups", [(1, ("rows", "cols", "k"), None), (3, ("rows",), None),
                                                        (3, ("k",), None), (7, ("cols",), 4),
                                                        (7, ("rows", "cols", "k"), None)])
def test_float64_step_through_units_equals_local(mode: str, count: int, layouts: tuple[str, ...],
                                                  max_groups: int | None) -> None:
    worst, engine = compare(count, mode, layouts, max_groups)
    assert worst <= 1e-10
    used = {t.device for rec in engine.trace for t in rec.plan.tiles}
    assert len(used) >= (count + 1) // 2  # the units were spread (the planner may leave a slow device idle)
    phases_per_layer = 4 if mode == "mlp" else 8
    assert len(engine.trace) == phases_per_layer * CONFIG["num_hidden_layers"] + (2 if mode == "all" else 0)
    assert {lay.kind for rec in engine.trace for lay in rec.plan.layouts} <= set(layouts)


@pytest.mark.parametrize("mode", ["mlp", "all"])
@pytest.mark.parametrize("count", [3, 7])
def test_float32_step_through_units_within_the_rounding_bound_of_every_product(mode: str, count: int) -> None:
    """Float32: every product the units assemble in a training step (forward and backward, split over rows,
    columns and the inner dimension across 3 or 7 devices) is within the worst case of float32 arithmetic,
    ``gamma_k |A| |B|`` entry-wise (tests/fp_bounds.py), of the exact product of its float32 operands.

    The float64 tests prove the step's algebra; this proves its float32 arithmetic loses nothing beyond rounding,
    on any CPU: a bound that holds for every summation order and blocking, not a constant one machine met. (Two
    float32 steps, local and through units, then differ by what these per-product errors propagate to; after
    AdamW's ``g / (|g| + eps)`` that is no bound worth asserting.)"""
    units = model(torch.float32)
    engine = UnitEngine(devices(count), layouts=("rows", "cols", "k"))
    products = record_products(engine)
    install(units, engine, mode)
    adamw_step(units, ids())
    assert len(products) >= len(engine.trace) > 0  # every phase gave its products
    assert_products_within_rounding(products)
    assert {t.device for rec in engine.trace for t in rec.plan.tiles} >= {0, 1}  # the products were split


def test_install_keeps_parameters_and_remove_restores() -> None:
    m = model(torch.float64)
    names = [n for n, _ in m.named_parameters()]
    handle = install(m, UnitEngine(devices(2)), "all")
    assert [n for n, _ in m.named_parameters()] == names
    handle.remove()
    assert type(m.model.layers[0].mlp.gate_proj) is torch.nn.Linear


def test_three_steps_loss_curve_equals_local_with_weight_cache() -> None:
    """Several steps: the device caches must go stale when the optimizer changes the weights."""
    gen = torch.Generator().manual_seed(3)
    local, units = model(torch.float64), model(torch.float64)
    engine = UnitEngine(devices(3))
    install(units, engine, "all")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (local, units)]
    for _ in range(3):
        ids = torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=gen)
        losses = []
        for m, opt in zip((local, units), opts):
            opt.zero_grad()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        assert abs(losses[0] - losses[1]) <= 1e-10
    assert engine.server_fallback == 0 and not engine.strikes.counts
    pu = dict(units.named_parameters())
    assert max((p - pu[n]).abs().max().item() for n, p in local.named_parameters()) <= 1e-10
