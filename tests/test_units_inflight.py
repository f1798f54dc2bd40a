"""Early queueing: several micro-batches in flight, one thread each, so a device's next
message is queued while it computes the current one. The step stays the same (float64: to rounding; float32: every
product within its rounding bound, as tests/test_units_exact.py), the engine has several messages out at once, and
in virtual time each device idles less between its messages."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from model_bounds import float64_norms

from fedfusion.run.units import train_step
from fedfusion.units import UnitEngine, in_process, install
from fedfusion.units.messages import DeviceRuntime
from fedfusion.units.phases import llama_phases
from fedfusion.units.timeline import chains_from_trace, simulate
from tests.test_units_accumulate import in_dtype
from tests.test_units_exact import assert_products_within_rounding, assert_same_step, record_products
from tests.test_units_timeline import QUICKSTART, llama, phones

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny GEMMs on one thread, restored after


class Counting:
    """An in-process transport that records how many calls (phase rounds) are out at once."""

    def __init__(self, devices: int, hold_s: float = 0.03) -> None:
        self.send = in_process([DeviceRuntime() for _ in range(devices)])
        self.hold_s, self.out, self.most = hold_s, 0, 0
        self.lock = threading.Lock()

    def __call__(self, payloads: dict[int, bytes], deadlines: dict[int, float]) -> dict[int, bytes | None]:
        with self.lock:
            self.out += 1
            self.most = max(self.most, self.out)
        time.sleep(self.hold_s)  # a link's latency: the other micro-batches' threads go on meanwhile
        try:
            return self.send(payloads, deadlines)
        finally:
            with self.lock:
                self.out -= 1


def step(in_flight: int, micro: int = 4, hold_s: float = 0.03, dtype: torch.dtype = torch.float64
         ) -> tuple[float, torch.nn.Module, UnitEngine, Counting, list]:
    """One AdamW step of the timeline's Llama in ``dtype``, ``micro`` micro-batches, ``in_flight`` at once (0: all):
    (loss, model, engine, transport, every product the engine returned as ``record_products`` records it)."""
    model = start(dtype)
    transport = Counting(3, hold_s)
    engine = UnitEngine(phones(3), transport=transport)
    products = record_products(engine)
    install(model, engine, "all")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def on_micro(c: int) -> None:
        engine.chain = c

    with in_dtype(dtype):
        loss = train_step(model, opt, windows(micro), micro, on_micro, in_flight)
    return loss, model, engine, transport, products


def start(dtype: torch.dtype) -> torch.nn.Module:
    """The timeline's Llama in ``dtype`` (float64: its norms too, model_bounds.float64_norms)."""
    model = llama().to(dtype)
    return float64_norms(model) if dtype == torch.float64 else model


def windows(micro: int) -> torch.Tensor:
    return torch.randint(0, 60, (micro, 33), generator=torch.Generator().manual_seed(1))


def test_micro_batches_in_flight_give_the_same_step() -> None:
    """Float64: the step with all micro-batches in flight equals the sequential one to float64 rounding: loss,
    gradients and weights within their float64 bounds (test_units_exact.assert_same_step). Float32: every product
    of the step in flight is within ``gamma_k |A| |B|`` of the exact product of its operands (tests/fp_bounds.py),
    on any CPU; the float32 weights after AdamW's first step (``g / (|g| + eps)``) are no quantity a rounding bound
    can be put on, so they are not compared."""
    loss_1, one, engine_1, t_1, _ = step(in_flight=1, hold_s=0.005)  # sequential: a short hold still shows any overlap
    loss_all, many, engine_all, t_all, _ = step(in_flight=0)
    assert_same_step(one, many, start(torch.float64), windows(4), (loss_1, loss_all), micro=4)
    assert t_1.most == 1 and t_all.most >= 2  # one message round out at a time, against several
    chains = [rec.chain for rec in engine_all.trace]
    assert sorted(set(chains)) == [0, 1, 2, 3] and chains != sorted(chains)  # the micro-batches' phases interleave
    assert chains_from_trace(engine_all.trace) == chains_from_trace(engine_1.trace)  # each chain: the same phases
    _, _, engine_32, t_32, products = step(in_flight=0, dtype=torch.float32)
    assert t_32.most >= 2 and len(products) >= len(engine_32.trace) > 0
    assert_products_within_rounding(products)


def test_a_device_idles_less_between_messages_when_the_next_is_queued() -> None:
    """Virtual time (``timeline.simulate``), quickstart target, 8 phones, 4 micro-batches of 256 tokens, 20 ms of
    server time between phases: one micro-batch at a time against all four in flight."""
    chains = [llama_phases(**QUICKSTART, tokens=256, mode="all")] * 4
    one = simulate(phones(8), chains, server_gap_s=0.02, in_flight=1)
    four = simulate(phones(8), chains, server_gap_s=0.02, in_flight=0)
    used = one.down_bytes > 0
    gap_one, gap_four = float(np.mean(one.idle_gap_s[used])), float(np.mean(four.idle_gap_s[used]))
    print(f"mean idle gap per device {gap_one:.2f} s -> {gap_four:.2f} s; step {one.step_s:.2f} s -> {four.step_s:.2f} s")
    assert gap_four < 0.5 * gap_one and four.step_s < one.step_s
    assert np.allclose(one.compute_s, four.compute_s)  # the same work, only the waiting differs
