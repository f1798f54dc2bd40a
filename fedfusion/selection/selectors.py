"""Client selectors for every fusion strategy: random, Oort, energy-aware Oort and a per-zone energy budget.

One interface (:class:`Selector`): ``select(candidates, k, round)`` picks up to ``k`` client ids from a
columnar view of the eligible clients (:class:`Candidates`), ``feedback(round, outcomes)`` tells the
selector what each picked client achieved (:class:`Outcome`), and ``state_dict()`` /
``load_state_dict()`` save and restore everything, RNG included, as a plain JSON-able dict, so a resumed
run selects exactly as an uninterrupted one. Every selector is seeded and deterministic for its seed.

- ``random``: k clients uniformly without replacement.
- ``oort`` (Lai et al., OSDI'21): explored clients score their last statistical utility (min-max
  normalised after clipping at the 95th percentile) plus a staleness bonus
  ``sqrt(staleness * ln(round) / last_round)``, times ``(T / d_i) ** alpha`` when their duration d_i
  (observed, else predicted) exceeds the preferred duration T (the ``percentile``-th percentile of the
  candidates' durations). A fraction ``explore`` of the picks (decayed by ``explore_decay`` at every
  round, down to ``explore_min``) goes to clients never tried: like Oort's reference implementation
  (FedScale, ``sample_window`` 5), the ``sample_window`` x n best by data size (``examples``, else all
  equal, ties broken at random) times the same duration penalty, then n of those sampled in proportion to
  that weight (``sample_window=inf``: all never-tried clients compete); the rest are sampled, in proportion to
  score, among clients scoring at least ``cutoff`` times the score just past the k-th. The pacer
  compares the exploited utility of the last ``pacer_window`` rounds with the window before: a change
  within 10% (plateau) relaxes T by ``pacer_step`` percentile points, a 5x jump tightens it. Oort's
  participation blacklist is not implemented.
- ``energy``: Oort whose scores (and exploration weights) are divided by predicted energy and carbon
  relative to the candidates' median, ``(e/median e) ** energy_weight * (c/median c) ** carbon_weight``:
  utility per joule and per gram, since both are to be saved (weights 1 and 1; ``carbon_weight=0`` is
  utility per joule alone). No duration penalty by default (``alpha=0``: time is not what it saves).
  Oort's exploration window matters most here: early rounds are mostly exploration, and sampling every
  never-tried client in proportion to size / cost would let costly devices win many picks by sheer
  number when cheap ones are a minority of the eligible (e.g. before phones' nightly charging windows
  open); within the window the weight is size / cost. Battery aware (EAFL-like): a device on battery
  below ``min_battery`` is never picked (so fewer than k may come back), and one on battery has its
  score multiplied by its battery level.
- ``carbon_budget`` (greedy, after FedZero): every zone has an energy budget (joules) per period of
  ``period_rounds`` rounds; clients are taken in order of utility per predicted joule (utility as
  Oort's, clients never tried count as the best utility) while the zone's planned energy (spent so far in
  the period, reservations included) stays within its budget. The guarantee holds for predicted
  energy; feedback replaces a reservation by the joules actually spent.

Statistical utility follows Oort: ``|B_i| * sqrt(mean loss^2)`` over the client's training samples
(:func:`statistical_utility`); with only a mean loss at hand, it is a lower bound of the RMS.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from fedfusion.devices.energy import WorkCost


def statistical_utility(num_examples: float, rms_loss: float) -> float:
    """Oort's statistical utility ``|B_i| * sqrt(mean loss^2)`` from examples and the RMS training loss."""
    if num_examples < 0 or rms_loss < 0 or not math.isfinite(rms_loss):
        raise ValueError(f"num_examples and rms_loss must be finite and >= 0, got {num_examples}, {rms_loss}")
    return float(num_examples) * float(rms_loss)


