"""The timeline's server (its send and receive links and its processor, shared queues on the critical path) and the
step's lower bound: no simulated step beats it, and a one-device one-message step meets it within the rtt and
overhead the model charges."""

from __future__ import annotations

import numpy as np
import pytest

from fedfusion.units import UnitDevice
from fedfusion.units.devices import DEFAULT_SERVER, UNLIMITED_SERVER, UnitServer, server_from_catalog
from fedfusion.units.phases import llama_phases
from fedfusion.units.timeline import simulate

SHAPE = dict(hidden=64, intermediate=256, layers=2, heads=4, kv_heads=4, vocab=60)


def fleet(rng: np.random.Generator, n: int) -> list[UnitDevice]:
    """``n`` devices whose speed, links, rtt and overhead vary over two orders of magnitude."""
    return [UnitDevice(f"d{i}", 4e9, float(10 ** rng.uniform(10, 12)), float(10 ** rng.uniform(5, 8)),
                       float(10 ** rng.uniform(5, 8)), rtt_s=float(rng.uniform(0, 0.1)),
                       overhead_s=float(rng.uniform(0, 0.01))) for i in range(n)]


@pytest.mark.slow  # 40 randomised timelines: ~1.7 s
def test_no_step_beats_its_lower_bound() -> None:
    """Randomised devices, links, server links, micro-batches, in-flight chains, lanes, SuperNodes, accumulation
    and server time, churn off: the simulated step is never below ``lower_bound_s``, and the bound is at least every
    resource's busy time (the server's included) and the chain's phases x the least rtt + overhead."""
    rng = np.random.default_rng(0)
    for _ in range(40):
        n, micro = int(rng.integers(1, 9)), int(rng.choice([1, 2, 3, 4]))
        runtime = [{"lanes": 0}, {"lanes": 1}, {"lanes": 2}, {"supernodes": 2}][int(rng.integers(4))]
        server = UnitServer("s", *(float(10 ** rng.uniform(5, 9)) if rng.random() < 0.8 else 0.0 for _ in range(2)))
        devs = fleet(rng, n)
        chains = [llama_phases(**SHAPE, tokens=int(rng.choice([16, 32, 64])), mode=str(rng.choice(["mlp", "all"])))]
        gap, opt = float(rng.uniform(0, 0.05)), float(rng.uniform(0, 0.1))
        r = simulate(devs, chains * micro, server=server, in_flight=int(rng.integers(0, micro + 1)),
                     accumulate=bool(rng.random() < 0.5), server_gap_s=gap, optimizer_s=opt, **runtime)
        assert r.step_s >= r.lower_bound_s * (1 - 1e-12), (r.step_s, r.lower_bound_s, r.bound_by)
        busiest = max((r.down_busy_s.max(), r.up_busy_s.max(), r.compute_s.max(), r.server_send_busy_s,
                       r.server_recv_busy_s))
        assert r.lower_bound_s >= busiest + opt - 1e-12 and r.lower_bound_s >= r.server_compute_s - 1e-12
        latency = min(d.rtt_s + d.overhead_s for d in devs)
        assert r.lower_bound_s >= r.phases_per_chain * latency + opt - 1e-12
        assert r.step_over_bound >= 1 - 1e-12


def test_one_message_on_one_device_meets_the_bound_within_rtt_and_overhead() -> None:
    """One device, one message: the step is its download, compute and upload in turn plus rtt and overhead, so it
    exceeds the bound (the largest of them) by the others and rtt + overhead alone; a download that dominates makes
    the bound tight within those terms."""
    shapes = llama_phases(**SHAPE, tokens=32, mode="mlp")[:1]
    for down_bps in (1e6, 1e4):
        dev = UnitDevice("x", 1e9, 2e12, down_bps, 1e8, rtt_s=0.1, overhead_s=0.01)
        r = simulate([dev], [shapes])
        down, comp, up = r.down_busy_s[0], r.compute_s[0], r.up_busy_s[0]
        assert r.lower_bound_s == pytest.approx(down + 0.01, rel=1e-12) and r.bound_by == "device 0 downlink"
        assert r.step_s == pytest.approx(r.lower_bound_s + 0.1 + comp + up, rel=1e-12)
    assert comp + up < 1e-3 * down  # at 10 kB/s the download is all but the whole step
    assert r.step_over_bound < 1 + (0.1 + 2e-3 * down) / down


def test_the_servers_send_link_queues_every_devices_download() -> None:
    """Many fast devices behind a slow server link: the step is at least the bytes the devices download over the
    server's send rate, the send link sets the bound and is nearly always busy; an unlimited server (rate 0) leaves
    the devices' links alone, as the timeline was before the server had links."""
    devs = [UnitDevice(f"d{i}", 4e9, 1e12, 1e8, 1e8, rtt_s=0.01, overhead_s=0.001) for i in range(16)]
    chains = [llama_phases(**SHAPE, tokens=64, mode="all")] * 2
    slow = simulate(devs, chains, accumulate=True, server=UnitServer("slow", 1e6, 1e8))
    assert slow.server_send_busy_s == pytest.approx(slow.down_bytes.sum() / 1e6, rel=1e-12)
    assert slow.server_recv_busy_s == pytest.approx(slow.up_bytes.sum() / 1e8, rel=1e-12)
    assert slow.step_s >= slow.server_send_busy_s and slow.bound_by == "server send link"
    assert slow.server_link_utilisation > 0.9 and slow.link_utilisation == slow.server_link_utilisation
    free = simulate(devs, chains, accumulate=True, server=UNLIMITED_SERVER)
    assert free.server_send_busy_s == free.server_recv_busy_s == 0.0 and free.step_s < slow.step_s / 10
    assert (free.down_bytes == slow.down_bytes).all()  # the same messages, only later
    assert simulate(devs, chains, accumulate=True).step_s >= free.step_s  # the default: 10 Gb/s each way


def test_the_servers_compute_between_phases_is_one_queue() -> None:
    """Four chains in flight whose phases end together share the server's processor: its time between phases
    (``server_gap_s``) queues, so a large gap makes the server compute the bound."""
    devs = [UnitDevice(f"d{i}", 4e9, 1e12, 1e8, 1e8, rtt_s=0.001, overhead_s=0.0) for i in range(4)]
    chain = llama_phases(**SHAPE, tokens=16, mode="mlp")
    r = simulate(devs, [chain] * 4, server_gap_s=1.0, optimizer_s=0.5, server=UNLIMITED_SERVER)
    gaps = 4 * (len(chain) - 1)
    assert r.server_compute_s == pytest.approx(gaps * 1.0 + 0.5) and r.bound_by == "server compute"
    assert r.step_s >= r.server_compute_s


def test_the_server_comes_from_its_catalog_tier() -> None:
    from fedfusion.devices.catalog import load_catalog

    tier = load_catalog()["cloud-a100"]
    server = server_from_catalog(tier)
    assert (server.send_bps, server.recv_bps) == (tier.up_mbps * 1e6 / 8, tier.down_mbps * 1e6 / 8)
    assert server == UnitServer("cloud-a100", DEFAULT_SERVER.send_bps, DEFAULT_SERVER.recv_bps)
    with pytest.raises(ValueError, match="send_bps"):
        UnitServer("x", -1.0, 0.0)
