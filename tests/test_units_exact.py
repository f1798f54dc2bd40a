"""One AdamW step through sub-matrix units equals a local torch step (MLP-only and all-linear offload)."""

from __future__ import annotations

import pytest
import torch
from fp_bounds import assert_product_within_bound, assert_within, gamma
from model_bounds import ExactLM, adamw_first_step_bound, assert_steps, float64_norms, optimizer_steps
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
    """The test model in ``dtype``; in float64 with its normalisations in float64 too (HF's cast to float32:
    model_bounds.float64_norms), so the float64 tests' bounds are float64's."""
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(dtype)
    return float64_norms(m) if dtype == torch.float64 else m


def next_token_loss(m: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fedfusion.train.loop.lm_loss`` in the model's dtype: it (and HF's ``labels=`` loss) takes the
    cross-entropy in float32, which in a float64 step would round the logits and their gradient to float32."""
    logits = m(input_ids=ids[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)), logits


LR = 1e-2


def adamw_step(m: torch.nn.Module, ids: torch.Tensor) -> float:
    opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1)
    loss = next_token_loss(m, ids)[0]
    loss.backward()
    opt.step()
    return float(loss.detach())


def ids() -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))


def assert_same_step(a: torch.nn.Module, b: torch.nn.Module, start: torch.nn.Module, ids: torch.Tensor,
                     losses: tuple[float, float] | None = None, micro: int = 1) -> float:
    """``a`` and ``b``, each ``start`` (float64) after one AdamW step (lr ``LR``) on the windows ``ids``, computed
    two ways in float64 (summation orders, splits, micro-batches), took the same step up to float64 rounding: each
    one's loss and gradient is within the first-order float64 bound of the exact one (model_bounds.ExactLM at
    ``start``: its sum lengths and magnitudes; with ``micro`` > 1 micro-batches each part's gradient is scaled by
    its share, one more rounding, and the parts added, a regrouping of the tokens' sum: 2 to be safe), so the two
    within twice it; the parameters within what AdamW's
    first step makes of that gradient difference (model_bounds.adamw_first_step_bound). Every parameter moved.
    Returns the worst ratio of difference to bound. ``start`` is consumed (its norms and hooks replaced)."""
    theta = {k: v.detach().clone() for k, v in start.named_parameters()}
    exact = ExactLM(None, {}, model=start, trained={k: k for k in theta}, dtype=torch.float64,
                    roundings=2 if micro > 1 else 0)
    want = exact.at(theta, ids)
    # a loss summed over micro-batches, each scaled by its share: 2 roundings more per micro-batch, each side
    loss_bound = 2 * want.loss_bound + 2 * gamma(2 * micro, torch.float64) * abs(want.loss)
    worst = assert_within(torch.tensor(losses[0]), torch.tensor(losses[1]), loss_bound) if losses else 0.0
    pb = dict(b.named_parameters())
    for name, p in a.named_parameters():
        d = 2 * want.grad_bounds[name]
        worst = max(worst, assert_within(p.grad, pb[name].grad, d))
        worst = max(worst, assert_within(p, pb[name], adamw_first_step_bound(p.grad, d, p, LR)))
        assert not torch.equal(p.detach(), theta[name])  # every parameter took the step
    return worst


def compare(count: int, mode: str, layouts: tuple[str, ...], max_groups: int | None) -> tuple[float, UnitEngine]:
    """(worst difference / bound between a local float64 AdamW step and one through units, engine)."""
    local, units = model(torch.float64), model(torch.float64)
    engine = UnitEngine(devices(count), layouts=layouts, max_groups=max_groups)
    install(units, engine, mode)
    losses = adamw_step(local, ids()), adamw_step(units, ids())
    return assert_same_step(local, units, model(torch.float64), ids(), losses), engine


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
    engine = compare(count, mode, layouts, max_groups)[1]  # asserts the step within its float64 bound
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


def test_three_steps_through_units_each_within_the_float64_bound_with_weight_cache() -> None:
    """Several steps: the device caches must go stale when the optimizer changes the weights. Each step's loss and
    gradient, at the values the units model held then, within twice the float64 bound of a local float64
    computation at those values (model_bounds.ExactLM: itself float64, so both within the bound of exact); the
    values each step started from are AdamW's of the gradients before, replayed bit for bit (one optimizer, one code
    path, equal inputs). Per step, not the two loss curves: AdamW's ``g / (|g| + eps)`` makes no rounding bound of
    a trajectory (model_bounds). A stale cache computes a step's products with the previous weights, off by the
    last step's ``lr``-sized moves, far above the bound."""
    gen = torch.Generator().manual_seed(3)
    units = model(torch.float64)
    start = {k: v.detach().clone() for k, v in units.named_parameters()}
    engine = UnitEngine(devices(3))
    install(units, engine, "all")
    opt = torch.optim.AdamW(units.parameters(), lr=LR)
    losses, drawn = [], []
    with optimizer_steps(dict(units.named_parameters())) as steps:
        for _ in range(3):
            drawn.append(torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=gen))
            opt.zero_grad()
            loss = next_token_loss(units, drawn[-1])[0]
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    assert engine.server_fallback == 0 and not engine.strikes.counts
    start_model = model(torch.float64)
    exact = ExactLM(None, {}, model=start_model, trained={k: k for k in start}, dtype=torch.float64)
    assert_steps(exact, steps, losses, drawn, times=2)
    replay = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    again = torch.optim.AdamW(replay.values(), lr=LR)
    for values, grads in steps:
        assert all(torch.equal(replay[k].detach(), v) for k, v in values.items())
        for k, p in replay.items():
            p.grad = grads[k]
        again.step()
    final = dict(units.named_parameters())
    assert all(torch.equal(replay[k].detach(), final[k].detach()) for k in start)
