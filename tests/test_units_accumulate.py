"""On-device accumulation of weight-gradient tiles over a step's micro-batches (fedfusion.units.accumulate): the
step still equals a local torch step, every sum is verified, a lost or wrong sum is recomputed, each weight
gradient travels up once per step and tile, and the timeline prices it so."""

from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

import pytest
import torch
from transformers import LlamaForCausalLM

from fedfusion.config.recipe import load_recipe
from fedfusion.config.sections import RecipeError
from fedfusion.run.units import train_step
from fedfusion.units import Freivalds, UnitEngine, install
from fedfusion.units.accumulate import MissingSum, RunningSums
from fedfusion.units.messages import DeviceRuntime
from fedfusion.units.phases import llama_phases
from fedfusion.units.timeline import chains_from_trace, simulate
from fedfusion.units.workers import Corrupt, DiesAfter
from tests.test_units_exact import (
    CONFIG,
    assert_products_within_rounding,
    assert_same_step,
    devices,
    model,
    next_token_loss,
    record_products,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny GEMMs on one thread, restored after

def batch(micro: int) -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (2 * micro, 13), generator=torch.Generator().manual_seed(1))


def local_step(dtype: torch.dtype, ids: torch.Tensor, micro: int) -> LlamaForCausalLM:
    """The reference: backward() per micro-batch, one after the other (torch accumulates into .grad), one AdamW step."""
    m = model(dtype)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    for part in ids.chunk(micro):
        loss = next_token_loss(m, part)[0]
        (loss * len(part) / len(ids)).backward()
    opt.step()
    return m


def units_step(dtype: torch.dtype, ids: torch.Tensor, micro: int, engine: UnitEngine, in_flight: int = 1,
               accumulate: bool = True) -> LlamaForCausalLM:
    m = model(dtype)
    engine.accumulate = micro if accumulate else 1
    install(m, engine, "all")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)

    def on_micro(c: int) -> None:
        engine.chain = c

    with in_dtype(dtype):
        train_step(m, opt, ids, micro, on_micro, in_flight)
    return m


def in_dtype(dtype: torch.dtype) -> mock._patch | nullcontext:
    """In float64, ``train_step``'s loss in the model's dtype (test_units_exact.next_token_loss): its ``lm_loss``
    takes it in float32, a float32 rounding inside a float64 step that no float64 bound covers."""
    return mock.patch("fedfusion.run.units.lm_loss", next_token_loss) if dtype == torch.float64 else nullcontext()


def assert_equals_local(ids: torch.Tensor, micro: int, got: LlamaForCausalLM) -> float:
    """``got``, a float64 step through units, took the local float64 step on ``ids`` in ``micro`` micro-batches, up
    to float64 rounding (test_units_exact.assert_same_step). Returns the worst ratio of difference to bound."""
    return assert_same_step(local_step(torch.float64, ids, micro), got, model(torch.float64), ids, micro=micro)


def equal_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pb = dict(b.named_parameters())
    return all(torch.equal(p.detach(), pb[name].detach()) for name, p in a.named_parameters())


def weight_gradient_phases(engine: UnitEngine) -> list:
    return [rec for rec in engine.trace if len(rec.shapes) == 2]


@pytest.mark.parametrize("micro,count,layouts,in_flight", [(2, 1, ("rows", "cols", "k"), 1), (3, 3, ("rows",), 1),
                                                           (4, 3, ("k",), 0), (3, 7, ("cols",), 2),
                                                           (4, 7, ("rows", "cols", "k"), 0)])
def test_float64_step_with_accumulation_equals_local(micro: int, count: int, layouts: tuple[str, ...],
                                                     in_flight: int) -> None:
    ids = batch(micro)
    engine = UnitEngine(devices(count), layouts=layouts)
    assert_equals_local(ids, micro, units_step(torch.float64, ids, micro, engine, in_flight))
    assert not engine._sums and engine.server_fallback == 0 and not engine.strikes.counts
    backward = weight_gradient_phases(engine)
    assert len(backward) == micro * (4 * CONFIG["num_hidden_layers"] + 1)


