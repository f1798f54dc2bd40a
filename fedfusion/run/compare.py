"""``fedfusion compare``: a recipe against its smallest-only and oracle arms, at the same budget and seeds.

Does small-to-large pay on this data? Each (arm, seed) (:mod:`fedfusion.run.arms`) is an ordinary ``fedfusion run``
(Flower's simulation engine, a process of its own) in ``DIR/<arm>-s<seed>/``; the comparison is written to
``DIR/compare.json``, ``DIR/compare.md`` and ``DIR/compare.png``.

- **Up front**: the recipe and every arm are loaded and checked (a bad key or file is one error line, nothing
  written), and :func:`fedfusion.run.arms.check_equal_budget` asserts that the arms share the recipe's budget.
- **Resume**: a run directory whose ``summary.json`` says ``ok`` is not run again (its ``recipe.yaml`` must be the
  arm's, else an error names the key); one that stopped part way resumes from its checkpoint
  (``fedfusion run --resume``), or starts again where it has none. Ctrl-C stops the run in progress at a safe point
  (``fedfusion run``'s own handling) and leaves every finished run as it is; the same command continues.
- **Report**: the headline metric (a facts recipe's probe accuracy, higher is better; otherwise the held-out loss,
  lower is better), per seed and arm: the final value (the last scored round's, what the run ends with; the mean of
  the last 3 scored rounds beside it), the span (oracle minus smallest-only, signed so that positive means the
  oracle is better), the gap closure ((recipe - smallest-only) / span, same orientation) and whether each curve is
  still rising (:func:`rising`). A span within the round-to-round noise (:func:`noise`) gets no closure: the md says so.
  A facts recipe's runs add a table by the device tier of the client holding each fact (:func:`tier_table`): each
  arm's final recall and answer loss on that tier's facts and the recipe's closure on answer loss, so the report
  shows whether the weakest devices' knowledge reaches the target.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fedfusion.analysis.report import ALL_TIERS, forgetting, forgetting_text, holder_scores, still_rising
from fedfusion.config.recipe import METHOD_SECTIONS, Recipe, load_recipe, uses
from fedfusion.config.sections import EngineConfig, RecipeError
from fedfusion.data.tier_keys import grouped
from fedfusion.run.arms import ARM_NAMES, ORACLE, RECIPE, SMALLEST, Arm, arms_for, check_equal_budget, flat
from fedfusion.run.check import check_recipe
from fedfusion.run.signals import EXIT_INTERRUPTED, Terminated

FINAL = ("final: the last scored round's value (what the run ends with, as every report of the project quotes it); "
         "last-3: the mean of the last 3 scored rounds after round 0")


@dataclass(frozen=True)
class Metric:
    """The headline metric of a comparison: its metrics-row key, what it measures, its direction."""

    key: str
    label: str
    lower_is_better: bool

    def gain(self, value: float) -> float:
        """``value`` oriented so that larger is better."""
        return -value if self.lower_is_better else value


def headline(recipe: Recipe) -> Metric:
    """A facts recipe's probe accuracy (what the target recalls); otherwise the held-out loss, in nats."""
    if recipe.data.source == "facts":
        return Metric("probe_acc", "probe accuracy (share of all probes the target answers exactly)", False)
    return Metric("eval_loss", "held-out loss (nats)", True)


@dataclass
class Comparison:
    """What ``fedfusion compare`` runs: the recipe reference and overrides, seeds, arms, their resolved recipes."""

    ref: str
    overrides: list[str]
    seeds: list[int]
    out: Path
    arms: dict[str, Arm]
    recipes: dict[tuple[str, int], Recipe]
    metric: Metric
    command: str = ""
    base: Recipe | None = field(default=None, repr=False)
    engine: dict[str, list[str]] = field(default_factory=dict)  # arm -> its own engine.* overrides (not budget)

    def run_dir(self, arm: str, seed: int) -> Path:
        return self.out / f"{arm}-s{seed}"

    def run_args(self, arm: str, seed: int) -> list[str]:
        """The ``fedfusion run`` arguments of one (arm, seed)."""
        return ["run", self.ref, *self.overrides, *self.arms[arm].overrides, *self.engine.get(arm, []), f"seed={seed}",
                "--out", str(self.run_dir(arm, seed))]


def resolve(ref: str, overrides: list[str]) -> Recipe:
    """The recipe a run of ``ref`` with ``overrides`` resolves to before it writes anything (as ``fedfusion run``
    loads it: validated, checked, rounds from facts, ``fusion.auto_widths`` fitted)."""
    recipe = check_recipe(load_recipe(ref, overrides))
    if recipe.fusion.auto_widths:
        from fedfusion.fusion.submodel.plan import fit_widths

        fit_widths(recipe.fusion, recipe.train, recipe.population, recipe.model, recipe.data_source())
    return recipe


