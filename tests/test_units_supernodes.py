"""Several SuperNodes per device (``UnitEngine.supernodes``, recipe ``units.supernodes``): micro-batch c's messages go
to the device's node c mod k, each node with its own weight cache and running sums. The step stays exact, routing
and caches are per node, and a node that dies or forgets costs only its own work."""

from __future__ import annotations

import threading

import pytest
import torch

from fedfusion.config.recipe import load_recipe, nodes_per_client
from fedfusion.config.sections import RecipeError
from fedfusion.run.units import nodes_in_order
from fedfusion.units import UnitEngine, in_process
from fedfusion.units.messages import DeviceRuntime
from fedfusion.units.workers import DiesAfter
from fedfusion.wire.specs import Caps, PopulationSpec
from tests.test_units_accumulate import Forgets, assert_equals_local, batch, units_step, weight_gradient_phases
from tests.test_units_exact import devices

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny GEMMs on one thread, restored after


class Routed:
    """An in-process transport that records, per call, the calling micro-batch and the nodes it sent to."""

    def __init__(self, workers: list, engine_ref: list[UnitEngine]) -> None:
        self.send, self.engine_ref = in_process(workers), engine_ref
        self.calls: list[tuple[int, list[int]]] = []
        self.lock = threading.Lock()

    def __call__(self, payloads: dict[int, bytes], deadlines: dict[int, float]) -> dict[int, bytes | None]:
        with self.lock:
            self.calls.append((self.engine_ref[0].chain, sorted(payloads)))
        return self.send(payloads, deadlines)


def engine_with(count: int, k: int, workers: list | None = None) -> tuple[UnitEngine, Routed]:
    workers = workers or [DeviceRuntime() for _ in range(count * k)]
    ref: list[UnitEngine] = []
    transport = Routed(workers, ref)
    engine = UnitEngine(devices(count), workers=workers, transport=transport, supernodes=k)
    ref.append(engine)
    return engine, transport


@pytest.mark.parametrize("micro,k,in_flight,accumulate", [(2, 2, 0, True), (4, 2, 0, True), (3, 2, 1, True),
                                                          (4, 3, 2, True), (4, 2, 0, False)])
def test_float64_step_on_several_supernodes_equals_local(micro: int, k: int, in_flight: int, accumulate: bool) -> None:
    ids = batch(micro)
    engine, transport = engine_with(3, k)
    got = units_step(torch.float64, ids, micro, engine, in_flight, accumulate)
    assert_equals_local(ids, micro, got)  # within the float64 bound of the local step
    assert not engine._sums and engine.server_fallback == 0 and not engine.strikes.counts
    for chain, slots in transport.calls:  # micro-batch c only ever reaches node c mod k of a device
        assert slots and all(slot % k == chain % k for slot in slots), (chain, slots)
    assert {slot % k for _, slots in transport.calls for slot in slots} == set(range(min(k, micro)))


def test_each_node_caches_its_own_weights_and_uploads_its_own_sums() -> None:
    """Two micro-batches on one node against one on each of two: weight blocks travel down once per node (twice the
    weight bytes), each node uploads its own weight-gradient sums (twice the sum bytes), and measured bytes per
    device and phase stay within 5 % of the closed form."""
    ids = batch(2)
    one, _ = engine_with(3, 1)
    two, _ = engine_with(3, 2)
    units_step(torch.float64, ids, 2, one, in_flight=1)  # one node, one micro-batch at a time: no message races
    units_step(torch.float64, ids, 2, two, in_flight=0)  # one micro-batch per node
    assert set(two.held) == {two.slot(d, n) for d in range(3) for n in range(2)}
    assert all(two.held[two.slot(d, 0)] == two.held[two.slot(d, 1)] == one.held[d] for d in range(3))
    up = [sum(sum(rec.up_bytes.values()) for rec in weight_gradient_phases(e)) for e in (one, two)]
    down = [sum(sum(rec.down_bytes.values()) for rec in e.trace) for e in (one, two)]
    assert 1.5 * up[0] < up[1] and down[0] < down[1]
    for rec in two.trace:
        for dev, n in rec.down_bytes.items():
            assert abs(n / rec.formula_down[dev] - 1) <= 0.05
        for dev, n in rec.up_bytes.items():
            assert abs(n / rec.formula_up[dev] - 1) <= 0.05


