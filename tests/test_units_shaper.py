"""Links emulated for real (``fedfusion.units.shaper``): the booking arithmetic on a fake clock, its agreement with
the timeline's links, and ``GridTransport`` handing messages on and accepting replies only when the shaped links
would have (a fake Grid, a fake clock: no real sleeps)."""

from __future__ import annotations

from collections.abc import Iterable
from uuid import uuid4

import numpy as np
import pytest
from fedfusion.strategies.transport import GridTransport
from flwr.app import Array, ArrayRecord, Message, RecordDict

from fedfusion.analysis.units_plan import units_devices
from fedfusion.config.recipe import load_recipe
from fedfusion.units.devices import UNLIMITED_SERVER, UnitDevice, UnitServer
from fedfusion.units.shaper import Shaper
from fedfusion.units.timeline import _Links
from fedfusion.wire.specs import UNITS_PAYLOAD, UNITS_RECORD


@pytest.fixture(autouse=True, scope="module")
def _task_identity() -> None:
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # as tests/test_strategy.py does


class FakeClock:
    """Seconds that move only when someone sleeps; every sleep is kept."""

    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def device(down: float, up: float, rtt: float) -> UnitDevice:
    return UnitDevice("d", 1e9, 1e12, down, up, rtt_s=rtt)


def shaper(devices: list[UnitDevice], server: UnitServer = UNLIMITED_SERVER) -> tuple[Shaper, FakeClock]:
    clock = FakeClock()
    return Shaper(devices, server, clock=clock, sleep=clock.sleep), clock


def test_a_link_delays_by_bytes_over_rate_plus_half_the_rtt_and_queues_its_messages():
    s, _ = shaper([device(down=1000.0, up=500.0, rtt=0.2)])
    assert s.down(0, 500, ready=0.0) == 0.5 + 0.1
    assert s.down(0, 1000, ready=0.25) == 0.5 + 1.0 + 0.1  # behind the first: its bytes start at 0.5
    assert s.down(0, 250, ready=3.0) == 3.0 + 0.25 + 0.1  # the link was free again
    assert s.up(0, 250, ready=0.0) == 0.5 + 0.1  # the uplink is a queue of its own, at its own rate
    assert s.up(0, 0, ready=0.0) == 0.5 + 0.1  # an empty reply still waits for the link and its latency


def test_the_server_links_are_shared_by_every_device():
    server = UnitServer("slow", send_bps=1000.0, recv_bps=2000.0)
    s, _ = shaper([device(1e6, 1e6, 0.0), device(1e6, 1e6, 0.0)], server)
    assert s.down(0, 1000, ready=0.0) == 1.0
    assert s.down(1, 1000, ready=0.0) == 2.0  # behind device 0's message on the server's send link
    assert s.up(1, 1000, ready=0.0) == 0.5 and s.up(0, 1000, ready=0.0) == 1.0


def test_the_shaper_books_as_the_timeline_prices():
    devices = [UnitDevice("a", 1e9, 1e15, 3e3, 1e3, rtt_s=0.06, overhead_s=0.0),
               UnitDevice("b", 1e9, 1e15, 5e3, 2e3, rtt_s=0.02, overhead_s=0.0)]
    server = UnitServer("s", 6e3, 2.5e3)
    s, _ = shaper(devices, server)
    links = _Links(devices, server)
    for t, d, down_b, up_b in [(0.0, 0, 900, 300), (0.0, 1, 1200, 700), (0.1, 0, 300, 900), (2.0, 1, 50, 10)]:
        arrived = s.down(d, down_b, ready=t)
        assert s.up(d, up_b, ready=arrived) == links.reply_at(d, t, down_b, 0.0, up_b, book=True)  # the same sums


def test_wait_sleeps_until_the_time_and_not_when_it_has_passed():
    s, clock = shaper([device(1.0, 1.0, 0.0)])
    s.wait(2.5)
    s.wait(1.0)
    assert clock.slept == [2.5] and clock.now == 2.5


class TimedGrid:
    """Answers each pushed message at once with ``reply_bytes`` bytes; notes when (on ``clock``) it got each."""

    def __init__(self, clock: FakeClock, reply_bytes: int) -> None:
        self.clock, self.reply_bytes = clock, reply_bytes
        self.pushed: dict[int, float] = {}
        self.replies: dict[str, Message] = {}

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid4())
            self.pushed[msg.metadata.dst_node_id] = self.clock()
            content = RecordDict({UNITS_RECORD: ArrayRecord({UNITS_PAYLOAD: Array(np.zeros(self.reply_bytes,
                                                                                           np.uint8))})})
            self.replies[msg.metadata.message_id] = Message(content, reply_to=msg)
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self.replies.pop(m) for m in list(message_ids) if m in self.replies]


def test_the_transport_hands_each_message_on_and_accepts_each_reply_when_the_links_would():
    devices = [device(down=1000.0, up=100.0, rtt=0.2), device(down=2000.0, up=400.0, rtt=0.0)]
    s, clock = shaper(devices)
    grid = TimedGrid(clock, reply_bytes=40)
    transport = GridTransport(grid, [7, 9], floor_s=60.0, shaper=s)  # type: ignore[arg-type]
    replies = transport({0: b"x" * 500, 1: b"y" * 1000}, {0: 1.0, 1: 1.0})
    assert grid.pushed == {7: 0.5 + 0.1, 9: 0.5}  # each node gets its message when its downlink has delivered it
    assert replies == {0: bytes(40), 1: bytes(40)}
    # node 7's reply: back at 0.6, 40 bytes at 100 B/s, 0.1 s latency; node 9's: back at 0.5, 0.1 s
    assert transport.waits[0].waited_s == pytest.approx(0.6 + 0.4 + 0.1, rel=1e-12) and not transport.waits[0].missed
    assert max(clock.slept) < 0.6  # it slept from event to event, not past them


def test_a_reply_the_uplink_delivers_past_the_deadline_is_missed():
    s, clock = shaper([device(down=1e6, up=10.0, rtt=0.0), device(down=1e6, up=1e6, rtt=0.0)])
    transport = GridTransport(TimedGrid(clock, reply_bytes=50), [1, 2], floor_s=2.0, shaper=s)  # type: ignore[arg-type]
    replies = transport({0: b"a", 1: b"b"}, {0: 0.0, 1: 0.0})
    assert replies[0] is None and replies[1] == bytes(50)  # 50 bytes at 10 B/s: 5 s, past the 2 s floor
    assert transport.waits[0].missed == [0] and clock.now < 2.0


def test_link_scale_scales_the_devices_links_the_plan_and_the_run_build():
    plain, slow = (units_devices(r.units, r.population, r.seed)
                   for r in (load_recipe("units"), load_recipe("units", ["units.link_scale=0.25"])))
    assert [(d.down_bps * 0.25, d.up_bps * 0.25, d.flops, d.rtt_s) for d in plain] == \
        [(d.down_bps, d.up_bps, d.flops, d.rtt_s) for d in slow]