def engine_overrides(specs: list[str], names: list[str] | tuple[str, ...]) -> dict[str, list[str]]:
    """``ARM:KEY=VALUE`` specs (``--engine``) as each arm's ``engine.KEY=VALUE`` overrides; ValueError naming a spec
    whose arm is not run or whose key is not an ``engine`` setting. How the simulation schedules an arm's clients
    (for instance fewer at once, where the oracle's whole-model clients would not fit in memory together) is not
    its budget: the clients do the same work."""
    known = {f.name for f in fields(EngineConfig)}
    out: dict[str, list[str]] = {}
    for spec in specs:
        arm, _, setting = spec.partition(":")
        key = setting.partition("=")[0].strip().removeprefix("engine.")
        if arm not in names or "=" not in setting or key not in known:
            raise ValueError(f"--engine {spec!r}: give ARM:KEY=VALUE with ARM one of {', '.join(names)} and KEY one "
                             f"of engine's {', '.join(sorted(known))}")
        out.setdefault(arm, []).append(f"engine.{key}={setting.partition('=')[2]}")
    return out


def plan(ref: str, overrides: list[str], seeds: list[int], out: Path | None, names: list[str] | tuple[str, ...] = ARM_NAMES,
         command: str = "", engine: list[str] | tuple[str, ...] = ()) -> Comparison:
    """Load and check the recipe and every (arm, seed) before anything runs; raises RecipeError (one line) on a bad
    recipe or arm, :class:`fedfusion.run.arms.UnequalBudget` where an arm leaves the budget. ``engine``: ``--engine``
    specs (:func:`engine_overrides`), applied after the budget check."""
    if any(o.split("=", 1)[0].strip() == "seed" for o in overrides):
        raise RecipeError("seed: compare runs every arm at each of --seeds; give them there, not as an override")
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: give distinct seeds, got {seeds}")
    unknown = [n for n in names if n not in ARM_NAMES]
    if unknown or not names:
        raise ValueError(f"--arms: choose from {', '.join(ARM_NAMES)}, got {' '.join(names) or 'none'}")
    scheduling = engine_overrides(list(engine), names)
    base = resolve(ref, list(overrides))
    if base.data.source == "dataset":  # load and partition it now: a missing column or a bad count stops here
        from fedfusion.data.population import partition_sizes

        partition_sizes(base.data_source(), base.fusion.method)
    arms = arms_for(base)
    recipes: dict[tuple[str, int], Recipe] = {}
    for seed in seeds:
        for name in ARM_NAMES:  # the recipe arm too: the others are checked against it
            try:
                recipes[name, seed] = resolve(ref, [*overrides, *arms[name].overrides, f"seed={seed}"])
            except RecipeError as exc:
                raise RecipeError(f"the {name} arm ({' '.join(arms[name].overrides)}): {exc}") from None
        check_equal_budget(recipes[RECIPE, seed], {n: recipes[n, seed] for n in ARM_NAMES if n != RECIPE}, arms)
        for name, extra in scheduling.items():  # the recipe each such run writes, checked as it will load
            try:
                recipes[name, seed] = resolve(ref, [*overrides, *arms[name].overrides, *extra, f"seed={seed}"])
            except RecipeError as exc:
                raise RecipeError(f"--engine for the {name} arm ({' '.join(extra)}): {exc}") from None
    chosen = [n for n in ARM_NAMES if n in names]
    return Comparison(ref, list(overrides), list(seeds), out or Path(base.output.dir) / f"compare-{base.name}",
                      {n: arms[n] for n in chosen}, {k: v for k, v in recipes.items() if k[0] in chosen},
                      headline(base), command, base, scheduling)


# -- running ------------------------------------------------------------------------------------------------------
Runner = Callable[[list[str], Path, Callable[[str], None]], tuple[int, bool]]


