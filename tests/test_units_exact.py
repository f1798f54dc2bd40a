"""One AdamW step through sub-matrix units equals a local torch step (MLP-only and all-linear offload)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fedfusion.units import UnitDevice, UnitEngine, install

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


def compare(dtype: torch.dtype, count: int, mode: str, layouts: tuple[str, ...], max_groups: int | None
            ) -> tuple[float, float, UnitEngine]:
    """(max |d theta|, worst per-tensor ||theta_u - theta_l||_F / ||theta_l||_F, engine) between local and units.

    The float32 criterion is norm-wise per tensor: element-wise, AdamW's first step ``lr g / (|g| + eps)`` turns
    rounding noise in gradients near ``eps`` into differences of a sizeable fraction of ``lr`` even between two
    local torch runs with different GEMM blockings.
    """
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    local, units = model(dtype), model(dtype)
    before = {k: v.detach().clone() for k, v in local.named_parameters()}
    engine = UnitEngine(devices(count), layouts=layouts, max_groups=max_groups)
    install(units, engine, mode)
    loss_l, loss_u = adamw_step(local, ids), adamw_step(units, ids)
    assert abs(loss_l - loss_u) <= 1e-5 * abs(loss_l)
    worst_abs, worst_rel = 0.0, 0.0
    pu = dict(units.named_parameters())
    for name, p in local.named_parameters():
        diff = (p.detach() - pu[name].detach()).abs().max().item()
        worst_abs = max(worst_abs, diff)
        worst_rel = max(worst_rel, ((p.detach() - pu[name].detach()).norm() / p.detach().norm()).item())
        assert not torch.equal(p.detach(), before[name])  # every parameter took the step
    return worst_abs, worst_rel, engine


@pytest.mark.parametrize("mode", ["mlp", "all"])
@pytest.mark.parametrize("count,layouts,max_groups", [(1, ("rows", "cols", "k"), None), (3, ("rows",), None),
                                                        (3, ("k",), None), (7, ("cols",), 4),
                                                        (7, ("rows", "cols", "k"), None)])
def test_float64_step_through_units_equals_local(mode: str, count: int, layouts: tuple[str, ...],
                                                  max_groups: int | None) -> None:
    worst, _, engine = compare(torch.float64, count, mode, layouts, max_groups)
    assert worst <= 1e-10
    used = {t.device for rec in engine.trace for t in rec.plan.tiles}
    assert len(used) >= (count + 1) // 2  # the units were spread (the planner may leave a slow device idle)
    phases_per_layer = 4 if mode == "mlp" else 8
    assert len(engine.trace) == phases_per_layer * CONFIG["num_hidden_layers"] + (2 if mode == "all" else 0)
    assert {lay.kind for rec in engine.trace for lay in rec.plan.layouts} <= set(layouts)


@pytest.mark.parametrize("mode", ["mlp", "all"])
@pytest.mark.parametrize("count", [3, 7])
def test_float32_step_through_units_within_relative_1e5(mode: str, count: int) -> None:
    _, rel, _ = compare(torch.float32, count, mode, ("rows", "cols", "k"), None)
    assert rel <= 1e-5


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
