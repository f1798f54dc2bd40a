"""The transport seam the Flower layer plugs into: one payload per device per round, deadlines, error replies."""

from __future__ import annotations

import pytest
import torch
from fp_bounds import assert_same_product

from fedfusion.units import DeviceRuntime, Gemm, Operand, UnitDevice, UnitEngine
from fedfusion.units.phases import llama_phases
from fedfusion.units.timeline import simulate

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny GEMMs on one thread, restored after


def devices(n: int) -> list[UnitDevice]:
    return [UnitDevice(f"d{i}", 1e8, 1e9, 1e6, 5e5, rtt_s=0.05) for i in range(n)]


class Recording:
    """An in-process transport that records rounds and lets one device time out (or err) on its first message."""

    def __init__(self, n: int, silent: int | None = None, erring: int | None = None) -> None:
        self.runtimes = [DeviceRuntime() for _ in range(n)]
        self.silent, self.erring = silent, erring
        self.rounds: list[dict[int, float]] = []

    def __call__(self, payloads: dict[int, bytes], deadlines: dict[int, float]) -> dict[int, bytes | None]:
        self.rounds.append(dict(deadlines))
        out: dict[int, bytes | None] = {}
        for dev, payload in payloads.items():
            if dev == self.silent:
                out[dev] = None  # its reply would come after the deadline: dropped when it does
            elif dev == self.erring and len(self.rounds) == 1:
                out[dev] = b""
            else:
                out[dev] = self.runtimes[dev](payload)
        return out


def gemm() -> tuple[Gemm, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    a, w = torch.randn(96, 32, generator=gen, dtype=torch.float64), torch.randn(48, 32, generator=gen, dtype=torch.float64)
    return Gemm(Operand("X", a), Operand("W0", w, t=True)), a @ w.T


def test_transport_gets_one_payload_per_device_with_deadlines_and_a_timeout_is_redispatched() -> None:
    transport = Recording(4, silent=2)
    engine = UnitEngine(devices(4), transport=transport)
    g, want = gemm()
    (got,) = engine.phase([g])
    assert_same_product(got, want, g.a.base, g.b.base.T)  # float64 tiles against one product: their bounds
    first = transport.rounds[0]
    assert set(first) == {t.device for t in engine.trace[0].plan.tiles} and 2 in first
    predicted = engine.trace[0].plan.predicted_s
    for dev, deadline in first.items():
        assert abs(deadline - 3.0 * predicted[dev]) <= 1e-9 * deadline
    assert len(transport.rounds) == 2 and 2 not in transport.rounds[1]  # the silent device's units went elsewhere
    assert engine.offline == {2}


def test_error_reply_is_not_a_strike_and_clears_the_cache_record() -> None:
    transport = Recording(3, erring=1)
    engine = UnitEngine(devices(3), transport=transport)
    g, want = gemm()
    (got,) = engine.phase([g])
    assert_same_product(got, want, g.a.base, g.b.base.T)  # float64 tiles against one product: their bounds
    assert engine.strikes.counts.get(1, 0) == 0 and 1 not in engine.offline
    assert not any(k.startswith("W0") for k in engine.held.get(1, set()))


def test_frozen_base_resident_on_devices_moves_only_activations() -> None:
    shape = dict(hidden=128, intermediate=512, layers=2, heads=8, kv_heads=8, vocab=100, tokens=256)
    full = llama_phases(**shape)
    frozen = llama_phases(**shape, frozen=True)
    assert all(len(shapes) == 1 for shapes, _ in frozen)  # no weight gradients
    assert len(frozen) == len(full)
    a = simulate(devices(8), [full])
    b = simulate(devices(8), [frozen], resident_weights=True)
    assert b.down_bytes.sum() < 0.8 * a.down_bytes.sum() and b.step_s < a.step_s
