"""Participation: availability -> selector -> dropouts on a simulated clock, and its place in the strategy."""

from __future__ import annotations

import json

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord

from fedfusion.devices.availability import AvailabilityModel
from fedfusion.devices.catalog import load_catalog
from fedfusion.devices.energy import price_work
from fedfusion.selection.participation import Participation
from fedfusion.selection.selectors import make_selector
from tests.test_strategy import FakeGrid, make_strategy, task_identity  # noqa: F401 (autouse fixture)

CATALOG = load_catalog()
WIDTH = {"phone": 0.125, "laptop": 0.25, "desktop": 0.5}  # each tier's job scales with its sub-model
COSTS = {t: price_work(CATALOG[t], 8e12 * w, int(4e6 * w), int(4e6 * w)) for t, w in WIDTH.items()}


def _clients(n: int) -> dict[int, str]:
    tiers = ("phone", "laptop", "desktop")
    return {i: tiers[i % 3] for i in range(n)}


def test_without_availability_everyone_may_be_drawn_and_a_slow_client_stretches_the_round():
    part = Participation(make_selector("random", seed=1), CATALOG, round_interval_s=0.5)
    draw = part.draw(1, _clients(30), 6, COSTS)
    assert len(draw.train) == 6 and draw.dropped == [] and draw.clock_s == 0.0
    part.settle(1, {c: ("ok", 10, 2.0) for c in draw.train})
    slowest = max(COSTS[_clients(30)[c]].virtual_s for c in draw.train)
    assert slowest > 0.5 and part.clock_s == slowest  # the slowest client outlasts the round interval
    assert part.examples == {c: 10 for c in draw.train}


def test_the_clock_does_not_wait_for_clients_over_selection_cut():
    part = Participation(make_selector("random", seed=1), CATALOG, round_interval_s=0.5)
    clients = _clients(30)
    draw = part.draw(1, clients, 6, COSTS)
    slow_tier = clients[max(draw.train, key=lambda c: COSTS[clients[c]].virtual_s)]
    part.settle(1, {c: ("cut" if clients[c] == slow_tier else "ok", 10, 2.0) for c in draw.train})
    waited = max(COSTS[clients[c]].virtual_s for c in draw.train if clients[c] != slow_tier)
    assert part.clock_s == max(0.5, waited) < COSTS[slow_tier].virtual_s


def test_a_virtual_deadline_drops_the_clients_predicted_too_slow():
    slowest = max(COSTS, key=lambda t: COSTS[t].virtual_s)
    part = Participation(make_selector("random", seed=0), CATALOG, deadline_s=COSTS[slowest].virtual_s * 0.99)
    draw = part.draw(1, _clients(30), 30, COSTS)
    assert draw.dropped and all(_clients(30)[c] == slowest for c in draw.dropped)
    assert not any(_clients(30)[c] == slowest for c in draw.train)


def test_availability_limits_who_is_eligible_and_drops_jobs_that_outlast_their_window():
    clients = _clients(300)
    avail = AvailabilityModel.for_tiers([clients[i] for i in range(300)], CATALOG, seed=3)
    part = Participation(make_selector("random", seed=0), CATALOG, avail, start_clock_s=12 * 3600.0)
    eligible = set(avail.available(1, 12 * 3600.0).tolist())
    draw = part.draw(1, clients, 300, COSTS)
    assert set(draw.train) | set(draw.dropped) == eligible  # only eligible devices are ever drawn
    long_jobs = {t: price_work(CATALOG[t], 1e12, 0, 0, idle_s=0) for t in COSTS}
    long_jobs = {t: type(c)(**{**c.__dict__, "compute_s": 30 * 3600.0}) for t, c in long_jobs.items()}
    assert Participation(make_selector("random", seed=0), CATALOG, avail, 12 * 3600.0).draw(
        1, clients, 300, long_jobs).train == []  # a 30 h job fits no window


