"""The planner: tiles cover every GEMM exactly once, fit memory, follow speed, and beat one device."""

from __future__ import annotations

import numpy as np
import pytest

from fedfusion.units import CostModel, GemmShape, UnitDevice, plan_phase


def devices(n: int, mem: float = 1e9) -> list[UnitDevice]:
    return [UnitDevice(f"d{i}", mem * (1 + i % 2), 1e9 * (1 + i % 4), 1e6 * (1 + i % 3), 5e5, rtt_s=0.01) for i in range(n)]


@pytest.mark.parametrize("layouts", [("rows",), ("cols",), ("k",), ("rows", "cols", "k")])
@pytest.mark.parametrize("n", [1, 3, 7, 32])
def test_tiles_cover_each_gemm_exactly_once(layouts: tuple[str, ...], n: int) -> None:
    shapes = [GemmShape(40, 24, 16), GemmShape(24, 16, 40)]
    plan = plan_phase(CostModel(devices(n)), list(range(n)), shapes, layouts)
    for gi, g in enumerate(shapes):
        cover = np.zeros((g.m, g.n, g.k), dtype=int)
        for t in plan.tiles:
            if t.gemm == gi:
                cover[t.i0:t.i1, t.j0:t.j1, t.k0:t.k1] += 1
        assert (cover == 1).all()
    assert {lay.kind for lay in plan.layouts} <= set(layouts)


def test_tiles_fit_memory_and_small_memory_forces_smaller_tiles() -> None:
    g = GemmShape(512, 512, 256)
    roomy = plan_phase(CostModel(devices(8)), list(range(8)), [g])
    tight_devs = devices(8, mem=4 * 60_000)
    tight = plan_phase(CostModel(tight_devs), list(range(8)), [g])
    for t in tight.tiles:
        assert 4 * (t.a_elems + t.b_elems + t.c_elems) <= tight_devs[t.device].memory_bytes
    assert max(t.a_elems + t.b_elems + t.c_elems for t in tight.tiles) < max(
        t.a_elems + t.b_elems + t.c_elems for t in roomy.tiles)
    with pytest.raises(ValueError):
        plan_phase(CostModel(devices(2, mem=100.0)), [0, 1], [g])


def test_faster_device_gets_more_work_and_more_devices_are_faster() -> None:
    slow = UnitDevice("slow", 1e9, 1e9, 1e9, 1e9, rtt_s=0.0, overhead_s=0.0)  # compute-bound
    fast = UnitDevice("fast", 1e9, 4e9, 1e9, 1e9, rtt_s=0.0, overhead_s=0.0)
    plan = plan_phase(CostModel([slow, fast]), [0, 1], [GemmShape(256, 256, 256)])
    assert plan.flops[1] > 2 * plan.flops[0]
    assert abs(plan.predicted_s[0] - plan.predicted_s[1]) < 0.1 * plan.makespan  # balanced finish times
    g = GemmShape(1024, 1024, 1024)
    spans = [plan_phase(CostModel(devices(n)), list(range(n)), [g]).makespan for n in (1, 4, 16, 64)]
    assert spans == sorted(spans, reverse=True) and spans[-1] < spans[0] / 4


def test_only_live_devices_get_units() -> None:
    plan = plan_phase(CostModel(devices(6)), [0, 2, 5], [GemmShape(64, 64, 64)])
    assert {t.device for t in plan.tiles} <= {0, 2, 5}


def test_from_catalog_converts_units() -> None:
    from fedfusion.devices.catalog import load_catalog
    from fedfusion.units import from_catalog

    tier = load_catalog()["phone-lowend"]
    dev = from_catalog(tier, rtt_s=0.08)
    assert dev.memory_bytes == tier.memory_gb * 1e9 and dev.flops == tier.tflops * 1e12
    assert dev.down_bps == tier.down_mbps * 1e6 / 8 and dev.up_bps == tier.up_mbps * 1e6 / 8 and dev.rtt_s == 0.08
    with pytest.raises(ValueError):
        UnitDevice("bad", 0.0, 1.0, 1.0, 1.0)