def state(run: Path, recipe: Recipe) -> str:
    """``done`` (finished), ``resume`` (stopped after a checkpoint), ``fresh`` (nothing, or nothing to resume from).
    Raises where ``run`` holds something else: not a run directory, or a run of another recipe (the sections of methods
    no tier of ``recipe`` trains with, the units mode's and the fusion keys its method ignores are not compared: the
    run never read them)."""
    if not run.exists() or not any(run.iterdir()):
        return "fresh"
    if not (run / "recipe.yaml").is_file():
        raise FileExistsError(f"{run} exists and is not a run directory (no recipe.yaml); remove it or choose another --out")
    # what the run never reads: the sections of methods no tier trains with, and units.* (compare refuses the units
    # mode, so no run it makes reads that section)
    unused = (*(f"{name}." for name in METHOD_SECTIONS if not uses(recipe, name)), "units.")
    ignored = {f"fusion.{key}" for key in recipe.fusion.unread()}
    differs = _differences(*({k: v for k, v in flat(r).items() if not k.startswith(unused) and k not in ignored}
                             for r in (load_recipe(run / "recipe.yaml"), recipe)))
    if differs:
        raise FileExistsError(f"{run} holds a run of another recipe ({'; '.join(differs[:3])}); remove it or choose "
                              "another --out")
    summary = _summary(run)
    if summary.get("status") == "ok":
        return "done"
    return "resume" if any((run / d / "state.json").is_file() for d in ("checkpoint", "checkpoint.old")) else "fresh"