def _column(name: str, values: Any, n: int, dtype: Any) -> np.ndarray | None:
    if values is None:
        return None
    arr = np.asarray(values, dtype=dtype)
    if arr.shape != (n,):
        raise ValueError(f"candidates.{name}: expected {n} values, got shape {arr.shape}")
    if arr.dtype.kind == "f" and name != "battery" and (np.any(arr < 0) or not np.all(np.isfinite(arr))):
        raise ValueError(f"candidates.{name}: values must be finite and >= 0")
    return arr


@dataclass
class Candidates:
    """The clients eligible this round, one entry per client (columns are arrays of the same length).

    ``ids``: distinct non-negative client ids (e.g. partition ids). Optional columns: ``duration_s``,
    ``energy_j``, ``co2_g`` (predicted for this round's work), ``battery`` (fraction, NaN = no battery),
    ``plugged`` (on external power), ``zone`` (grid/power zone name), ``examples`` (local data size).
    """

    ids: np.ndarray
    duration_s: np.ndarray | None = None
    energy_j: np.ndarray | None = None
    co2_g: np.ndarray | None = None
    battery: np.ndarray | None = None
    plugged: np.ndarray | None = None
    zone: np.ndarray | None = None
    examples: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.ids = np.asarray(self.ids, dtype=np.int64).reshape(-1)
        n = len(self.ids)
        if n and self.ids.min() < 0:
            raise ValueError("candidates.ids: client ids must be >= 0")
        if n and np.bincount(self.ids).max() > 1:
            raise ValueError("candidates.ids: client ids must be distinct")
        for name in ("duration_s", "energy_j", "co2_g", "battery", "examples"):
            setattr(self, name, _column(name, getattr(self, name), n, float))
        self.plugged = _column("plugged", self.plugged, n, bool)
        self.zone = _column("zone", self.zone, n, str)

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def from_costs(
        cls, ids: Sequence[int] | np.ndarray, groups: Sequence[str], costs: Mapping[str, WorkCost], **columns: Any,
    ) -> Candidates:
        """Candidates whose predicted duration, energy and CO2 come from ``costs[groups[i]]``
        (e.g. one :func:`fedfusion.devices.energy.price_work` per tier); other columns pass through."""
        names, inverse = np.unique(np.asarray(groups, dtype=str), return_inverse=True)
        missing = [str(g) for g in names if g not in costs]
        if missing:
            raise ValueError(f"costs: no WorkCost for group {missing[0]!r}")
        table = np.array([[costs[g].virtual_s, costs[g].wall_j, costs[g].co2_g] for g in names]).reshape(-1, 3)
        return cls(np.asarray(ids), duration_s=table[inverse, 0], energy_j=table[inverse, 1], co2_g=table[inverse, 2], **columns)

    def need(self, name: str, selector: str) -> np.ndarray:
        """A column the selector cannot work without, or a ValueError naming it."""
        col = getattr(self, name)
        if col is None:
            raise ValueError(f"selector {selector!r} needs candidates.{name}")
        return col


@dataclass(frozen=True)
class Outcome:
    """What one picked client did: ``status`` "ok" or anything else (dropped, failed, timeout: wasted);
    ``utility`` its statistical utility, ``duration_s`` virtual seconds, ``energy_j`` and ``co2_g`` spent."""

    client: int
    status: str
    utility: float = 0.0
    duration_s: float = 0.0
    energy_j: float = 0.0
    co2_g: float = 0.0


def _weighted_sample(rng: np.random.Generator, weights: np.ndarray, n: int) -> np.ndarray:
    """Indices of ``n`` items drawn without replacement with probability proportional to ``weights``
    (Efraimidis-Spirakis keys, O(len) time); zero weights are taken last, uniformly."""
    n = min(n, len(weights))
    positive = np.flatnonzero(weights > 0)
    keys = np.log1p(-rng.random(len(positive))) / weights[positive]  # the largest keys win
    take = min(n, len(positive))
    top = np.argpartition(-keys, take - 1)[:take] if 0 < take < len(keys) else np.arange(take)
    picked = positive[top[np.argsort(-keys[top], kind="stable")]]
    if take < n:
        zero = np.setdiff1d(np.arange(len(weights)), positive)
        picked = np.concatenate([picked, rng.permutation(zero)[: n - take]])
    return picked


