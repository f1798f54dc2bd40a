"""The pipeline + data-parallel baseline's cost model (``fedfusion.units.baselines``) on cases small enough to compute
by hand, and its FLOPs against the units mode's own count."""

from __future__ import annotations

from typing import Any

import pytest

from fedfusion.units.baselines import (
    FLOAT_BYTES,
    ModelShape,
    allot_layers,
    gpu_step,
    pipeline_cost,
    plan_pipeline,
    stage_memory,
)
from fedfusion.units.devices import UnitDevice
from fedfusion.units.phases import OPTIMIZER_FLOPS, llama_phases, server_flops

TINY = ModelShape("tiny", hidden=4, intermediate=8, layers=2, heads=1, kv_heads=1, vocab=10)
SEQ = 4


def device(flops: float = 1e3, bps: float = 100.0, memory: float = 1e9, rtt: float = 0.2,
           overhead: float = 0.1) -> UnitDevice:
    return UnitDevice("d", memory_bytes=memory, flops=flops, down_bps=bps, up_bps=bps, rtt_s=rtt, overhead_s=overhead)


def by_hand(tokens: int) -> tuple[float, float, int]:
    """TINY's layer forward FLOPs, lm_head forward FLOPs and one layer's parameters, counted here from the shape:
    q, k, v, o are 4 x 4 each, gate, up and down 4 x 8 each."""
    layer = 4 * 4 * 4 + 3 * 4 * 8
    return 2.0 * tokens * layer + 4.0 * tokens * SEQ * 4, 2.0 * tokens * 10 * 4, layer


def test_two_stages_one_micro_batch_is_the_sum_of_computes_and_transfers() -> None:
    a, b = device(flops=1e3), device(flops=2e3)
    cost = pipeline_cost(TINY, [a, b], [1, 1], micro_batches=1, micro_tokens=SEQ, seq=SEQ)
    layer, head, params = by_hand(SEQ)
    f0, f1 = layer / 1e3, (layer + head) / 2e3
    hop = 0.1 + FLOAT_BYTES * SEQ * 4 / 100.0 + 0.2 / 2  # overhead + activations over the link + one way
    assert cost.forward_s == pytest.approx(f0 + hop + f1)
    assert cost.backward_s == pytest.approx(2 * f1 + hop + 2 * f0)
    optimizer = [OPTIMIZER_FLOPS["adamw"] * (params + 40) / r for r in (1e3, 2e3)]  # each stage holds 40 embeddings
    assert cost.sync_s == pytest.approx(max(optimizer))  # one replica: no all-reduce, only the update
    assert cost.step_s == pytest.approx(cost.forward_s + cost.backward_s + cost.sync_s)


def test_more_micro_batches_follow_the_fill_and_drain_formula() -> None:
    a, b = device(flops=1e3), device(flops=1e3, bps=10.0)  # b's slow link is the busiest resource
    one = pipeline_cost(TINY, [a, b], [1, 1], micro_batches=1, micro_tokens=SEQ, seq=SEQ)
    four = pipeline_cost(TINY, [a, b], [1, 1], micro_batches=4, micro_tokens=SEQ, seq=SEQ)
    layer, head, _ = by_hand(SEQ)
    act = FLOAT_BYTES * SEQ * 4
    forward_pace = max(layer / 1e3, (layer + head) / 1e3, 0.1 + act / 10.0)  # a -> b: b's downlink
    backward_pace = max(2 * layer / 1e3, 2 * (layer + head) / 1e3, 0.1 + act / 10.0)  # b -> a: b's uplink
    assert four.forward_s == pytest.approx(one.forward_s + 3 * forward_pace)
    assert four.backward_s == pytest.approx(one.backward_s + 3 * backward_pace)
    # pipelining overlaps: four micro-batches take less than four single passes, more than four of the pace
    assert 4 * forward_pace < four.forward_s < 4 * one.forward_s


def test_replicas_add_a_ring_all_reduce_of_each_stage() -> None:
    d = device()
    alone = pipeline_cost(TINY, [d], [2], micro_batches=1, micro_tokens=SEQ, seq=SEQ)
    four = pipeline_cost(TINY, [d], [2], micro_batches=1, micro_tokens=SEQ, seq=SEQ, replicas=4)
    params = 2 * by_hand(SEQ)[2] + 2 * 40
    ring = 2 * 3 / 4 * FLOAT_BYTES * params / 100.0 + 2 * 3 * (0.1 + 0.2 / 2)
    assert four.sync_s - alone.sync_s == pytest.approx(ring)
    assert four.forward_s == alone.forward_s and four.devices_used == 4