@pytest.mark.slow  # two full steps of 4 micro-batches on 8 nodes: ~1 s each, kept out of the quick loop
@pytest.mark.parametrize("kind", ["dies", "forgets"])
def test_a_node_lost_mid_step_costs_only_its_own_sums(kind: str) -> None:
    """Node 1 of device 1 (slot 3) dies (the device goes offline: its other node gets nothing more) or loses its
    state (its micro-batches' sums are recomputed; node 0's sums of the same device are used): the step is exact."""
    ids = batch(4)
    lost = DiesAfter(8) if kind == "dies" else Forgets(8)  # of its 22 messages: in the forward phases
    workers = [DeviceRuntime() for _ in range(8)]
    workers[3] = lost  # type: ignore[call-overload]
    engine, transport = engine_with(4, 2, workers)
    got = units_step(torch.float64, ids, 4, engine, in_flight=0)
    assert_equals_local(ids, 4, got)
    assert sum(rec.redispatched for rec in engine.trace) >= 1 and not engine._sums  # its units went elsewhere
    assert engine.offline == ({1} if kind == "dies" else set())
    late = [slots for chain, slots in transport.calls[len(transport.calls) // 2:]]
    if kind == "dies":  # the device is gone: neither of its nodes gets units after it
        assert not any(2 in slots or 3 in slots for slots in late[-5:])
    else:  # the node that forgot is asked again (its cache refilled), and so is its device's other node
        assert any(3 in slots for slots in late) and any(2 in slots for slots in late)


def test_population_spec_maps_nodes_to_clients_and_the_recipe_key_is_validated() -> None:
    spec = PopulationSpec({"phone": 1.0}, 4, 0, supernodes=2)
    assert [spec.client(p) for p in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert PopulationSpec.from_config(spec.to_config()) == spec
    recipe = load_recipe("units", ["units.supernodes=2", "units.micro_batches=2"])
    assert nodes_per_client(recipe) == 2 and recipe.units.runtime() == {"supernodes": 2}
    assert nodes_per_client(load_recipe("quickstart", ["units.supernodes=2"])) == 1  # other methods: one node each
    assert load_recipe("units").units.runtime() == {"lanes": 1}
    for bad, key in ((["units.supernodes=0"], "units.supernodes"), (["units.supernodes=2", "units.lanes=0"], "units.lanes"),
                     (["units.supernodes=2", "units.micro_batches=1"], "units.supernodes.*no work")):
        with pytest.raises(RecipeError, match=key):
            load_recipe("units", bad)
    with pytest.raises(ValueError, match="supernodes"):
        UnitEngine(devices(2), supernodes=0)


def test_nodes_map_to_devices_by_partition_and_a_bad_federation_is_named() -> None:
    """Node index = partition-id (device p // k); ids not exactly 0 .. clients x k - 1, or a device whose nodes
    report different tiers (hand-started SuperNodes), stop the run with what is off."""
    caps = {100 + p: Caps("phone" if p < 2 else "laptop", p, 0) for p in (3, 0, 2, 1)}
    assert nodes_in_order(caps, 2, 2) == [100, 101, 102, 103]
    with pytest.raises(ValueError, match=r"partition-ids are \[0, 1, 2, 2\], expected 0..3"):
        nodes_in_order({**caps, 103: Caps("laptop", 2, 0)}, 2, 2)
    with pytest.raises(ValueError, match=r"device 1 \(partition-ids 2..3\) report different tiers"):
        nodes_in_order({**caps, 103: Caps("phone", 3, 0)}, 2, 2)


def test_micro_batches_zero_chooses_at_least_one_per_supernode() -> None:
    """``micro_batches: 0`` with k SuperNodes chooses among counts >= k (fewer would leave nodes idle, which a fixed
    count is refused for); more SuperNodes than the batch has examples is refused."""
    from fedfusion.analysis.units_plan import units_micro_batches

    recipe = load_recipe("units", ["units.micro_batches=0", "units.supernodes=4"])
    assert units_micro_batches(recipe.units, recipe.train, recipe.population, recipe.model, recipe.data_source()) >= 4
    with pytest.raises(RecipeError, match="units.supernodes.*train.batch_size"):
        load_recipe("units", ["units.supernodes=16", "units.micro_batches=0", "train.batch_size=8"])