def test_no_one_available_still_moves_the_clock():
    avail = AvailabilityModel.for_tiers(["desktop"] * 5, CATALOG, seed=0)
    part = Participation(make_selector("random", seed=0), CATALOG, avail, round_interval_s=600.0)
    clock = next(t for t in np.arange(0, 86400, 600.0) if len(avail.available(1, t)) == 0)
    part.clock_s = clock
    assert part.draw(1, {i: "desktop" for i in range(5)}, 3, COSTS).train == []
    part.settle(1, {})
    assert part.clock_s == clock + 600.0


def test_energy_selection_spends_less_per_round_than_random_on_the_same_population():
    clients = _clients(300)
    spent = {}
    for name in ("random", "energy"):
        part = Participation(make_selector(name, seed=0), CATALOG)
        total = 0.0
        for rnd in range(1, 21):
            draw = part.draw(rnd, clients, 10, COSTS)
            total += sum(COSTS[clients[c]].wall_j for c in draw.train)
            part.settle(rnd, {c: ("ok", 50, 2.0) for c in draw.train})
        spent[name] = total
    assert spent["energy"] < 0.7 * spent["random"]


def test_participation_state_restores_selector_clock_and_examples():
    clients = _clients(60)
    a = Participation(make_selector("oort", seed=4), CATALOG)
    for rnd in (1, 2):
        draw = a.draw(rnd, clients, 5, COSTS)
        a.settle(rnd, {c: ("ok", 20 + c, 1.5) for c in draw.train})
    saved = json.loads(json.dumps(a.state_dict()))
    b = Participation(make_selector("oort", seed=4), CATALOG)
    b.load_state_dict(saved)
    assert b.clock_s == a.clock_s and b.examples == a.examples
    assert b.draw(3, clients, 5, COSTS) == a.draw(3, clients, 5, COSTS)


def test_strategy_logs_dropped_clients_without_sending_them_work():
    strategy, state = make_strategy()
    strategy.run.participation.deadline_s = 1e-9  # every client is predicted too slow
    grid = FakeGrid({11: "phone", 12: "desktop", 13: "phone"})
    assert list(strategy.configure_train(1, ArrayRecord(state), ConfigRecord({}), grid)) == []
    rows = strategy.run.round.rows.values()
    assert {r.status for r in rows} == {"dropped"} and all(r.params > 0 and r.bytes_down > 0 for r in rows)
    arrays, metrics = strategy.aggregate_train(1, [])
    assert arrays is None and metrics["clients_ok"] == 0


def test_jain_index_bounds():
    from fedfusion.selection.participation import jain_index

    assert jain_index([3, 3, 3, 3]) == 1.0
    assert jain_index([4, 0, 0, 0]) == 0.25
    assert jain_index([0, 0]) == 0.0


def test_a_pool_takes_another_batch_while_too_few_of_its_nodes_are_available():
    from tests.test_strategy import CountingGrid, pooled_strategy

    tiers = {n: ("phone", "desktop")[n % 2] for n in range(3000)}  # the fake grid's partition is the node id
    avail = AvailabilityModel.for_tiers([tiers[n] for n in range(3000)], CATALOG, seed=3)
    clock = 18 * 3600.0  # about 1% of these devices are in a window
    strategy = pooled_strategy(pool=10)
    strategy.run.participation = Participation(make_selector("random", seed=0), CATALOG, avail, start_clock_s=clock)
    grid = CountingGrid(tiers)
    drawn = strategy.sample(grid, 1)
    eligible = set(avail.available(1, clock).tolist())
    found = np.cumsum([len(eligible.intersection(batch)) for batch in grid.queries])
    assert len(grid.queries) > 1 and all(len(b) == 10 for b in grid.queries)
    assert found[-1] >= 3 and (found[:-1] < 3).all()  # it stops at the first batch that makes up the draw
    assert len(drawn) == 3 and set(drawn) <= eligible
