"""Bytes per device per phase against the closed form, the virtual step time, micro-batches, churn, check cost."""

from __future__ import annotations

import pytest
import torch
from fp_bounds import assert_product_within_bound
from transformers import LlamaConfig, LlamaForCausalLM

from fedfusion.units import Gemm, Operand, UnitDevice, UnitEngine, install
from fedfusion.units.phases import llama_phases
from fedfusion.units.timeline import Kill, chains_from_trace, simulate

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny GEMMs on one thread, restored after

SHAPE = dict(hidden=64, intermediate=256, layers=2, heads=4, kv_heads=4, vocab=60)
QUICKSTART = dict(hidden=128, intermediate=512, layers=4, heads=8, kv_heads=8, vocab=100)


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                        intermediate_size=256, vocab_size=60, max_position_embeddings=128))


def phones(n: int, uneven: bool = True) -> list[UnitDevice]:
    """Phone-class devices at 10 MB/s down, 2 MB/s up (uneven: speeds and links vary up to 3x)."""
    return [UnitDevice(f"p{i}", 4e9, 0.5e12 * (1 + (i % 3 if uneven else 0)), 10e6 / (1 + (i % 2 if uneven else 0)),
                       2e6 * (1 + (i % 3 if uneven else 0)), rtt_s=0.05) for i in range(n)]


