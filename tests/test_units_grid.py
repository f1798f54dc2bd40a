"""The units mode's Flower seam without Flower's runtime: :class:`GridTransport` over an in-memory fake Grid whose
nodes run the real handler (``fedfusion.clients.units.answer``, weight cache in ``context.state``)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from uuid import uuid4

import pytest
import torch
from fedfusion.clients.units import Node
from fedfusion.clients.units import answer as units_handler
from fedfusion.strategies.transport import UNITS_MESSAGE, GridTransport
from flwr.app import Context, Message, RecordDict
from fp_bounds import assert_same_product

from fedfusion.config.recipe import load_recipe
from fedfusion.config.sections import RecipeError
from fedfusion.units import Gemm, Operand, UnitDevice, UnitEngine


@pytest.fixture(autouse=True, scope="module")
def _task_identity() -> None:
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # as tests/test_strategy.py does


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny GEMMs on one thread, restored after


class FakeGrid:
    """Answers each pushed message at once through the units role's handler, except nodes in ``silent`` (never) and
    nodes in ``forget`` (their context.state is wiped before each message: a lost weight cache)."""

    def __init__(self, nodes: list[int], silent: set[int] = frozenset(), forget: set[int] = frozenset()) -> None:
        self.contexts = {n: Context(run_id=1, node_id=n, node_config={}, state=RecordDict(), run_config={})
                         for n in nodes}
        self.silent, self.forget = silent, forget
        self.replies: dict[str, Message] = {}
        self.pushed: list[Message] = []

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid4())
            self.pushed.append(msg)
            node = msg.metadata.dst_node_id
            if node in self.forget:
                self.contexts[node].state = RecordDict()
            if node not in self.silent:
                self.replies[msg.metadata.message_id] = units_handler(msg, self.contexts[node])
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self.replies.pop(m) for m in list(message_ids) if m in self.replies]


def gemm(seed: int = 0) -> tuple[Gemm, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(96, 32, generator=gen, dtype=torch.float64), torch.randn(48, 32, generator=gen, dtype=torch.float64)
    return Gemm(Operand("X", x), Operand("W0", w, t=True)), x @ w.T


def engine_over(grid: FakeGrid, nodes: list[int], floor_s: float) -> tuple[UnitEngine, GridTransport]:
    transport = GridTransport(grid, nodes, floor_s=floor_s, poll_s=0.005)  # type: ignore[arg-type]
    devices = [UnitDevice(f"d{i}", 1e8, 1e9, 1e6, 5e5) for i in range(len(nodes))]
    return UnitEngine(devices, transport=transport), transport


def test_grid_transport_pushes_one_units_message_per_device_and_the_product_is_exact():
    nodes = [11, 22, 33]
    grid = FakeGrid(nodes)
    engine, transport = engine_over(grid, nodes, floor_s=5.0)
    g, want = gemm()
    (got,) = engine.phase([g])
    assert_same_product(got, want, g.a.base, g.b.base.T)  # float64 tiles against one product: their bounds
    assert {m.metadata.message_type for m in grid.pushed} == {UNITS_MESSAGE}
    assert len({m.metadata.dst_node_id for m in grid.pushed}) == len(grid.pushed)  # one message per device
    assert transport.waits[0].waited_s < 1.0 and not transport.waits[0].missed
    # each node keeps the weight blocks it got in context.state; the next phase on the same weights sends none
    assert any(len(grid.contexts[n].state[Node.CACHE]) for n in nodes)
    first = sum(engine.trace[0].down_bytes.values())
    (again,) = engine.phase([Gemm(Operand("X", g.a.base * 2), g.b)])
    assert_same_product(again, 2 * want, 2 * g.a.base, g.b.base.T)
    assert sum(engine.trace[1].down_bytes.values()) < first


def test_a_silent_node_costs_its_deadline_once_and_its_units_go_elsewhere():
    nodes = [5, 6, 7, 8]
    grid = FakeGrid(nodes, silent={7})
    engine, transport = engine_over(grid, nodes, floor_s=0.3)
    g, want = gemm(1)
    start = time.monotonic()
    (got,) = engine.phase([g])
    assert_same_product(got, want, g.a.base, g.b.base.T)
    assert engine.offline == {2}
    assert [w.missed for w in transport.waits] == [[2], []]
    assert 0.3 <= transport.waits[0].waited_s <= 0.3 + 0.2 and time.monotonic() - start < 1.0
    sent = len(grid.pushed)
    engine.phase([g])
    assert all(m.metadata.dst_node_id != 7 for m in grid.pushed[sent:])  # offline: never asked again


def test_a_node_that_lost_its_weight_cache_answers_an_error_and_gets_the_weights_again():
    nodes = [1, 2]
    grid = FakeGrid(nodes)
    engine, _ = engine_over(grid, nodes, floor_s=5.0)
    g, want = gemm(2)
    engine.phase([g])
    grid.forget = {1}  # node 1 loses its cache; the server still thinks it holds its W0 blocks
    x = g.a.base + 1
    (got,) = engine.phase([Gemm(Operand("X", x), g.b)])
    assert_same_product(got, x @ g.b.base.T, x, g.b.base.T)
    assert engine.server_fallback == 0 and not engine.offline and not engine.strikes.counts
    assert engine.trace[1].redispatched >= 1  # its units went to node 2
    grid.forget = set()
    (got,) = engine.phase([Gemm(Operand("X", 2 * x), g.b)])  # node 1 gets its weight blocks again and answers
    assert_same_product(got, 2 * x @ g.b.base.T, 2 * x, g.b.base.T)
    assert engine.trace[2].down_bytes.get(0, 0) >= engine.trace[0].down_bytes[0]
    assert 0 in engine.trace[2].up_bytes


@pytest.mark.parametrize("override,key", [("units.offload=attention", "units.offload"),
                                          ("units.micro_batches=3", "units.micro_batches"),
                                          ("units.steps=0", "units.steps"),
                                          ("units.stall_partition=99", "units.stall_partition"),
                                          ("units.link_scale=0", "units.link_scale")])
def test_units_recipe_values_are_checked(override, key):
    with pytest.raises(RecipeError, match=key):
        load_recipe("rolling", ["fusion.method=units", override])


def test_units_recipe_loads_and_the_shipped_recipe_is_units():
    recipe = load_recipe("units")
    assert recipe.fusion.method == "units" and recipe.units.steps >= 3 and recipe.population.num_clients >= 4