def test_a_stage_must_fit_its_device() -> None:
    need = stage_memory(TINY, 1, True, False, SEQ, SEQ, 1, False)
    assert stage_memory(TINY, 2, True, False, SEQ, SEQ, 1, False) > need  # more layers, more memory
    assert stage_memory(TINY, 1, True, False, SEQ, SEQ, 4, False) > need  # more micro-batches in flight, more
    assert stage_memory(TINY, 1, True, False, SEQ, SEQ, 4, True) < stage_memory(TINY, 1, True, False, SEQ, SEQ, 4,
                                                                                 False)  # checkpointing keeps less
    small, big = device(memory=need - 1), device(memory=1e9)
    cost = pipeline_cost(TINY, [small, big], [1, 1], micro_batches=1, micro_tokens=SEQ, seq=SEQ)
    assert not cost.fits
    assert pipeline_cost(TINY, [big, big], [1, 1], micro_batches=1, micro_tokens=SEQ, seq=SEQ).fits
    tiny_memory = stage_memory(TINY, 1, False, False, SEQ, SEQ, 1, True) / 2  # below any stage's least
    assert allot_layers(TINY, [device(memory=tiny_memory)] * 2, micro_batches=1, micro_tokens=SEQ, seq=SEQ,
                        checkpoint=True) is None
    assert plan_pipeline(TINY, [device(memory=tiny_memory)] * 8, batch=2, seq=SEQ) is None


def test_layers_go_to_the_faster_stage_and_cover_the_model() -> None:
    shape = ModelShape("deep", hidden=4, intermediate=8, layers=12, heads=1, kv_heads=1, vocab=10)
    layers = allot_layers(shape, [device(flops=1e3), device(flops=3e3)], micro_batches=1, micro_tokens=SEQ, seq=SEQ,
                          checkpoint=False)
    assert layers is not None and sum(layers) == 12 and layers[1] > layers[0] >= 1


def test_the_plan_is_no_slower_than_any_pipeline_it_could_choose() -> None:
    fleet = [device(flops=1e3), device(flops=2e3), device(flops=4e3), device(flops=8e3)]
    best = plan_pipeline(TINY, fleet, batch=4, seq=SEQ)
    assert best is not None and best.fits
    assert sum(best.layers) == TINY.layers and best.devices_used <= len(fleet)
    assert sum(len(h) for h in best.holders) == best.devices_used
    for micro in (1, 2, 4):
        whole = pipeline_cost(TINY, [fleet[3]], [2], micro_batches=micro, micro_tokens=4 // micro * SEQ, seq=SEQ)
        assert best.step_s <= whole.step_s + 1e-12


@pytest.mark.parametrize("gated", [True, False])
def test_step_flops_are_the_units_modes_count(gated: bool) -> None:
    shape = ModelShape("s", hidden=64, intermediate=96, layers=3, heads=4, kv_heads=2, vocab=50, gated=gated)
    tokens, seq = 32, 16
    kw: dict[str, Any] = dict(hidden=64, intermediate=96, layers=3, heads=4, kv_heads=2, vocab=50, tokens=tokens)
    phases = llama_phases(**kw, gated=gated)
    gemms = sum(g.flops for shapes, _ in phases for g in shapes)
    own = server_flops(**kw, seq=seq, params=shape.params, gated=gated)
    assert shape.step_flops(tokens, seq) == pytest.approx(gemms + own["attention"] + own["optimizer"])
    mlp = phases[2][0][0]  # layer 0's MLP-in forward GEMM
    assert (mlp.n, mlp.k) == ((2 * 96 if gated else 96), 64)


def test_gpu_step_is_flops_over_rate_and_checks_memory() -> None:
    step = gpu_step(TINY, "gpu", 1e12, 1e9, batch=2, seq=SEQ)
    assert step.step_s == pytest.approx(TINY.step_flops(2 * SEQ, SEQ) / 1e12)
    assert step.fits
    assert not gpu_step(TINY, "gpu", 1e12, step.needs_bytes / 2, batch=2, seq=SEQ).fits


def test_one_micro_batch_step_is_linear_in_the_layers() -> None:
    """What benchmarks/units_scale.py rests on: with one micro-batch the phases run one after another and every
    layer's take the same time, so the timeline's step, bytes and bound at L layers extend from 1 and 2 layers."""
    from fedfusion.units.timeline import simulate

    devices = [device(flops=1e9, bps=1e6, rtt=0.01, overhead=0.001), device(flops=2e9, bps=5e5, rtt=0.02,
                                                                            overhead=0.002)] * 3

    def run(layers: int) -> tuple[float, float, float]:
        phases = llama_phases(hidden=32, intermediate=64, layers=layers, heads=4, kv_heads=2, vocab=40, tokens=64)
        t = simulate(devices, [phases], accumulate=True, lanes=0, server_gap_s=0.003)
        return t.step_s, float(t.down_bytes.sum()), t.lower_bound_s

    one, two, five = run(1), run(2), run(5)
    for a, b, whole in zip(one, two, five):
        assert a + 4 * (b - a) == pytest.approx(whole, rel=1e-9)