def run_step(n: int, mode: str, micro: int = 1, tokens: int = 128) -> UnitEngine:
    m, engine = llama(), UnitEngine(phones(n))
    install(m, engine, mode)
    ids = torch.randint(0, 60, (micro, tokens // micro), generator=torch.Generator().manual_seed(1))
    for c in range(micro):
        engine.chain = c
        m(input_ids=ids[c:c + 1], labels=ids[c:c + 1]).loss.backward()
    return engine


@pytest.mark.parametrize("mode", ["mlp", "all"])
def test_recorded_phases_equal_the_analytic_list(mode: str) -> None:
    engine = run_step(3, mode, micro=2)
    chains = chains_from_trace(engine.trace)
    assert len(chains) == 2
    assert all(ch == llama_phases(**SHAPE, tokens=64, mode=mode) for ch in chains)


@pytest.mark.parametrize("n", [3, 7])
def test_bytes_per_device_per_phase_within_5pct_of_formula(n: int) -> None:
    engine = run_step(n, "all", micro=2)  # the second micro-batch finds the weight blocks cached
    checked = 0
    for rec in engine.trace:
        assert set(rec.down_bytes) == set(rec.formula_down)
        for dev, measured in rec.down_bytes.items():
            assert abs(measured - rec.formula_down[dev]) <= 0.05 * rec.formula_down[dev]
            assert abs(rec.up_bytes[dev] - rec.formula_up[dev]) <= 0.05 * rec.formula_up[dev]
            checked += 1
    assert checked >= len(engine.trace) * 2
    second = [r for r in engine.trace if r.chain == 1]
    assert sum(sum(r.down_bytes.values()) for r in second) < sum(sum(r.down_bytes.values()) for r in engine.trace
                                                                  if r.chain == 0)


def test_weight_cache_cuts_bytes_and_is_invalidated_by_the_optimizer() -> None:
    m, engine = llama(), UnitEngine(phones(3))
    install(m, engine, "mlp")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ids = torch.randint(0, 60, (1, 32), generator=torch.Generator().manual_seed(2))
    down = []
    for _ in range(3):  # forward twice on the same weights, then a step changes them
        m(input_ids=ids, labels=ids).loss.backward()
        down.append(sum(sum(r.down_bytes.values()) for r in engine.trace))
        engine.trace.clear()
        if len(down) == 2:
            opt.step()
    # cached on the same weights, resent after the update (the same bytes but the headers' longer phase numbers)
    assert down[1] < down[0] and 0 <= down[2] - down[0] <= 100
    cached = simulate(phones(4), [llama_phases(**QUICKSTART, tokens=256, mode="all")] * 4)
    uncached = simulate(phones(4), [llama_phases(**QUICKSTART, tokens=256, mode="all")] * 4, cache_weights=False)
    assert cached.down_bytes.sum() < uncached.down_bytes.sum() and cached.step_s < uncached.step_s


def test_rows_layout_bytes_are_the_closed_form() -> None:
    """One GEMM cut by rows: device d gets A[I, :] and B[:, J_d], so elem * (|I| k + k |J_d|) down, elem |I||J_d| up."""
    a, w = torch.randn(256, 96), torch.randn(160, 96)
    engine = UnitEngine(phones(5, uneven=False), layouts=("rows",), max_groups=1)
    (c,) = engine.phase([Gemm(Operand("X", a), Operand("W", w, t=True))])
    assert_product_within_bound(c, a, w.T)  # float32: within gamma_k |A||W^T| of the exact product (fp_bounds)
    rec = engine.trace[0]
    for t in rec.plan.tiles:
        payload = 4 * ((t.i1 - t.i0) * 96 + 96 * (t.j1 - t.j0))
        assert abs(rec.down_bytes[t.device] - payload) <= 0.05 * payload
        assert abs(rec.up_bytes[t.device] - 4 * (t.i1 - t.i0) * (t.j1 - t.j0)) <= 0.05 * 4 * (t.i1 - t.i0) * (t.j1 - t.j0)


def test_single_message_time_is_overhead_links_latency_compute() -> None:
    dev = UnitDevice("x", 1e9, 2e9, 1e6, 5e5, rtt_s=0.1, overhead_s=0.01)
    shapes = llama_phases(**SHAPE, tokens=32, mode="mlp")[:1]
    r = simulate([dev], [shapes])
    down, up, flops = r.down_bytes[0], r.up_bytes[0], shapes[0][0][0].flops
    assert r.step_s == pytest.approx(0.01 + down / 1e6 + 0.1 + flops / 2e9 + up / 5e5, rel=1e-12)
    assert down > 4 * 32 * 64 and up > 4 * 32 * 512  # the operands and the fused [gate|up] output moved


def test_one_lane_serialises_a_devices_messages() -> None:
    """``lanes=1`` (Flower's SuperNode: pull, compute, reply, then pull the next): on one device with every
    micro-batch in flight the step is the sum of each message's own time, nothing overlaps; without the limit the
    device receives the next message while it computes, so the same step is shorter and its links busier."""
    dev = UnitDevice("x", 1e9, 2e9, 1e6, 5e5, rtt_s=0.1, overhead_s=0.01)
    chains = [llama_phases(**SHAPE, tokens=32, mode="all")] * 3
    one = simulate([dev], chains, lanes=1, accumulate=True)
    messages = sum(len(ch) for ch in chains)
    serial = messages * (0.01 + 0.1) + one.down_busy_s[0] + one.compute_s[0] + one.up_busy_s[0]
    assert one.step_s == pytest.approx(serial, rel=1e-12)
    free = simulate([dev], chains, accumulate=True)
    assert free.step_s < one.step_s and free.link_utilisation > one.link_utilisation
    assert (free.down_bytes == one.down_bytes).all() and (free.up_bytes == one.up_bytes).all()
    # a single chain never has two messages on a device: the limit changes nothing
    single = [llama_phases(**SHAPE, tokens=96, mode="all")]
    assert simulate(phones(3), single, lanes=1).step_s == simulate(phones(3), single).step_s
    # three micro-batches never put a fourth message on the device: 3 lanes are no limit, 2 hold one of them back
    two = simulate([dev], chains, lanes=2, accumulate=True)
    assert free.step_s < two.step_s < one.step_s
    assert simulate([dev], chains, lanes=3, accumulate=True).step_s == free.step_s
    with pytest.raises(ValueError, match="lanes"):
        simulate([dev], chains, lanes=-1)


def test_supernodes_per_device_each_keep_their_own_weights_and_sums() -> None:
    """``supernodes=k``: micro-batch c on node c mod k of each device, one message per node at a time, each node its
    own weight blocks and running sums. One node is one lane exactly; with two nodes and two micro-batches each node
    carries one micro-batch's whole traffic (weights included, no sums), so every device moves exactly twice what one
    micro-batch alone moves, and the step is no faster than two lanes sharing one cache."""
    chains = [llama_phases(**SHAPE, tokens=64, mode="all")] * 2
    for devs in ([UnitDevice("x", 1e9, 2e9, 1e6, 5e5, rtt_s=0.1, overhead_s=0.01)], phones(4)):
        one_node = simulate(devs, chains * 2, supernodes=1, accumulate=True)
        one_lane = simulate(devs, chains * 2, lanes=1, accumulate=True)
        assert one_node.step_s == one_lane.step_s and (one_node.down_bytes == one_lane.down_bytes).all()
        alone = simulate(devs, chains[:1])
        two_nodes = simulate(devs, chains, supernodes=2, accumulate=True)
        assert (two_nodes.down_bytes == 2 * alone.down_bytes).all() and (two_nodes.up_bytes == 2 * alone.up_bytes).all()
        two_lanes = simulate(devs, chains, lanes=2, accumulate=True)
        assert (two_lanes.down_bytes < two_nodes.down_bytes).all() and two_lanes.step_s <= two_nodes.step_s
    base = simulate(phones(8), chains, supernodes=2, accumulate=True)
    hit = simulate(phones(8), chains, supernodes=2, accumulate=True, kills=(Kill(device=3, at_s=0.5 * base.step_s),))
    assert hit.redispatched > 0 and 3 in hit.detected and hit.step_s > base.step_s
    with pytest.raises(ValueError, match="not both"):
        simulate(phones(2), chains, lanes=1, supernodes=2)


def test_micro_batches_keep_links_busy_and_step_near_its_lower_bound() -> None:
    devs = phones(4)
    one = simulate(devs, [llama_phases(**QUICKSTART, tokens=1024, mode="all")])
    four = simulate(devs, [llama_phases(**QUICKSTART, tokens=256, mode="all")] * 4)
    assert four.link_utilisation >= 0.7 > one.link_utilisation
    assert four.step_s < one.step_s
    assert one.lower_bound_s <= one.step_s <= 2 * one.lower_bound_s
    assert four.lower_bound_s <= four.step_s <= 1.2 * four.lower_bound_s


@pytest.mark.parametrize("micro", [1, 4])
def test_killing_a_device_mid_phase_costs_at_most_one_phase_deadline(micro: int) -> None:
    devs = phones(16)
    chains = [llama_phases(**SHAPE, tokens=1024 // micro, mode="all")] * micro
    base = simulate(devs, chains)
    without = simulate([d for i, d in enumerate(devs) if i != 5], chains)  # the same for every kill time: once
    for frac in (0.2, 0.5, 0.8):
        kill = Kill(device=5, at_s=frac * base.step_s)
        hit = simulate(devs, chains, kills=(kill,))
        active = [dl - t for t, dl in hit.phase_deadlines if t <= kill.at_s <= dl]
        assert hit.redispatched > 0 and 5 in hit.detected
        assert hit.detected[5] - kill.at_s <= max(active)  # noticed within the deadline of a phase it was in
        assert 0 < hit.step_s - base.step_s <= max(active)
        assert hit.step_s < kill.at_s + without.step_s  # cheaper than restarting the step without the device
        assert hit.step_s - base.step_s < 60.0  # never Flower's node-offline heartbeat


def test_verification_costs_under_2pct_of_the_step() -> None:
    """The check's CPU time on the server against the step's (virtual) time on 4 phones, quickstart widths.

    Both grow with the tokens; the ratio grows with the device count (the links add up, the check does not),
    so the benchmark reports it per device count.
    """
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                                     intermediate_size=512, vocab_size=100, max_position_embeddings=128))
    engine = UnitEngine(phones(4))
    install(m, engine, "all")
    ids = torch.randint(0, 100, (8, 128), generator=torch.Generator().manual_seed(1))
    m(input_ids=ids, labels=ids).loss.backward()
    verify_s = sum(rec.verify_s for rec in engine.trace)
    step = simulate(engine.devices, chains_from_trace(engine.trace)).step_s
    assert 0 < verify_s <= 0.02 * step


@pytest.mark.slow  # 16 timelines of 4 and 16 phones: ~1.5 s
def test_choose_micro_batches_divides_is_deterministic_and_never_slower_than_one() -> None:
    from fedfusion.units.timeline import choose_micro_batches

    # 4 phones on 8 x 256 tokens carry enough bytes to reach 0.70; 16 phones on 8 x 32 tokens reach it at no count
    for devs, tokens, reaches in ((phones(4, uneven=False), 8 * 256, True), (phones(16, uneven=False), 8 * 32, False)):
        def phases_for(m: int, tokens: int = tokens) -> list:
            return llama_phases(**QUICKSTART, tokens=tokens // m, mode="all")

        m, timings = choose_micro_batches(devs, phases_for, 8, accumulate=True)
        again, _ = choose_micro_batches(devs, phases_for, 8, accumulate=True)
        assert m == again and 8 % m == 0 and sorted(timings) == [1, 2, 4, 8]
        assert timings[m].step_s <= timings[1].step_s
        reached = [c for c in sorted(timings) if timings[c].link_utilisation >= 0.7
                   and timings[c].step_s <= timings[1].step_s]
        assert bool(reached) == reaches
        assert m == (reached[0] if reached else min(timings, key=lambda c: (timings[c].step_s, c)))
