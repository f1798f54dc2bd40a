"""Freivalds' check: injected errors above tolerance caught, honest tiles pass, bad devices struck and routed around."""

from __future__ import annotations

import pytest
import torch
from fp_bounds import assert_same_product, matmul_bound

from fedfusion.units import Freivalds, Gemm, Operand, UnitDevice, UnitEngine
from fedfusion.units.engine import Returns
from fedfusion.units.messages import DeviceRuntime
from fedfusion.units.verify import WeightId, abs_mv
from fedfusion.units.workers import Away, Corrupt, DiesAfter

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny GEMMs on one thread, restored after

KINDS = ("entry", "row", "column", "dense", "sparse", "scaled")


def random_tile(gen: torch.Generator, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    m, n, k = (int(torch.randint(lo, hi, (), generator=gen)) for lo, hi in ((4, 96), (4, 96), (8, 512)))
    scale = 10 ** float(torch.empty(()).uniform_(-3, 3, generator=gen))
    a = torch.randn(m, k, generator=gen, dtype=dtype) * scale
    b = torch.randn(k, n, generator=gen, dtype=dtype)
    return a, b


def inject(c: torch.Tensor, tol: torch.Tensor, kind: str, gen: torch.Generator) -> torch.Tensor:
    """An error whose largest entry is 2-20x the check's tolerance on that entry's row (the detection threshold)."""
    m, n = c.shape
    factor = 2 * float(torch.empty(()).uniform_(1, 10, generator=gen))
    z = torch.zeros_like(c)
    i, j = int(torch.randint(0, m, (), generator=gen)), int(torch.randint(0, n, (), generator=gen))
    if kind == "entry":
        z[i, j] = 1
    elif kind == "row":
        z[i] = torch.randn(n, generator=gen)
    elif kind == "column":
        z[:, j] = torch.randn(m, generator=gen)
    elif kind == "dense":
        z = torch.randn(m, n, generator=gen)
    elif kind == "sparse":
        z = torch.randn(m, n, generator=gen) * (torch.rand(m, n, generator=gen) < 0.02)
        z[i, j] = 1
    else:  # a wrong scale of the whole tile
        z = c.clone()
    ratio = z.abs() / tol[:, None]
    return c + z * (factor / ratio.max())


def test_injected_errors_above_tolerance_detected_in_999_of_1000() -> None:
    gen = torch.Generator().manual_seed(0)
    check = Freivalds(vectors=2, seed=1)
    missed = {kind: 0 for kind in KINDS}
    for trial in range(1000):
        a, b = random_tile(gen)
        c = a @ b
        kind = KINDS[trial % len(KINDS)]
        bad = inject(c, check.tolerance(a, b), kind, gen)
        assert not torch.equal(bad, c)
        missed[kind] += check.check(a, b, bad)
    assert sum(missed.values()) <= 1, missed


def test_no_false_positive_on_1000_honest_tiles() -> None:
    gen = torch.Generator().manual_seed(2)
    check = Freivalds(vectors=2, seed=3)
    rejected = 0
    for trial in range(1000):
        dtype = torch.float64 if trial % 4 == 0 else torch.float32
        a, b = random_tile(gen, dtype)
        c = compute_units_tile(a, b)  # through the device code path and the wire
        rejected += not check.check(a, b, c)
    assert rejected == 0


def compute_units_tile(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from fedfusion.units.messages import compute_units, decode_reply, encode_units
    from fedfusion.units.plan import Tile

    g = Gemm(Operand("A", a), Operand("B", b))
    tile = Tile(0, 0, 0, a.shape[0], 0, b.shape[1], 0, a.shape[1])
    return decode_reply(compute_units(encode_units(0, [(0, g, tile)])))[0]


def test_two_cancelling_entries_need_more_vectors() -> None:
    """Freivalds' worst case: two wrong entries in a row; each vector catches it with probability >= 1/2."""
    gen = torch.Generator().manual_seed(4)
    caught, trials = {2: 0, 10: 0}, {2: 300, 10: 1000}
    for vectors in caught:
        check = Freivalds(vectors=vectors, seed=5)
        for _ in range(trials[vectors]):
            a, b = random_tile(gen)
            c, tol = a @ b, check.tolerance(a, b)
            bad = c.clone()
            i = int(torch.randint(0, c.shape[0], (), generator=gen))
            j1, j2 = torch.randperm(c.shape[1], generator=gen)[:2].tolist() if c.shape[1] > 1 else (0, 0)
            bad[i, j1] += 2.5 * tol[i]
            bad[i, j2] -= 2.5 * tol[i]
            caught[vectors] += not check.check(a, b, bad)
    assert caught[10] >= 999
    assert caught[2] / trials[2] < 0.99  # the default two vectors are weaker against this adversarial pattern


def test_a_weights_kept_check_vectors_catch_the_same_errors_and_never_vouch_for_other_values() -> None:
    """The vectors kept for a weight (``check(..., weight=...)``): every micro-batch's product against that weight is
    checked as strictly as with fresh vectors, and a weight whose values changed under the same name (densely, or in
    one entry) is checked against its new values: a device computing with the old weights (a stale cache) is
    caught."""
    gen = torch.Generator().manual_seed(11)
    check = Freivalds(vectors=2, seed=12)
    w = torch.randn(40, 48, generator=gen)
    missed = 0
    for trial in range(300):  # 300 micro-batches against one weight: the kept vectors
        x = torch.randn(64, 48, generator=gen)
        c = x @ w.T
        assert check.check(x, w.T, c, weight=("W0", True))
        missed += check.check(x, w.T, inject(c, check.tolerance(x, w.T), KINDS[trial % len(KINDS)], gen),
                              weight=("W0", True))
    assert missed <= 1
    assert len(check._weights) == 1
    dense = torch.randn(40, 48, generator=gen)
    sparse = dense.clone()  # after ``dense``: one entry changed
    sparse[3, 5] += 0.5
    for other in (dense, sparse):
        for _ in range(20):
            x = torch.randn(64, 48, generator=gen)
            assert not check.check(x, other.T, x @ w.T, weight=("W0", True))  # the old weight's product: rejected
            assert check.check(x, other.T, x @ other.T, weight=("W0", True))
        w = other


def devices(n: int) -> list[UnitDevice]:
    return [UnitDevice(f"d{i}", 1e8, 1e9 * (1 + i), 1e6, 1e6) for i in range(n)]


def gemm_pair(gen: torch.Generator) -> tuple[Gemm, torch.Tensor]:
    a, b = torch.randn(64, 48, generator=gen, dtype=torch.float64), torch.randn(40, 48, generator=gen, dtype=torch.float64)
    return Gemm(Operand("X", a), Operand("W", b, t=True)), a @ b.T


def test_corrupt_device_struck_blocked_and_its_tiles_redispatched() -> None:
    gen = torch.Generator().manual_seed(6)
    bad = Corrupt(rate=1.0, scale=1e-3)
    engine = UnitEngine(devices(4), workers=[DeviceRuntime(), bad, DeviceRuntime(), DeviceRuntime()], layouts=("rows",))
    for _ in range(4):
        g, want = gemm_pair(gen)
        (got,) = engine.phase([g])
        assert_same_product(got, want, g.a.base, g.b.base.T)  # float64 tiles against one product: their bounds
    assert bad.corrupted >= 3
    assert engine.strikes.blocked(1) and 1 not in engine.live()
    assert sum(r.redispatched for r in engine.trace) >= 3
    assert all(1 not in {t.device for t in r.plan.tiles} for r in engine.trace[3:])


def test_silent_device_goes_offline_and_result_is_exact() -> None:
    gen = torch.Generator().manual_seed(7)
    engine = UnitEngine(devices(3), workers=[DeviceRuntime(), DiesAfter(0), DeviceRuntime()])
    g, want = gemm_pair(gen)
    (got,) = engine.phase([g])
    assert_same_product(got, want, g.a.base, g.b.base.T)
    assert engine.offline == {1} and engine.trace[0].redispatched >= 1


def test_a_device_that_comes_back_takes_units_again_gets_its_weights_anew_and_the_products_stay_exact() -> None:
    """Device 1 answers one phase, misses the next (offline: its tiles go elsewhere), is left out while offline, then
    rejoins restarted empty: the same tiles as the first phase go to it with the weight blocks again (the same bytes
    as the first phase, more than a phase on cached weights), it answers them all, and every product is exact."""
    gen = torch.Generator().manual_seed(10)
    engine = UnitEngine(devices(3), workers=[DeviceRuntime(), Away(after=1, missed=1), DeviceRuntime()],
                        layouts=("rows",))
    g, _ = gemm_pair(gen)
    for _ in range(4):
        if len(engine.trace) == 3:
            with pytest.raises(ValueError, match="device 0 is not offline"):
                engine.rejoin(0)
            engine.rejoin(1)
        x = torch.randn(g.a.base.shape, generator=gen, dtype=torch.float64)
        (got,) = engine.phase([Gemm(Operand("X", x), g.b)])
        assert_same_product(got, x @ g.b.base.T, x, g.b.base.T)
    first, missed, out, back = engine.trace
    assert missed.failed_devices == [1] and missed.redispatched >= 1
    assert 1 not in {t.device for t in out.plan.tiles} and engine.offline == set()
    assert [t.device for t in back.plan.tiles] == [t.device for t in first.plan.tiles]  # the same plan again
    assert back.redispatched == 0 and not back.failed_devices and back.up_bytes[1] > 0
    assert back.down_bytes[1] == first.down_bytes[1] > missed.down_bytes[1]  # weights again, not just inputs


def test_no_device_left_server_computes() -> None:
    gen = torch.Generator().manual_seed(8)
    engine = UnitEngine(devices(2), workers=[DiesAfter(0), DiesAfter(0)])
    g, want = gemm_pair(gen)
    (got,) = engine.phase([g])
    assert_same_product(got, want, g.a.base, g.b.base.T)
    assert engine.server_fallback >= 1


def test_all_devices_blocked_server_computes_the_phase() -> None:
    gen = torch.Generator().manual_seed(9)
    engine = UnitEngine(devices(2), workers=[Corrupt(seed=1), Corrupt(seed=2)])
    for _ in range(4):
        g, want = gemm_pair(gen)
        (got,) = engine.phase([g])
        assert_same_product(got, want, g.a.base, g.b.base.T)
    assert engine.live() == [] and engine.server_fallback >= 1


def test_joint_check_failing_without_a_culprit_falls_back_to_the_server() -> None:
    class JointOnly(Freivalds):
        """Rejects every whole product, passes every tile: the engine cannot blame a device."""

        def check(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weight: WeightId | None = None) -> bool:
            return a.shape[0] != 64 or b.shape[1] != 40

    gen = torch.Generator().manual_seed(10)
    engine = UnitEngine(devices(3), verifier=JointOnly(seed=0), layouts=("rows",))
    g, want = gemm_pair(gen)
    (got,) = engine.phase([g])
    assert_same_product(got, want, g.a.base, g.b.base.T)
    assert engine.server_fallback == 1 and not engine.strikes.counts


@pytest.mark.parametrize("shape", [(3, 5), (700, 1), (1100, 300), (300, 1100)])
def test_abs_mv_equals_the_plain_product_for_rows_and_transposed_views(shape: tuple[int, int]) -> None:
    """``abs_mv`` (blocks through one buffer, a transposed view by its base's rows) is ``|x| @ v``: two summation
    orders of the same non-negative terms, each within ``gamma_n (|x| v)`` of the exact sum (fp_bounds), so within
    twice that of each other (a relative 2.4e-13 at n = 1100 in float64; a lost or doubled block is off by O(1))."""
    gen = torch.Generator().manual_seed(13)
    v = torch.rand(shape[1], generator=gen, dtype=torch.float64)
    for x in (torch.randn(*shape, generator=gen, dtype=torch.float64),
              torch.randn(shape[1], shape[0], generator=gen, dtype=torch.float64).T):
        err = (abs_mv(x, v) - torch.mv(x.abs(), v)).abs()
        assert (err <= 2 * matmul_bound(x, v[:, None])[:, 0]).all()


def test_a_device_that_fails_on_each_return_waits_twice_as_long_each_time_and_one_clean_step_resets_it() -> None:
    """units.rejoin_after's policy (Returns, each step marked as UnitsMethod marks it), base wait 2 steps: device 1
    leaves in step 1 and misses a deadline again in every step it comes back in, so it returns at steps 3, 7 and 15
    (waits 2, 4, 8: a device gone for good costs a deadline at ever longer intervals); device 0 leaves in step 2,
    fails on its return at 4, comes back at 8 (a wait of 4), finishes that step online, and its next absence (step
    10) waits the base 2 steps again."""
    engine = UnitEngine(devices(3))
    returns = Returns(after=2)
    leaves = {1: {1}, 2: {0}, 3: {1}, 4: {0}, 7: {1}, 10: {0}, 15: {1}}  # step -> who misses a deadline in it
    back: dict[int, list[int]] = {}
    for step in range(1, 17):
        if came := sorted(returns.start(engine, step)):
            back[step] = came
        engine.offline |= leaves.get(step, set())  # what the engine does to a device that misses its deadline
        returns.end(engine, step)
    assert back == {3: [1], 4: [0], 7: [1], 8: [0], 12: [0], 15: [1]}
    assert returns.misses == {1: 3} and returns.since == {1: 15} and engine.offline == {1}