@pytest.mark.parametrize("count", [3, 7])
def test_float32_step_with_accumulation_within_the_rounding_bound_of_every_product(count: int) -> None:
    """Float32, two micro-batches in flight, weight gradients summed on the devices: every product the step uses
    (forward, input gradient, and each weight gradient's sum over the micro-batches: one inner product over the
    concatenated micro-batches) is within ``gamma_k |A| |B|`` of the exact product of its float32 operands, on any
    CPU (tests/test_units_exact.py, tests/fp_bounds.py). The float64 tests above prove the step equals a local one;
    the two float32 steps' parameters differ by what AdamW's first step ``g / (|g| + eps)`` makes of rounding-level
    gradient differences, for which no bound worth asserting exists."""
    ids = batch(2)
    engine = UnitEngine(devices(count))
    products = record_products(engine)
    units_step(torch.float32, ids, 2, engine, in_flight=0)
    sums = [(a, b) for a, b, _ in products if a.shape[1] == len(ids) * (ids.shape[1] - 1)]  # over both micro-batches
    assert len(sums) == 4 * CONFIG["num_hidden_layers"] + 1  # every weight gradient came as its step's sum
    assert_products_within_rounding(products)


def test_row_and_column_tiles_sum_bit_for_bit_as_backward_accumulates() -> None:
    """Without k-splits a tile's sum is the micro-batches' products added in micro-batch order, as the server
    adds each micro-batch's gradient without accumulation: the two steps are equal bit for bit."""
    ids = batch(3)
    on = units_step(torch.float32, ids, 3, UnitEngine(devices(3), layouts=("rows", "cols")))
    off = units_step(torch.float32, ids, 3, UnitEngine(devices(3), layouts=("rows", "cols")), accumulate=False)
    assert equal_parameters(on, off)


def test_weight_gradients_travel_up_once_per_step_and_bytes_match_the_formula() -> None:
    ids = batch(4)
    on, off = UnitEngine(devices(3)), UnitEngine(devices(3))
    units_step(torch.float64, ids, 4, on)
    units_step(torch.float64, ids, 4, off, accumulate=False)
    up = [sum(sum(rec.up_bytes.values()) for rec in weight_gradient_phases(e)) for e in (on, off)]
    down = [sum(sum(rec.down_bytes.values()) for rec in e.trace) for e in (on, off)]
    assert up[0] < 0.6 * up[1] and down[0] <= 1.01 * down[1]
    for rec in on.trace:  # measured bytes per device and phase within 5 % of the closed form
        for dev, n in rec.down_bytes.items():
            assert abs(n / rec.formula_down[dev] - 1) <= 0.05
        for dev, n in rec.up_bytes.items():
            assert abs(n / rec.formula_up[dev] - 1) <= 0.05


def test_a_wrong_sum_is_caught_struck_and_recomputed_from_every_micro_batch() -> None:
    """A device that corrupts only the sums it emits (its kept products and other tiles honest): Freivalds on
    the sum over the concatenated micro-batches catches it and the step stays exact."""
    ids = batch(3)
    workers = [DeviceRuntime(), Corrupt(rate=1.0, scale=1e-6, sums_only=True), DeviceRuntime()]
    engine = UnitEngine(devices(3), workers=workers)  # type: ignore[arg-type]
    got = units_step(torch.float64, ids, 3, engine)
    assert workers[1].corrupted > 0 and engine.strikes.counts.get(1, 0) >= 1
    assert 1 in {d for rec in engine.trace for d in rec.failed_devices}
    assert_equals_local(ids, 3, got)


def test_freivalds_on_a_sum_over_micro_batches_catches_an_injected_error() -> None:
    gen = torch.Generator().manual_seed(4)
    check = Freivalds(seed=5)
    caught = 0
    for trial in range(200):
        parts = [(torch.randn(24, 40, generator=gen, dtype=torch.float64),
                  torch.randn(40, 16, generator=gen, dtype=torch.float64)) for _ in range(3)]
        sums = RunningSums()
        for m in (2, 0, 1):  # out of order: folded in micro-batch order all the same
            sums.add("dW0@1[0:24,0:16,0:40]", m, parts[m][0] @ parts[m][1])
        c = sums.emit("dW0@1[0:24,0:16,0:40]", 3)
        a, b = torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 0)
        assert check.check(a, b, c)  # the honest sum passes
        bad = c.clone()
        bad[trial % 24, trial % 16] += 1e3 * check.tolerance(a, b)[trial % 24]
        caught += not check.check(a, b, bad)
    assert caught == 200


class Forgets:
    """Answers ``messages`` messages, then loses its state (weight cache and running sums) once: a restarted node."""

    def __init__(self, messages: int) -> None:
        self.left, self.runtime = messages, DeviceRuntime()

    def __call__(self, payload: bytes) -> bytes:
        self.left -= 1
        if self.left == 0:
            self.runtime = DeviceRuntime()
        return self.runtime(payload)