def _check_k(k: int) -> None:
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 0:
        raise ValueError(f"k: must be an integer >= 0, got {k!r}")


def _check_round(round: int) -> None:
    if not isinstance(round, (int, np.integer)) or isinstance(round, bool) or round < 1:
        raise ValueError(f"round: must be an integer >= 1 (Flower rounds are 1-based), got {round!r}")


class Selector:
    """Base selector: seeded RNG, the select/feedback interface and plain-dict state."""

    name = "base"

    def __init__(self, seed: int = 0) -> None:
        self.seed = int(seed)
        self.rng = np.random.default_rng(self.seed)

    def select(self, candidates: Candidates, k: int, round: int) -> list[int]:
        """Up to ``k`` distinct client ids from ``candidates`` for ``round`` (1-based), sorted ascending."""
        _check_k(k)
        _check_round(round)
        if k == 0 or len(candidates) == 0:
            return []
        picked = self._select(candidates, k, int(round))
        return sorted(int(i) for i in candidates.ids[picked])

    def _select(self, candidates: Candidates, k: int, round: int) -> np.ndarray:
        raise NotImplementedError

    def feedback(self, round: int, outcomes: Sequence[Outcome]) -> None:
        """Record what the clients picked for ``round`` achieved (a no-op for stateless selectors)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue identically, as JSON-able plain data."""
        return {"name": self.name, "seed": self.seed, "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` of a selector of the same kind."""
        if state.get("name") != self.name:
            raise ValueError(f"state: saved by selector {state.get('name')!r}, cannot load into {self.name!r}")
        self.seed = int(state["seed"])
        self.rng.bit_generator.state = state["rng"]


class RandomSelector(Selector):
    """k clients uniformly at random, without replacement."""

    name = "random"

    def _select(self, candidates: Candidates, k: int, round: int) -> np.ndarray:
        n = len(candidates)
        return np.arange(n) if k >= n else self.rng.choice(n, size=k, replace=False)


class _ClientStats:
    """Per-client history indexed by client id, grown on demand: last utility, duration, last round."""

    def __init__(self) -> None:
        self.utility = np.full(0, np.nan)
        self.duration = np.full(0, np.nan)
        self.last_round = np.zeros(0, dtype=np.int64)  # 0 = never picked

    def grow(self, max_id: int) -> None:
        extra = max_id + 1 - len(self.utility)
        if extra > 0:
            self.utility = np.concatenate([self.utility, np.full(extra, np.nan)])
            self.duration = np.concatenate([self.duration, np.full(extra, np.nan)])
            self.last_round = np.concatenate([self.last_round, np.zeros(extra, dtype=np.int64)])

    def record(self, round: int, outcomes: Sequence[Outcome]) -> None:
        if not outcomes:
            return
        self.grow(max(o.client for o in outcomes))
        for o in outcomes:
            values = (o.utility, o.duration_s, o.energy_j, o.co2_g)
            if o.client < 0 or not all(math.isfinite(v) and v >= 0 for v in values):
                raise ValueError(f"outcome of client {o.client}: id and values must be finite and >= 0")
            self.last_round[o.client] = round
            if o.duration_s > 0:
                self.duration[o.client] = o.duration_s
            if o.status == "ok":
                self.utility[o.client] = o.utility

    def scores(self, ids: np.ndarray, round: int, staleness: float, clip_q: float) -> tuple[np.ndarray, np.ndarray]:
        """(explored mask, Oort score without duration penalty) for ``ids``; unexplored score NaN."""
        self.grow(int(ids.max()))
        util = self.utility[ids]
        explored = ~np.isnan(util)
        score = np.full(len(ids), np.nan)
        if explored.any():
            u = util[explored]
            hi = np.quantile(u, clip_q)
            u = np.minimum(u, hi)
            lo = u.min()
            norm = (u - lo) / max(hi - lo, 1e-12)
            bonus = np.sqrt(staleness * math.log(max(round, 1)) / np.maximum(self.last_round[ids][explored], 1))
            score[explored] = norm + bonus
        return explored, score

    def to_dict(self) -> dict[str, list]:
        return {"utility": [None if math.isnan(v) else v for v in self.utility.tolist()],
                "duration": [None if math.isnan(v) else v for v in self.duration.tolist()],
                "last_round": self.last_round.tolist()}

    def load(self, d: Mapping[str, list]) -> None:
        self.utility = np.array([np.nan if v is None else v for v in d["utility"]], dtype=float)
        self.duration = np.array([np.nan if v is None else v for v in d["duration"]], dtype=float)
        self.last_round = np.array(d["last_round"], dtype=np.int64)


class OortSelector(Selector):
    """Oort (OSDI'21): utility x duration penalty, decaying exploration, pacer; see the module docstring."""

    name = "oort"

    def __init__(
        self, seed: int = 0, alpha: float = 2.0, explore: float = 0.9, explore_decay: float = 0.95,
        explore_min: float = 0.2, cutoff: float = 0.95, percentile: float = 30.0, pacer_window: int = 10,
        pacer_step: float = 10.0, staleness: float = 0.1, clip_quantile: float = 0.95, sample_window: float = 5.0,
    ) -> None:
        super().__init__(seed)
        for name, value, lo, hi in (
            ("alpha", alpha, 0, math.inf), ("explore", explore, 0, 1), ("explore_decay", explore_decay, 0, 1),
            ("explore_min", explore_min, 0, 1), ("cutoff", cutoff, 0, 1), ("percentile", percentile, 0, 100),
            ("pacer_window", pacer_window, 1, math.inf), ("pacer_step", pacer_step, 0, 100),
            ("staleness", staleness, 0, math.inf), ("clip_quantile", clip_quantile, 0.5, 1),
            ("sample_window", sample_window, 1, math.inf),
        ):
            if not lo <= value <= hi:
                raise ValueError(f"selection.{name}: must be in [{lo}, {hi}], got {value}")
        self.alpha, self.explore, self.explore_decay, self.explore_min = alpha, explore, explore_decay, explore_min
        self.cutoff, self.percentile = cutoff, percentile
        self.pacer_window, self.pacer_step = int(pacer_window), pacer_step
        self.staleness, self.clip_quantile, self.sample_window = staleness, clip_quantile, sample_window
        self.stats = _ClientStats()
        self.exploited: list[int] = []  # clients picked by exploitation in the last select
        self.history: list[float] = []  # exploited utility per round, for the pacer
        self.last_pacer_round = 0

    # --- hooks the energy selector overrides -------------------------------------------------------
    def _eligible(self, candidates: Candidates) -> np.ndarray:
        return np.ones(len(candidates), dtype=bool)

    def _cost_factor(self, candidates: Candidates) -> np.ndarray:
        """Divisor of scores and exploration weights (1: plain Oort)."""
        return np.ones(len(candidates))

    # -----------------------------------------------------------------------------------------------
    def _pace(self, round: int) -> None:
        w = self.pacer_window
        if len(self.history) < 2 * w or round - self.last_pacer_round < w:
            return
        self.last_pacer_round = round
        before, last = sum(self.history[-2 * w : -w]), sum(self.history[-w:])
        if abs(last - before) <= 0.1 * abs(before):
            self.percentile = min(100.0, self.percentile + self.pacer_step)
        elif abs(last - before) >= 5 * abs(before):
            self.percentile = max(0.0, self.percentile - self.pacer_step)

    def durations(self, candidates: Candidates) -> np.ndarray:
        """Each candidate's duration: last observed, else predicted, else NaN."""
        self.stats.grow(int(candidates.ids.max()))
        dur = self.stats.duration[candidates.ids]
        return dur if candidates.duration_s is None else np.where(np.isnan(dur), candidates.duration_s, dur)

    def _select(self, candidates: Candidates, k: int, round: int) -> np.ndarray:
        self._pace(round)
        self.explore = max(self.explore_min, self.explore * self.explore_decay)
        keep = np.flatnonzero(self._eligible(candidates))
        explored, score = self.stats.scores(candidates.ids, round, self.staleness, self.clip_quantile)
        dur = self.durations(candidates)
        known = dur[~np.isnan(dur)]
        T = float(np.percentile(known, self.percentile)) if len(known) else math.inf  # preferred duration
        with np.errstate(divide="ignore", invalid="ignore"):
            penalty = np.where(dur > T, (T / np.maximum(dur, 1e-9)) ** self.alpha, 1.0)
        cost = self._cost_factor(candidates)
        score = score * penalty / cost
        exp_idx = keep[explored[keep]]
        new_idx = keep[~explored[keep]]
        n_exploit = min(int(k * (1 - self.explore)), len(exp_idx))
        n_explore = min(k - n_exploit, len(new_idx))
        n_exploit = min(k - n_explore, len(exp_idx))
        exploit = np.empty(0, dtype=np.int64)
        if n_exploit:
            s = score[exp_idx]
            if n_exploit < len(s):  # sample among clients above cutoff x the score just past the k-th
                past_kth = -np.partition(-s, n_exploit)[n_exploit]
                pool = exp_idx[s >= self.cutoff * past_kth]
            else:
                pool = exp_idx
            exploit = pool[_weighted_sample(self.rng, np.maximum(score[pool], 0.0) + 1e-12, n_exploit)]
        self.exploited = candidates.ids[exploit].tolist()
        size = np.ones(len(new_idx)) if candidates.examples is None else candidates.examples[new_idx]
        weight = size * penalty[new_idx] / cost[new_idx]
        window = min(len(new_idx), int(self.sample_window * n_explore)) if math.isfinite(self.sample_window) else 0
        if n_explore and 0 < window < len(new_idx):  # Oort samples among the best sample_window x n only
            shuffled = self.rng.permutation(len(new_idx))  # ties broken at random, not by id
            best = shuffled[np.argsort(-weight[shuffled], kind="stable")[:window]]
            new_idx, weight = new_idx[best], weight[best]
        explore = new_idx[_weighted_sample(self.rng, weight, n_explore)]
        return np.concatenate([exploit, explore])

    def feedback(self, round: int, outcomes: Sequence[Outcome]) -> None:
        _check_round(round)
        self.stats.record(round, outcomes)
        exploited = set(self.exploited)
        self.history.append(float(sum(o.utility for o in outcomes if o.status == "ok" and o.client in exploited)))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "explore": self.explore, "percentile": self.percentile,
                "exploited": list(self.exploited), "history": list(self.history),
                "last_pacer_round": self.last_pacer_round, "stats": self.stats.to_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.explore, self.percentile = float(state["explore"]), float(state["percentile"])
        self.exploited, self.history = list(state["exploited"]), list(state["history"])
        self.last_pacer_round = int(state["last_pacer_round"])
        self.stats.load(state["stats"])


class EnergySelector(OortSelector):
    """Oort utility per unit of predicted energy and carbon, battery aware; see the module docstring."""

    name = "energy"

    def __init__(self, seed: int = 0, energy_weight: float = 1.0, carbon_weight: float = 1.0,
                 min_battery: float = 0.2, alpha: float = 0.0, **oort: Any) -> None:
        # alpha defaults to 0 here: Oort's duration penalty buys wall-clock speed with joules, the opposite
        # of this selector's aim (slow, frugal phones would score ~10x lower than fast desktops).
        super().__init__(seed, alpha=alpha, **oort)
        if energy_weight < 0 or carbon_weight < 0:
            raise ValueError(
                f"selection.energy_weight and carbon_weight must be >= 0, got {energy_weight}, {carbon_weight}")
        if not 0 <= min_battery <= 1:
            raise ValueError(f"selection.min_battery: must be in [0, 1], got {min_battery}")
        self.energy_weight, self.carbon_weight, self.min_battery = energy_weight, carbon_weight, min_battery

    def _on_battery(self, candidates: Candidates) -> np.ndarray:
        if candidates.battery is None:
            return np.zeros(len(candidates), dtype=bool)
        plugged = candidates.plugged if candidates.plugged is not None else np.zeros(len(candidates), dtype=bool)
        return ~np.isnan(candidates.battery) & ~plugged

    def _eligible(self, candidates: Candidates) -> np.ndarray:
        if candidates.battery is None:
            return np.ones(len(candidates), dtype=bool)
        return ~(self._on_battery(candidates) & (candidates.battery < self.min_battery))

    def _cost_factor(self, candidates: Candidates) -> np.ndarray:
        e = candidates.need("energy_j", self.name)
        factor = (np.maximum(e, 1e-12) / max(float(np.median(e)), 1e-12)) ** self.energy_weight
        if self.carbon_weight:
            c = candidates.need("co2_g", self.name)
            factor = factor * (np.maximum(c, 1e-12) / max(float(np.median(c)), 1e-12)) ** self.carbon_weight
        on_battery = self._on_battery(candidates)
        if on_battery.any():
            factor = np.where(on_battery, factor / np.maximum(candidates.need("battery", self.name), 1e-3), factor)
        return factor


class CarbonBudgetSelector(Selector):
    """Greedy utility-per-joule picks under per-zone energy budgets (FedZero-like); see the module docstring."""

    name = "carbon_budget"

    def __init__(self, budgets_j: Mapping[str, float] | None = None, seed: int = 0, period_rounds: int = 1,
                 default_budget_j: float | None = None, staleness: float = 0.1, clip_quantile: float = 0.95) -> None:
        super().__init__(seed)
        budgets_j = {} if budgets_j is None else budgets_j
        if not isinstance(budgets_j, Mapping):
            raise ValueError("selection.budgets_j: expected a mapping zone -> joules")
        if not budgets_j and default_budget_j is None:
            raise ValueError("carbon_budget needs budgets_j (zone -> joules per period) or default_budget_j")
        for zone, b in budgets_j.items():
            if not (isinstance(b, (int, float)) and math.isfinite(b) and b >= 0):
                raise ValueError(f"selection.budgets_j.{zone}: must be a finite number >= 0, got {b!r}")
        if default_budget_j is not None and not (math.isfinite(default_budget_j) and default_budget_j >= 0):
            raise ValueError(f"selection.default_budget_j: must be a finite number >= 0, got {default_budget_j}")
        if int(period_rounds) < 1:
            raise ValueError(f"selection.period_rounds: must be >= 1, got {period_rounds}")
        self.budgets_j = {str(z): float(b) for z, b in budgets_j.items()}
        self.default_budget_j = default_budget_j
        self.period_rounds, self.staleness, self.clip_quantile = int(period_rounds), staleness, clip_quantile
        self.stats = _ClientStats()
        self.period = -1
        self.spent_j: dict[str, float] = {}
        self.reserved: dict[int, tuple[str, float]] = {}  # client -> (zone, predicted J) of the last select

    def budget(self, zone: str) -> float:
        """The energy budget of ``zone`` per period (ValueError if it has none and there is no default)."""
        if zone in self.budgets_j:
            return self.budgets_j[zone]
        if self.default_budget_j is None:
            raise ValueError(f"selection.budgets_j: no budget for zone {zone!r} and no default_budget_j")
        return self.default_budget_j

    def remaining_j(self, zone: str) -> float:
        """Joules ``zone`` may still plan in the current period."""
        return self.budget(zone) - self.spent_j.get(zone, 0.0)

    def _roll_period(self, round: int) -> None:
        period = (round - 1) // self.period_rounds
        if period != self.period:
            self.period, self.spent_j = period, {}

    def _select(self, candidates: Candidates, k: int, round: int) -> np.ndarray:
        self._roll_period(round)
        energy = candidates.need("energy_j", self.name)
        zones = candidates.need("zone", self.name)
        explored, score = self.stats.scores(candidates.ids, round, self.staleness, self.clip_quantile)
        utility = np.where(explored, score, np.nanmax(score) if explored.any() else 1.0)
        key = -(utility / np.maximum(energy, 1e-12))
        shuffled = self.rng.permutation(len(candidates))  # breaks ties at random
        m = min(len(candidates), 4 * k)
        while True:  # greedy over the m best by utility per joule; widen m only if that was not enough
            top = shuffled[np.argpartition(key[shuffled], m - 1)[:m]] if m < len(candidates) else shuffled
            chosen = self._greedy(top[np.argsort(key[top], kind="stable")], energy, zones, k)
            if len(chosen) == k or m == len(candidates):
                break
            m = min(len(candidates), 4 * m)
        chosen_arr = np.array(chosen, dtype=np.int64)
        self.reserved = {}
        for i in chosen_arr:
            zone, e = str(zones[i]), float(energy[i])
            self.spent_j[zone] = self.spent_j.get(zone, 0.0) + e
            self.reserved[int(candidates.ids[i])] = (zone, e)
        return chosen_arr

    def _greedy(self, order: np.ndarray, energy: np.ndarray, zones: np.ndarray, k: int) -> list[int]:
        """Walk ``order`` taking each candidate its zone can still afford, until ``k`` are taken."""
        names, zone_of = np.unique(zones[order], return_inverse=True)
        left = np.array([self.remaining_j(str(z)) for z in names])
        energy = energy[order]
        pos = np.flatnonzero(energy <= left[zone_of])
        chosen: list[int] = []
        while len(chosen) < k and len(pos):
            j = pos[0]
            z = zone_of[j]
            if energy[j] <= left[z]:
                chosen.append(int(order[j]))
                left[z] -= energy[j]
                pos = pos[1:]
            else:  # zone z can no longer afford this one: drop every later one of z it cannot afford
                pos = pos[(zone_of[pos] != z) | (energy[pos] <= left[z])]
        return chosen

    def feedback(self, round: int, outcomes: Sequence[Outcome]) -> None:
        _check_round(round)
        self.stats.record(round, outcomes)
        for o in outcomes:
            if o.client in self.reserved:
                zone, planned = self.reserved.pop(o.client)
                self.spent_j[zone] = self.spent_j.get(zone, 0.0) + o.energy_j - planned

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "period": self.period, "spent_j": dict(self.spent_j),
                "reserved": {str(c): list(v) for c, v in self.reserved.items()}, "stats": self.stats.to_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.period, self.spent_j = int(state["period"]), {str(z): float(v) for z, v in state["spent_j"].items()}
        self.reserved = {int(c): (str(v[0]), float(v[1])) for c, v in state["reserved"].items()}
        self.stats.load(state["stats"])


SELECTORS: dict[str, type[Selector]] = {
    "random": RandomSelector, "oort": OortSelector, "energy": EnergySelector, "carbon_budget": CarbonBudgetSelector,
}


def selector_options(name: str) -> list[str]:
    """The keyword options ``make_selector(name, ...)`` accepts (e.g. to pick recipe fields), sorted."""
    if name not in SELECTORS:
        raise ValueError(f"selection.method: unknown selector {name!r}; choose one of {', '.join(SELECTORS)}")
    options: set[str] = set()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    for klass in SELECTORS[name].__mro__[:-1]:  # up to Selector; object takes nothing
        if "__init__" in vars(klass):
            params = inspect.signature(vars(klass)["__init__"]).parameters.values()
            options |= {p.name for p in params if p.kind in named and p.name != "self"}
    return sorted(options)


def make_selector(name: str, **kwargs: Any) -> Selector:
    """The selector called ``name`` built with ``kwargs``; a ValueError names an unknown selector or option."""
    options = selector_options(name)
    bad = sorted(set(kwargs) - set(options))
    if bad:
        raise ValueError(f"selector {name!r} has no option {bad[0]!r}; its options: {', '.join(options)}")
    return SELECTORS[name](**kwargs)