def _differences(theirs: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    return [f"{k}: {theirs.get(k, '<absent>')!r} there, {mine.get(k, '<absent>')!r} here"
            for k in sorted(set(theirs) | set(mine)) if theirs.get(k) != mine.get(k)]


def _summary(run: Path) -> dict[str, Any]:
    path = run / "summary.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        return {}


def cli_runner(args: list[str], log: Path, echo: Callable[[str], None]) -> tuple[int, bool]:
    """``python -m fedfusion.cli ARGS`` (``fedfusion run``, this interpreter's package), its output echoed (indented)
    and kept in ``log``; returns (exit code, whether this process got Ctrl-C or SIGTERM meanwhile). The child is in this
    process's group, so a terminal's Ctrl-C reaches it as it reaches a ``fedfusion run`` started by hand (one stops
    the run at a safe point, two force it); a SIGINT sent to this process alone is passed on after 20 s, a SIGTERM
    (:class:`Terminated`) at once (a run takes a second SIGTERM, had the group got one too, as the first)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "fedfusion.cli", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                fh.write(line)
                fh.flush()
                echo("    " + line.rstrip("\n"))

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        interrupted, passed_on, since = False, False, 0.0
        while True:
            try:
                proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if interrupted and not passed_on and time.monotonic() - since > 20:
                    proc.send_signal(signal.SIGINT)
                    passed_on = True
            except Terminated:
                if not passed_on:
                    proc.send_signal(signal.SIGTERM)  # the run stops at its next safe point, as on Ctrl-C
                interrupted, passed_on = True, True
            except KeyboardInterrupt:
                if not interrupted:
                    interrupted, since = True, time.monotonic()
        reader.join(timeout=10)
    return proc.returncode, interrupted


def execute(comparison: Comparison, echo: Callable[[str], None] = print, runner: Runner = cli_runner) -> int:
    """Every (arm, seed) not finished yet, seed by seed, then the report. 0: done; 130: interrupted (finished runs
    stay, the same command continues); 1: a run failed (its log and summary.json say why)."""
    c = comparison
    c.out.mkdir(parents=True, exist_ok=True)
    jobs = [(arm, seed) for seed in c.seeds for arm in c.arms]
    for i, (arm, seed) in enumerate(jobs, 1):
        run, recipe = c.run_dir(arm, seed), c.recipes[arm, seed]
        what = state(run, recipe)
        head = f"[{i}/{len(jobs)}] {arm} seed {seed}"
        if what == "done":
            echo(f"{head}: finished before, kept ({run})")
            continue
        if what == "fresh" and run.exists():
            shutil.rmtree(run)  # stopped before its first checkpoint: nothing to resume from
        args = ["run", "--resume", str(run)] if what == "resume" else c.run_args(arm, seed)
        echo(f"{head}: {'resuming' if what == 'resume' else 'running'}: fedfusion {shlex.join(args)}")
        started = time.monotonic()
        code, interrupted = runner(args, c.out / "logs" / f"{arm}-s{seed}.log", echo)
        if interrupted or code == EXIT_INTERRUPTED:
            echo(f"interrupted: finished runs are kept in {c.out}; run the same command again to continue")
            return EXIT_INTERRUPTED
        if code != 0 or _summary(run).get("status") != "ok":
            echo(f"{head} failed (exit {code}): see {c.out / 'logs' / f'{arm}-s{seed}.log'} and {run / 'summary.json'}")
            return 1
        finals = collect_run(run, c.arms[arm], c.metric)
        echo(f"{head}: done in {time.monotonic() - started:.0f} s, final {c.metric.key} {finals['final']:.4f}"
             + (f"; WARNING: {finals['failed']} client rounds failed, so it did less work than its budget"
                if finals["failed"] else ""))
    paths = write_report(c)
    echo("wrote " + ", ".join(str(p) for p in paths))
    return 0


# -- statistics ---------------------------------------------------------------------------------------------------
def _window(n: int) -> int:
    """How many steps back the tail checks look: a fifth of the evaluations, at least 3 (as the run report's)."""
    return max(3, (n - 1) // 5)


def _fit(ys: list[float]) -> tuple[float, float, float]:
    """Least squares of ``ys`` against 0..m-1: (slope, residual sd with m - 2 degrees of freedom, sum of squares
    of x around its mean)."""
    m = len(ys)
    mx, my = (m - 1) / 2, sum(ys) / m
    sxx = sum((x - mx) ** 2 for x in range(m))
    slope = sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sxx
    resid = [y - (my + slope * (x - mx)) for x, y in enumerate(ys)]
    return slope, math.sqrt(sum(r * r for r in resid) / (m - 2)), sxx


def noise(values: list[float]) -> float | None:
    """Round-to-round noise of a curve: the sd of its last k + 1 scored values around their least-squares line
    (k: :func:`_window`); None with fewer than 4 scored values (nothing to measure it on)."""
    k = _window(len(values))
    if len(values) < k + 1:
        return None
    return _fit(values[-(k + 1):])[1]


def rising(values: list[float], lower_is_better: bool) -> dict[str, Any] | None:
    """Whether a curve still rises (improves) at its end. Over its last k scored steps (:func:`_window`) the gain is
    the least-squares slope times k, oriented so that improving is positive; it is **rising** where the gain is at
    least 0.01 and 5 % of the curve's whole improvement (the run report's check, :func:`still_rising`) and more than
    twice its own standard error (so the round-to-round noise does not make it). None with fewer than 4 values."""
    curve = [-v for v in values] if lower_is_better else list(values)
    k = _window(len(curve))
    if len(curve) < k + 1:
        return None
    slope, sd, sxx = _fit(curve[-(k + 1):])
    gain, se = slope * k, k * sd / math.sqrt(sxx)
    return {"k": k, "gain": gain, "se": se, "rising": still_rising(curve) is not None and gain > 2 * se}


def collect_run(run: Path, arm: Arm, metric: Metric) -> dict[str, Any]:
    """One finished run's curve of the arm's headline metric and its finals."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    key = arm.key(metric.key)
    curve = [(r["round"], float(r[key])) for r in rows if r.get(key) is not None]
    if not curve:
        raise ValueError(f"{run}: no round has {key} (the {arm.name} arm's score)")
    values = [v for _, v in curve]
    summary = _summary(run)
    ppl = arm.key("eval_ppl") if metric.key == "eval_loss" else None
    last_ppl = next((r[ppl] for r in reversed(rows) if ppl and r.get(ppl) is not None), None)
    trained = [v for r, v in curve if r > 0] or values  # round 0 is the untrained target: never in the last 3
    return {"dir": str(run), "key": key, "curve": curve, "final": values[-1], "last3": statistics.mean(trained[-3:]),
            "final_ppl": last_ppl, "noise": noise(values), "rising": rising(values, metric.lower_is_better),
            "wall_s": summary.get("wall_s"), "machine": summary.get("versions", {}).get("machine"),
            "failed": failed_client_rounds(run), "general_loss": forgetting(rows),
            "by_tier": by_tier(rows, summary) if not arm.score else {}}


def by_tier(rows: list[dict[str, Any]], summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A facts run's :func:`~fedfusion.analysis.report.holder_scores` with each tier's probe count and the
    round-to-round noise of its answer-loss curve (:func:`noise`): empty for a run that does not score the facts by
    tier."""
    facts = summary.get("facts", {})
    counts = {**facts.get("probes_by_tier", {}), ALL_TIERS: facts.get("probes")}
    scored = [r for r in rows if r.get("probe_acc") is not None]
    out = {}
    for tier, v in holder_scores(rows).items():
        curve = [r.get("answer_loss") if tier == ALL_TIERS else grouped(r, "answer_loss").get(tier) for r in scored]
        out[tier] = {**v, "probes": counts.get(tier), "noise": noise([float(x) for x in curve if x is not None])}
    return out


def tier_closure(arms: tuple[dict[str, Any], dict[str, Any], dict[str, Any]]) -> str:
    """The recipe's closure on one tier's answer loss, (smallest-only - recipe) / (smallest-only - oracle), from the
    (recipe, smallest-only, oracle) scores: given only where the oracle's loss is lower by more than the noise (the
    three curves' pooled :func:`noise`, the headline's rule)."""
    recipe, smallest, oracle = (a.get("answer_loss") for a in arms)
    if recipe is None or smallest is None or oracle is None:
        return "-"
    threshold = span_threshold(pooled_noise([a.get("noise") for a in arms]))
    if smallest - oracle <= (threshold or 0.0):
        return "span within noise" if smallest > oracle else "no gap (the oracle is not better)"
    return _fmt((smallest - recipe) / (smallest - oracle), 2)


def failed_client_rounds(run: Path) -> int:
    """How many client rounds of ``run`` failed (a dropout, a deadline missed, a worker the host killed): a run with
    any did less work than its budget, which the report says beside its numbers."""
    path = run / "clients.jsonl"
    if not path.is_file():
        return 0
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sum(1 for r in rows if r.get("status") != "ok")


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def pooled_noise(noises: list[float | None]) -> float | None:
    """The arms' round-to-round noise pooled (root mean square of those measured); None if none is."""
    measured = [x for x in noises if x is not None]
    return math.sqrt(statistics.mean(x * x for x in measured)) if measured else None


def span_threshold(sigma: float | None) -> float | None:
    """The span a difference of two finals must pass to be beyond ``sigma`` noise: two standard deviations of a
    difference of two noisy values, 2 x sqrt(2) x sigma (:data:`NOISE`)."""
    return 2 * math.sqrt(2) * sigma if sigma is not None else None


def analyse(runs: dict[str, dict[int, dict[str, Any]]], metric: Metric) -> dict[str, Any]:
    """Per seed and over seeds: the span (oracle - smallest-only, positive: the oracle is better), the recipe's
    difference from smallest-only (same orientation) and the gap closure (their ratio), with the noise that decides
    whether the span is measured at all. ``runs``: arm -> seed -> :func:`collect_run`."""
    g = metric.gain
    seeds = sorted(set.intersection(*(set(runs.get(a, {})) for a in ARM_NAMES)) if all(a in runs for a in ARM_NAMES)
                   else set())
    small_seeds = sorted(set(runs.get(RECIPE, {})) & set(runs.get(SMALLEST, {})))
    per_seed: dict[int, dict[str, Any]] = {}
    for s in small_seeds:
        r, sm = runs[RECIPE][s], runs[SMALLEST][s]
        per_seed[s] = {"recipe_minus_smallest": g(r["final"]) - g(sm["final"])}
    for s in seeds:
        r, sm, o = runs[RECIPE][s], runs[SMALLEST][s], runs[ORACLE][s]
        sigma = pooled_noise([x["noise"] for x in (r, sm, o)])
        span = g(o["final"]) - g(sm["final"])
        threshold = span_threshold(sigma)
        resolved = None if threshold is None else abs(span) > threshold
        # a gap to close: the oracle better than smallest-only, beyond the noise (or the noise not measurable)
        closure = per_seed[s]["recipe_minus_smallest"] / span if span > 0 and resolved is not False else None
        per_seed[s].update(span=span, noise=sigma, threshold=threshold, resolved=resolved, closure=closure)
    out: dict[str, Any] = {"per_seed": per_seed, "seeds_with_every_arm": seeds}
    if small_seeds:
        out["recipe_minus_smallest"] = _mean_sd([per_seed[s]["recipe_minus_smallest"] for s in small_seeds])
        out["recipe_better_in"] = sum(per_seed[s]["recipe_minus_smallest"] > 0 for s in small_seeds)
    if seeds:
        spans = [per_seed[s]["span"] for s in seeds]
        out["span"] = _mean_sd(spans)
        # measured: every seed's span beyond its noise (or the noise unmeasurable), all of one sign
        beyond = all(per_seed[s]["resolved"] is not False for s in seeds)
        out["span_resolved"] = beyond and (all(x > 0 for x in spans) or all(x < 0 for x in spans))
        out["noise_measured"] = all(per_seed[s]["noise"] is not None for s in seeds)
        if out["span_resolved"] and out["span"][0] > 0:
            out["closure"] = _mean_sd([per_seed[s]["closure"] for s in seeds])
    return out


# -- the report ---------------------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    """Where the comparison ran (each run's own summary.json records its versions too)."""
    try:
        load = round(os.getloadavg()[0], 2)
    except OSError:
        load = None
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "load_1min_at_report": load}


def write_report(c: Comparison) -> list[Path]:
    """``compare.json``, ``compare.md`` and ``compare.png`` from every finished run of the comparison."""
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for arm in c.arms:
        for seed in c.seeds:
            run = c.run_dir(arm, seed)
            if _summary(run).get("status") == "ok":
                runs.setdefault(arm, {})[seed] = collect_run(run, c.arms[arm], c.metric)
    label = c.metric.label
    first = next((r for arm in runs.values() for r in arm.values()), None)
    if first is not None and c.metric.key == "eval_loss":
        names = _summary(Path(first["dir"])).get("metric_names") or {}
        label = names.get("eval_loss", label)
    stats = analyse(runs, c.metric)
    base = c.base or c.recipes[next(iter(c.recipes))]
    data = {
        "command": c.command, "machine": machine(), "recipe": c.ref, "overrides": c.overrides, "seeds": c.seeds,
        "metric": {"key": c.metric.key, "label": label, "lower_is_better": c.metric.lower_is_better},
        "definitions": {"final": FINAL, "span": SPAN, "closure": CLOSURE, "noise": NOISE, "rising": RISING},
        "budget": budget(base),
        "arms": {name: {"overrides": list(arm.overrides), "about": arm.about, "score": arm.score or "target",
                        "runs": {str(s): r for s, r in runs.get(name, {}).items()}} for name, arm in c.arms.items()},
        "analysis": {**stats, "per_seed": {str(s): v for s, v in stats["per_seed"].items()}},
    }
    c.out.mkdir(parents=True, exist_ok=True)
    (c.out / "compare.json").write_text(json.dumps(data, indent=1) + "\n")
    plot = plot_curves(c, runs, label)
    (c.out / "compare.md").write_text(markdown(c, runs, stats, data, label, plot))
    return [c.out / "compare.md", c.out / "compare.json", *([plot] if plot else [])]


SPAN = ("span = oracle - smallest-only on the final values, signed so that positive means the oracle is better "
        "(for a lower-is-better metric: smallest-only's loss minus the oracle's)")
CLOSURE = ("gap closure = (recipe - smallest-only) / span, the same orientation: 0 is smallest-only, 1 the oracle; "
           "given only where the span is beyond the noise")
NOISE = ("noise = round-to-round sd of a curve: its last k + 1 scored values (k a fifth of the evaluations, at least 3) "
         "around their least-squares line, pooled over the seed's three arms; a span is within noise where "
         "|span| <= 2 x sqrt(2) x noise (two standard deviations of a difference of two noisy finals)")
RISING = ("still rising = over the last k scored steps the least-squares gain (slope x k, improving positive) is at "
          "least 0.01 and 5 % of the curve's whole improvement (the run report's check) and more than twice its "
          "standard error")


def budget(recipe: Recipe) -> dict[str, Any]:
    """The budget every arm shares, as the md states it."""
    t = recipe.train
    data = recipe.data.path or recipe.data.dataset or recipe.data.source
    return {"rounds": recipe.rounds, "clients_per_round": recipe.selection.clients_per_round,
            "num_clients": recipe.population.num_clients, "local_steps": t.local_steps, "optimizer": t.optimizer,
            "lr": t.lr, "lr_schedule": t.lr_schedule, "max_epochs": t.max_epochs, "batch_size": t.batch_size,
            "seq_len": t.seq_len, "data": data, "probes": recipe.data.probes, "mix": dict(recipe.population.mix)}


def _fmt(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _signed(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:+.{digits}f}"


def _rising_cell(r: dict[str, Any]) -> str:
    check = r["rising"]
    if check is None:
        return "n/a (< 4 scored rounds)"
    return f"{'yes' if check['rising'] else 'no'} ({check['gain']:+.4f} ± {check['se']:.4f} over {check['k']})"


def markdown(c: Comparison, runs: dict[str, dict[int, dict[str, Any]]], stats: dict[str, Any], data: dict[str, Any],
             label: str, plot: Path | None) -> str:
    b, m = data["budget"], c.metric
    better = "lower" if m.lower_is_better else "higher"
    mach = data["machine"]
    run_machines = sorted({r["machine"] for arm in runs.values() for r in arm.values() if r.get("machine")})
    lines = [f"# Small-to-large on `{c.ref}`: the recipe against smallest-only and the oracle", "",
             f"Command: `{c.command or 'fedfusion compare ' + c.ref}`", "",
             f"Machine: {mach['platform']}, {mach['cpus']} CPUs, Python {mach['python']}"
             + (f" (the runs: {', '.join(run_machines)})" if run_machines else "")
             + f"; 1-minute load when this report was written: {mach['load_1min_at_report']}.", "",
             f"Budget, the same for every arm: {b['rounds']} rounds, {b['clients_per_round']} of {b['num_clients']} clients "
             f"per round ({', '.join(f'{t} {v:g}' for t, v in b['mix'].items())}), {b['local_steps']} local steps "
             f"({b['optimizer']}, lr {b['lr']:g}, {b['lr_schedule']}, batch {b['batch_size']} x {b['seq_len']}"
             + (f", at most {b['max_epochs']:g} passes a round" if b["max_epochs"] else "")
             + f"), data {b['data']}" + (f" with probes {b['probes']}" if b["probes"] else "")
             + f"; seeds {', '.join(map(str, c.seeds))}. Each (arm, seed) is `fedfusion run` in `{c.out}/<arm>-s<seed>/`; "
             "the arms' resolved recipes were checked to differ only in the keys their overrides name, none of them "
             "a budget key.", "",
             "| arm | every client trains | overrides |", "|---|---|---|"]
    for name, arm in c.arms.items():
        lines.append(f"| {name} | {arm.about} | `{' '.join(arm.overrides) or '(none)'}` |")
    lines += ["", f"Metric: **{label}**, {better} is better"
              + (" (smallest-only: its family model's, `" + c.arms[SMALLEST].key(m.key) + "`)"
                 if SMALLEST in c.arms and c.arms[SMALLEST].score else "") + ". " + FINAL + ".", ""]
    ppl = m.key == "eval_loss"
    general = any(r.get("general_loss") for arm in runs.values() for r in arm.values())
    head = ("| arm | seed | final | last-3 |" + (" final ppl |" if ppl else "")
            + (" general-text loss: round 0 -> final (forgetting) |" if general else "")
            + " still rising | wall s | failed client rounds |")
    optional = "| " * (ppl + general)  # the blank optional cells of a row without per-run values
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for name in c.arms:
        for seed in c.seeds:
            r = runs.get(name, {}).get(seed)
            if r is None:
                lines.append(f"| {name} | {seed} | not run | | {optional}| | |")
                continue
            lines.append(f"| {name} | {seed} | {_fmt(r['final'])} | {_fmt(r['last3'])} |"
                         + (f" {_fmt(r['final_ppl'], 3)} |" if ppl else "")
                         + (f" {forgetting_text(r['general_loss']) if r['general_loss'] else '-'} |" if general else "")
                         + f" {_rising_cell(r)} | {_fmt(r['wall_s'], 0)} | {r['failed']} |")
        finals = [r["final"] for r in runs.get(name, {}).values()]
        if len(finals) > 1:
            mean, sd = _mean_sd(finals)
            lines.append(f"| {name} | mean ± std | {mean:.4f} ± {sd:.4f} | | {optional}| | |")
    lines += ["", *verdict(c, runs, stats), ""]
    if stats["per_seed"]:
        lines += ["| seed | recipe - smallest-only | span | noise | gap closure |", "|---|---|---|---|---|"]
        for s, v in sorted(stats["per_seed"].items()):
            closure = ("-" if "span" not in v else "span within noise" if v["resolved"] is False
                       else "no gap (the oracle is not better)" if v["span"] <= 0
                       else _fmt(v["closure"], 2) + (" (noise not measured)" if v["resolved"] is None else ""))
            lines.append(f"| {s} | {_signed(v['recipe_minus_smallest'])} | {_signed(v.get('span'))} | "
                         f"{_fmt(v.get('noise'))} | {closure} |")
        lines.append("")
    lines += tier_table(c, runs)
    lines += ["Definitions:", "", f"- {SPAN}; recipe - smallest-only in the same orientation (positive: the recipe is "
              "better).", f"- {CLOSURE}.", f"- {NOISE}.", f"- {RISING}.", ""]
    if plot is not None:
        lines += [f"![curves]({plot.name})", ""]
    lines += ["Runs: " + "; ".join(f"`{r['dir']}`" for arm in runs.values() for r in arm.values()), ""]
    return "\n".join(lines)


def tier_table(c: Comparison, runs: dict[str, dict[int, dict[str, Any]]]) -> list[str]:
    """The facts by the device tier of the client holding them, per seed with all three arms' tiers scored: each arm's
    final recall and answer loss, and the recipe's closure on answer loss (finer than recall's, which moves in
    whole probes): whether what the weakest devices hold reaches the target."""
    seeds = [s for s in c.seeds if all(runs.get(a, {}).get(s, {}).get("by_tier") for a in ARM_NAMES)]
    if not seeds:
        return []
    lines = ["Facts by the device tier of the client holding them (the recipe's population), final round: recall and "
             "answer loss (nats/token) of recipe / smallest-only / oracle, and the recipe's answer-loss closure "
             "(smallest-only - recipe) / (smallest-only - oracle) (0: smallest-only, 1: the oracle), given where the "
             "oracle's loss is lower by more than the noise (the headline's rule, on each tier's answer-loss curves). "
             f"`{ALL_TIERS}`: every tier's facts.", "",
             "| seed | tier | probes | recall | answer loss | answer-loss closure |", "|---|---|---|---|---|---|"]
    for s in seeds:
        r, sm, o = (runs[a][s]["by_tier"] for a in (RECIPE, SMALLEST, ORACLE))
        for tier in [t for t in r if t != ALL_TIERS] + [ALL_TIERS]:
            arms = (r.get(tier, {}), sm.get(tier, {}), o.get(tier, {}))
            recall = " / ".join(_fmt(x.get("probe_acc")) for x in arms)
            loss = " / ".join(_fmt(x.get("answer_loss"), 3) for x in arms)
            lines.append(f"| {s} | {tier} | {arms[0].get('probes') or '-'} | {recall} | {loss} | {tier_closure(arms)} |")
    return [*lines, ""]


def verdict(c: Comparison, runs: dict[str, dict[int, dict[str, Any]]], stats: dict[str, Any]) -> list[str]:
    """What the numbers say, in sentences: the span, the closure or why there is none, the recipe against
    smallest-only, and the curves still rising."""
    out: list[str] = []
    n = len(stats.get("seeds_with_every_arm", []))
    if "span" in stats:
        mean, sd = stats["span"]
        spread = f" ± {sd:.4f}" if n > 1 else ""
        checked = ("beyond the noise" if stats["noise_measured"] else
                   "not checked against the noise in every seed: fewer than 4 scored rounds leave it unmeasured")
        if not stats["span_resolved"]:
            out.append(f"**The span is within noise** ({mean:+.4f}{spread} over {n} seed(s); see the per-seed noise): "
                       "the oracle and smallest-only are not told apart at this budget, so a gap closure would be "
                       "meaningless and none is given.")
        elif mean < 0:
            out.append(f"**The whole target does not beat the small model at this budget**: the oracle is worse than "
                       f"smallest-only by {-mean:.4f}{spread} in every seed ({checked}), so there is no gap for the "
                       "recipe to close (a longer budget, or a task the small model cannot hold, comes first).")
        else:
            cm, csd = stats["closure"]
            out.append(f"**Span {mean:.4f}{spread}** (the oracle better than smallest-only in every seed; {checked}); "
                       f"the recipe closes **{cm:.2f}{f' ± {csd:.2f}' if n > 1 else ''}** of that gap"
                       + (" (above 1: it ends better than the oracle)." if cm > 1 else "."))
    elif SMALLEST in c.arms and ORACLE in c.arms:
        out.append("No seed has all three arms finished: no span or closure yet.")
    if "recipe_minus_smallest" in stats:
        mean, sd = stats["recipe_minus_smallest"]
        k = len([s for s in stats["per_seed"]])
        out.append(f"Recipe - smallest-only: {mean:+.4f}{f' ± {sd:.4f}' if k > 1 else ''} (positive: the recipe is "
                   f"better); the recipe is better in {stats['recipe_better_in']} of {k} seed(s).")
    short = [f"{name} (seed {s}: {r['failed']})" for name, arm in runs.items() for s, r in sorted(arm.items())
             if r["failed"]]
    if short:
        out.append(f"**Not at equal budget**: client rounds failed in {', '.join(short)}; those runs did less work "
                   "than the others (see each run's clients.jsonl), so no number here that rests on them is a fair "
                   "comparison: run them again (remove the run directory).")
    still = [f"{name} (seed {s})" for name, arm in runs.items() for s, r in sorted(arm.items())
             if r["rising"] is not None and r["rising"]["rising"]]
    if still:
        out.append(f"Still rising at the end: {', '.join(still)}: the budget (`rounds`) cuts these curves short, so "
                   "their finals understate where they go.")
    return [" ".join(out)] if out else []


def plot_curves(c: Comparison, runs: dict[str, dict[int, dict[str, Any]]], label: str) -> Path | None:
    """``compare.png``: each arm's curve, the mean over its seeds with the seeds' min-max band."""
    if not runs:
        return None
    from matplotlib.ticker import MaxNLocator

    from fedfusion.analysis.report import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, arm in runs.items():
        by_round: dict[int, list[float]] = {}
        for r in arm.values():
            for rnd, value in r["curve"]:
                by_round.setdefault(rnd, []).append(value)
        rounds = sorted(k for k, v in by_round.items() if len(v) == len(arm))  # rounds every seed scored
        mean = [statistics.mean(by_round[k]) for k in rounds]
        line = ax.plot(rounds, mean, marker="o", markersize=3, label=f"{name} ({len(arm)} seed{'s' * (len(arm) > 1)})")
        if len(arm) > 1:
            ax.fill_between(rounds, [min(by_round[k]) for k in rounds], [max(by_round[k]) for k in rounds],
                            color=line[0].get_color(), alpha=0.2)
    ax.set_title(f"{c.ref}: {label} by round ({'lower' if c.metric.lower_is_better else 'higher'} is better; "
                 "mean, band = seeds' min-max)", fontsize=9)
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = c.out / "compare.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