@pytest.mark.parametrize("kind", ["dies", "forgets"])
def test_a_holder_lost_mid_step_has_its_sums_recomputed_and_the_step_is_exact(kind: str) -> None:
    """A device that holds sums stops answering (dies) or loses its state (an error reply, then a missing sum
    at the emit) between two micro-batches' backward phases: each of its sums is recomputed from every
    micro-batch's operands on the other devices."""
    ids = batch(3)
    lost = DiesAfter(20) if kind == "dies" else Forgets(20)
    engine = UnitEngine(devices(4), workers=[DeviceRuntime(), lost, DeviceRuntime(), DeviceRuntime()])  # type: ignore[list-item]
    got = units_step(torch.float64, ids, 3, engine, in_flight=0)
    assert engine.offline == ({1} if kind == "dies" else set())
    assert sum(rec.redispatched for rec in weight_gradient_phases(engine)) >= 3  # a sum: one unit per micro-batch
    assert_equals_local(ids, 3, got)


def test_running_sums_fold_in_micro_batch_order_survive_state_and_refuse_a_missing_micro_batch() -> None:
    x = [torch.tensor([1e16], dtype=torch.float64), torch.tensor([-1e16], dtype=torch.float64),
         torch.tensor([1.0], dtype=torch.float64)]  # in micro-batch order 1.0, in arrival order (2, 1, 0) 0.0
    sums = RunningSums()
    sums.add("dW1@2[0:1,0:1,0:4]", 2, x[2])
    sums.add("dW1@2[0:1,0:1,0:4]", 1, x[1])
    sums = RunningSums.from_arrays(sums.to_arrays())  # a node's context.state between messages
    sums.add("dW1@2[0:1,0:1,0:4]", 0, x[0])
    assert sums.emit("dW1@2[0:1,0:1,0:4]", 3).item() == 1.0
    sums.add("dW1@2[0:1,0:1,0:4]", 1, x[1])
    with pytest.raises(MissingSum):
        sums.emit("dW1@2[0:1,0:1,0:4]", 2)
    sums.add("dW1@3[0:1,0:1,0:4]", 0, x[1])  # a newer version of the weight drops the older sums
    assert list(sums.sums) == ["dW1@3[0:1,0:1,0:4]"]


def test_timeline_counts_the_weight_gradient_once_and_saves_upload_time() -> None:
    """Fewer bytes up, a few more down (the running-sum fields): never slower by more than those, and faster
    where the uplink is what the step waits for."""
    shape = dict(hidden=128, intermediate=512, layers=2, heads=8, kv_heads=8, vocab=100)
    ratios = []
    for n, micro in ((4, 4), (16, 2), (64, 4)):
        chains = [llama_phases(**shape, tokens=256 // micro)] * micro
        on = simulate(devices(n), chains, accumulate=True)
        off = simulate(devices(n), chains)
        assert on.up_bytes.sum() < off.up_bytes.sum() and on.down_bytes.sum() <= off.down_bytes.sum() * 1.01
        ratios.append(on.step_s / off.step_s)
    assert max(ratios) <= 1 + 1e-4 and min(ratios) < 0.9, ratios
    engine = UnitEngine(devices(3))
    units_step(torch.float64, batch(4), 4, engine)
    chains = chains_from_trace(engine.trace)
    timed = simulate(devices(3), chains, elem_bytes=8, accumulate=True)
    measured = sum(sum(rec.up_bytes.values()) for rec in engine.trace)
    assert abs(timed.up_bytes.sum() / measured - 1) <= 0.05


def test_recipe_key_defaults_on_and_is_validated() -> None:
    assert load_recipe("units").units.accumulate is True
    assert load_recipe("units", ["units.accumulate=false"]).units.accumulate is False
    with pytest.raises(RecipeError, match="units.accumulate"):
        load_recipe("units", ["units.accumulate=maybe"])


def test_float64_step_with_the_chosen_micro_batch_count_equals_local() -> None:
    """``timeline.choose_micro_batches`` on this model's phases: the count divides the batch and the step through
    units with that count (accumulated, all in flight) still equals the local step."""
    from fedfusion.units.timeline import choose_micro_batches

    ids = batch(4)  # 8 sequences of 12 tokens
    shape = dict(hidden=CONFIG["hidden_size"], intermediate=CONFIG["intermediate_size"],
                 layers=CONFIG["num_hidden_layers"], heads=CONFIG["num_attention_heads"],
                 kv_heads=CONFIG["num_key_value_heads"], vocab=CONFIG["vocab_size"])
    chosen, _ = choose_micro_batches(devices(3), lambda m: llama_phases(**shape, tokens=len(ids) // m * 12, mode="all"),
                                     len(ids), accumulate=True)
    assert len(ids) % chosen == 0
    engine = UnitEngine(devices(3))
    assert_equals_local(ids, chosen, units_step(torch.float64, ids, chosen, engine, 0))
