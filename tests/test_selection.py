"""Client selectors: determinism, resume, Oort's preferences, energy and budget behaviour, edge cases."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedfusion.devices.catalog import load_catalog
from fedfusion.devices.energy import price_work
from fedfusion.selection.selectors import (
    SELECTORS,
    Candidates,
    CarbonBudgetSelector,
    EnergySelector,
    OortSelector,
    Outcome,
    make_selector,
    selector_options,
    statistical_utility,
)

BUDGETS = {"USA": 5000.0, "FRA": 2000.0, "IND": 800.0}


def population(n: int = 400, seed: int = 0) -> tuple[Candidates, np.ndarray]:
    """Candidates with random durations, per-tier energies (so ties exist), batteries and zones; plus a
    hidden per-client utility."""
    rng = np.random.default_rng(seed)
    energy = rng.choice([12.0, 40.0, 95.0, 250.0, 480.0], n)
    battery = np.where(rng.random(n) < 0.3, np.nan, rng.uniform(0, 1, n))
    cand = Candidates(
        ids=np.arange(n) * 3 + 1, duration_s=rng.uniform(10, 300, n), energy_j=energy, co2_g=energy * 0.05,
        battery=battery, plugged=rng.random(n) < 0.5, zone=rng.choice(list(BUDGETS), n),
    )
    return cand, rng.uniform(1, 100, n)


def options(name: str) -> dict:
    return {"budgets_j": BUDGETS} if name == "carbon_budget" else {}


def play(selector, cand: Candidates, utility: np.ndarray, rounds: range, k: int = 10) -> list[list[int]]:
    """Select and feed back (deterministic outcomes) for ``rounds``; the picks of each round."""
    where = {int(c): i for i, c in enumerate(cand.ids)}
    picks = []
    for r in rounds:
        chosen = selector.select(cand, k, r)
        outcomes = [
            Outcome(c, "ok" if c % 7 else "dropped", utility=float(utility[where[c]]),
                    duration_s=float(cand.duration_s[where[c]]), energy_j=float(cand.energy_j[where[c]]))
            for c in chosen
        ]
        selector.feedback(r, outcomes)
        picks.append(chosen)
    return picks


@pytest.mark.parametrize("name", list(SELECTORS))
def test_same_seed_same_picks_other_seed_differs(name):
    cand, util = population()
    a = play(make_selector(name, seed=3, **options(name)), cand, util, range(1, 9))
    b = play(make_selector(name, seed=3, **options(name)), cand, util, range(1, 9))
    c = play(make_selector(name, seed=4, **options(name)), cand, util, range(1, 9))
    assert a == b
    assert a != c
    for picks in a:
        assert len(set(picks)) == len(picks) and set(picks) <= set(cand.ids.tolist())


@pytest.mark.parametrize("name", list(SELECTORS))
def test_restored_state_continues_identically(name):
    cand, util = population()
    straight = make_selector(name, seed=1, **options(name))
    expected = play(straight, cand, util, range(1, 13))
    first = make_selector(name, seed=1, **options(name))
    head = play(first, cand, util, range(1, 7))
    saved = json.loads(json.dumps(first.state_dict()))  # plain data, survives JSON
    resumed = make_selector(name, seed=99, **options(name))
    resumed.load_state_dict(saved)
    assert head + play(resumed, cand, util, range(7, 13)) == expected


def test_state_of_another_selector_is_refused():
    with pytest.raises(ValueError, match="saved by selector 'random'"):
        make_selector("oort").load_state_dict(make_selector("random").state_dict())


@pytest.mark.parametrize("name", list(SELECTORS))
def test_empty_candidates_and_k_beyond_them(name):
    sel = make_selector(name, **options(name))
    empty = Candidates(ids=[], duration_s=[], energy_j=[], co2_g=[], zone=[])
    assert sel.select(empty, 5, 1) == []
    small = Candidates(ids=[4, 9, 2], duration_s=[1.0, 2.0, 3.0], energy_j=[1.0, 1.0, 1.0], co2_g=[1.0, 1.0, 1.0],
                       zone=["USA"] * 3)
    assert sel.select(small, 10, 2) == [2, 4, 9]
    assert sel.select(small, 0, 3) == []


def test_bad_arguments_are_named():
    cand, _ = population(5)
    with pytest.raises(ValueError, match="k: must be an integer >= 0"):
        make_selector("random").select(cand, -1, 1)
    with pytest.raises(ValueError, match="round: must be an integer >= 1"):
        make_selector("random").select(cand, 2, 0)
    with pytest.raises(ValueError, match="unknown selector 'fastest'; choose one of random, oort, energy"):
        make_selector("fastest")
    with pytest.raises(ValueError, match="has no option 'alhpa'"):
        make_selector("oort", alhpa=2)
    with pytest.raises(ValueError, match="client ids must be distinct"):
        Candidates(ids=[1, 1])
    with pytest.raises(ValueError, match=r"candidates.energy_j: expected 2 values"):
        Candidates(ids=[1, 2], energy_j=[1.0])
    with pytest.raises(ValueError, match="needs candidates.energy_j"):
        make_selector("energy").select(Candidates(ids=[1, 2]), 1, 1)
    with pytest.raises(ValueError, match="needs candidates.zone"):
        make_selector("carbon_budget", default_budget_j=1.0).select(Candidates(ids=[1], energy_j=[1.0]), 1, 1)
    with pytest.raises(ValueError, match="no budget for zone 'DEU'"):
        make_selector("carbon_budget", budgets_j={"FRA": 1.0}).select(
            Candidates(ids=[1], energy_j=[1.0], zone=["DEU"]), 1, 1)
    with pytest.raises(ValueError, match="needs budgets_j"):
        make_selector("carbon_budget")
    with pytest.raises(ValueError, match="selection.explore: must be in"):
        make_selector("oort", explore=1.5)
    with pytest.raises(ValueError, match="selection.sample_window: must be in"):
        make_selector("energy", sample_window=0.5)


def test_options_of_each_selector():
    assert selector_options("random") == ["seed"]
    assert {"alpha", "explore", "pacer_window", "seed"} <= set(selector_options("oort"))
    assert set(selector_options("oort")) < set(selector_options("energy"))  # energy is Oort plus its own
    assert {"energy_weight", "carbon_weight", "min_battery"} <= set(selector_options("energy"))
    assert {"budgets_j", "period_rounds", "default_budget_j"} <= set(selector_options("carbon_budget"))


def test_random_is_uniform():
    n, k, rounds = 50, 5, 4000
    sel = make_selector("random", seed=0)
    cand = Candidates(ids=np.arange(n))
    counts = np.zeros(n)
    for r in range(1, rounds + 1):
        counts[sel.select(cand, k, r)] += 1
    expected = rounds * k / n  # 400; binomial sd ~19
    assert counts.sum() == rounds * k
    assert np.abs(counts - expected).max() < 5 * np.sqrt(expected)


def test_oort_prefers_high_utility_fast_clients():
    # 40 clients: utility high or low, duration fast or slow (10x the preferred duration)
    n = 40
    ids = np.arange(n)
    high, fast = ids % 2 == 0, ids % 4 < 2
    duration = np.where(fast, 10.0, 100.0)
    utility = np.where(high, 100.0, 1.0)
    cand = Candidates(ids=ids, duration_s=duration)
    sel = OortSelector(seed=0, explore=0.9, explore_decay=0.5, explore_min=0.0, pacer_window=1000)
    counts = np.zeros(n)
    for r in range(1, 61):
        picks = sel.select(cand, 8, r)
        sel.feedback(r, [Outcome(c, "ok", utility=float(utility[c]), duration_s=float(duration[c])) for c in picks])
        if r > 10:
            counts[picks] += 1
    best = counts[high & fast].mean()
    assert best > 2 * counts[high & ~fast].mean()
    assert best > 2 * counts[~high & fast].mean()
    assert counts[high & fast].sum() > 0.6 * counts.sum()


def test_oort_explores_big_fast_unexplored_clients_first_and_decays():
    ids = np.arange(1000)
    cand = Candidates(ids=ids, duration_s=np.where(ids < 500, 1.0, 100.0), examples=np.where(ids % 2, 10.0, 1000.0))
    sel = OortSelector(seed=0)
    picks = np.array(sel.select(cand, 50, 1))
    assert sel.explore == pytest.approx(0.9 * 0.95)  # decayed before the split, as Oort does
    assert np.mean(picks < 500) > 0.9  # slow clients carry the (T/d)^alpha penalty
    assert np.mean(picks % 2 == 0) > 0.9  # weighted by data size


@pytest.mark.parametrize("name", ["oort", "energy"])
def test_exploration_samples_only_the_best_sample_window_times_n(name):
    # nothing explored yet: all 10 picks explore, among the 5 x 10 best by data size (Oort's sample_window)
    rng = np.random.default_rng(1)
    examples = rng.permutation(1000) + 1.0
    cand = Candidates(ids=np.arange(1000), duration_s=np.ones(1000), energy_j=np.ones(1000), co2_g=np.ones(1000),
                      examples=examples)
    best = set(np.flatnonzero(examples > 950).tolist())
    for seed in range(5):
        picks = make_selector(name, seed=seed).select(cand, 10, 1)
        assert len(picks) == 10 and set(picks) <= best
    # without the window, sampling in proportion to size over all 1000 reaches far below the top 50
    wide = make_selector(name, seed=0, sample_window=float("inf"))
    assert len(set(wide.select(cand, 10, 1)) - best) >= 5


def test_oort_pacer_relaxes_preferred_duration_on_plateau():
    cand = Candidates(ids=np.arange(20), duration_s=np.linspace(1, 20, 20))
    sel = OortSelector(seed=0, explore=0.0, explore_min=0.0, pacer_window=2, pacer_step=10)
    percentiles = []
    for r in range(1, 10):
        picks = sel.select(cand, 4, r)
        sel.feedback(r, [Outcome(c, "ok", utility=1.0, duration_s=float(c + 1)) for c in picks])
        percentiles.append(sel.percentile)
    # exploited utility per round: 0 (round 1 only explores), then 4 every round; windows of 2 rounds
    assert sel.history == [0.0] + [4.0] * 8
    assert percentiles == [30.0] * 6 + [40.0] * 2 + [50.0]  # plateaus seen at rounds 7 and 9


def test_energy_picks_cheaper_than_random_at_similar_utility():
    rng = np.random.default_rng(5)
    n = 600
    energy = rng.choice([20.0, 60.0, 400.0], n)
    cand = Candidates(ids=np.arange(n), duration_s=np.full(n, 50.0), energy_j=energy, co2_g=energy * 0.1)
    utility = rng.uniform(40, 60, n)  # similar utility everywhere

    def spent(sel) -> float:
        total = 0.0
        for r in range(1, 31):
            picks = sel.select(cand, 20, r)
            total += energy[picks].sum()
            sel.feedback(r, [Outcome(c, "ok", utility=float(utility[c]), duration_s=50.0, energy_j=float(energy[c]))
                             for c in picks])
        return total

    assert spent(EnergySelector(seed=0)) < 0.5 * spent(make_selector("random", seed=0))


def test_energy_avoids_low_battery_devices_off_the_charger():
    n = 100
    battery = np.where(np.arange(n) < 50, 0.1, 0.9)
    plugged = np.arange(n) % 2 == 0  # among the low-battery half, even ids are charging
    cand = Candidates(ids=np.arange(n), energy_j=np.ones(n), co2_g=np.ones(n), battery=battery, plugged=plugged)
    picks = EnergySelector(seed=0).select(cand, 80, 1)
    assert len(picks) == 75  # the 25 low-battery unplugged devices are never picked
    assert all(c >= 50 or c % 2 == 0 for c in picks)


def test_carbon_budget_never_exceeds_any_zone_budget():
    cand, util = population(300)
    budgets = {"USA": 900.0, "FRA": 400.0, "IND": 150.0}
    sel = CarbonBudgetSelector(budgets, seed=0, period_rounds=3)
    where = {int(c): i for i, c in enumerate(cand.ids)}
    spent: dict[tuple[int, str], float] = {}
    for r in range(1, 13):
        picks = sel.select(cand, 60, r)
        for c in picks:
            key = ((r - 1) // 3, str(cand.zone[where[c]]))
            spent[key] = spent.get(key, 0.0) + float(cand.energy_j[where[c]])
        sel.feedback(r, [Outcome(c, "ok", utility=float(util[where[c]]), energy_j=float(cand.energy_j[where[c]]))
                         for c in picks])
    for (_, zone), joules in spent.items():
        assert joules <= budgets[zone] + 1e-9
    assert sum(spent.values()) > 0.9 * 4 * sum(budgets.values())  # the 4 periods' budgets are used, not ignored


def test_carbon_budget_is_greedy_in_utility_per_joule():
    cand = Candidates(ids=[0, 1, 2, 3], energy_j=[10.0, 30.0, 5.0, 50.0], zone=["A"] * 4)
    # nothing explored, so equal utility: cheapest first; 5 J + 10 J leave 25 J, too little for 30 J or 50 J
    sel = CarbonBudgetSelector({"A": 40.0}, seed=0)
    assert sel.select(cand, 4, 1) == [0, 2]
    assert sel.remaining_j("A") == pytest.approx(25.0)


def test_candidates_from_costs_prices_each_tier():
    catalog = load_catalog()
    costs = {t: price_work(catalog[t], 1e12, 10**6, 10**6) for t in ("phone", "laptop")}
    cand = Candidates.from_costs([0, 1, 2], ["phone", "laptop", "phone"], costs, zone=["USA"] * 3)
    assert cand.energy_j.tolist() == [costs["phone"].wall_j, costs["laptop"].wall_j, costs["phone"].wall_j]
    assert cand.duration_s[1] == costs["laptop"].virtual_s
    with pytest.raises(ValueError, match="no WorkCost for group 'desktop'"):
        Candidates.from_costs([0], ["desktop"], costs)


def test_statistical_utility_is_oorts():
    assert statistical_utility(100, 2.0) == 200.0
    with pytest.raises(ValueError):
        statistical_utility(10, float("nan"))
