"""The arms ``fedfusion compare`` runs beside a recipe, per fusion method, and the check that they share its budget.

Three arms, each an ordinary ``fedfusion run RECIPE <the user's overrides> <the arm's overrides> seed=S``:

- ``recipe``: the recipe as given;
- ``smallest-only``: every client trains only what the weakest tier can train, the same for all;
- ``oracle``: every client trains the whole target, memory ignored (no device of the recipe need hold it).

What "the weakest tier can train" and "the whole target" mean depends on the method; each registry entry
(:mod:`fedfusion.config.methods`, its ``arms`` hook) names the rule below that makes its two arms, from the
*resolved* recipe (its tiers, widths, families, ranks, rounds), never from one recipe's numbers:

- width slicing (``submodel``: static, rolling, ... slices, grow-then-fuse, full-forward windows) and generative
  distillation (``generative``), a target trained from scratch: **smallest-only** trains the smallest width's static
  slice of a target silenced around it for every round (``fusion.method=submodel fusion.policy=static
  fusion.grow_round=<rounds>``, each client in the slice's own forward pass), so the scored target *is* the small model
  every device holds (the benchmarks' smallest-only: ``benchmarks/quickstart_policies.py``,
  ``benchmarks/knowledge_user_facts.py``). The **oracle** trains width 1.0 for every tier (static, in its own forward
  pass, no growth): the whole target on every client.
- the same methods on a pretrained target (``model.pretrained``): the small model alone would be the pretrained
  target cut to its smallest slice with the rest silenced, throwing away what pretraining put there; so
  **smallest-only** is the recipe with every tier at the weakest tier's width (and full-forward window), under the
  recipe's own policy. The oracle is as above (every client fine-tunes the whole pretrained target).
- ``distill``: **smallest-only**: every tier trains the weakest tier's family (the tier with the least memory in the
  device catalog), FedAvg within it, no distillation either way (``distill.back_distill=false
  distill.server_steps=1``); what is scored is that family model, on the same held-out text in the same units
  (``family_<name>_loss``), as ``benchmarks/distillation.py`` does. **Oracle**: width slicing at width 1.0 (above).
- ``lora``: **smallest-only**: every tier at the smallest rank of the recipe, on the base quantised as that tier's
  (``lora.quantize``), as ``benchmarks/hetero_lora.py``'s homogeneous r_min arm. **Oracle**: every tier at the
  largest rank on the unquantised base. LoRA never trains the whole base, so this is the most the recipe's adapters
  take, not full fine-tuning.
- ``mixed``: the weakest tier's method (the least memory in the device catalog) given to every tier, with that
  method's smallest-only rule; the oracle as width slicing's.
- ``units`` (exact mode): refused: it trains the target centrally and exactly, every device computing tiles, so
  there is no smaller part a device trains and its curve is the oracle's by construction.

:func:`check_equal_budget` asserts what makes the comparison fair: each arm's resolved recipe differs from the
recipe arm's (same seed) only in keys its own overrides name, and none of those is a budget key (rounds, seed,
data, target model, population, selection, local training, faults, privacy, engine, output).

Imports no torch: ``fedfusion compare`` validates every arm before anything is written.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from fedfusion.config.methods import DISTILL, MIXED, SUBMODEL, UNITS, hook, method
from fedfusion.config.recipe import METHOD_SECTIONS, Recipe, tier_methods
from fedfusion.config.sections import RecipeError
from fedfusion.fusion.distill.config import DistillConfig
from fedfusion.fusion.lora.config import LoRAConfig

RECIPE, SMALLEST, ORACLE = "recipe", "smallest-only", "oracle"
ARM_NAMES = (RECIPE, SMALLEST, ORACLE)
# what an arm may change: how client work reaches the target; every other section of a recipe is its budget
DESIGN_SECTIONS = ("fusion", *METHOD_SECTIONS)  # fusion.* and the methods' own sections
# the width-slicing settings that make each client train its slice in the slice's own forward pass
SLICE_FORWARD: tuple[tuple[str, Any], ...] = (
    ("fusion.forward", "slice"), ("fusion.window_core", False), ("fusion.window_shared", False),
    ("fusion.window_rank", 0), ("fusion.core_forward", "full"), ("fusion.window_outside_core", False),
    ("fusion.window_lr_power", 0.0))


class UnequalBudget(RecipeError):
    """An arm's recipe differs from the recipe arm's in a budget key, or in a key its overrides do not name."""


@dataclass(frozen=True)
class Arm:
    """One arm: the overrides that make it out of the recipe, what every client trains, and what is scored (``score``
    empty: the target; else a metrics-row prefix such as ``family_tiny_``, a family model's scores)."""

    name: str
    overrides: tuple[str, ...]
    about: str
    score: str = ""

    def key(self, metric: str) -> str:
        """The metrics-row key holding ``metric`` (``eval_loss``, ``eval_ppl``, ``probe_acc``) for this arm."""
        return f"{self.score}{metric.removeprefix('eval_')}" if self.score else metric

    def declared(self) -> tuple[str, ...]:
        """The recipe keys its overrides set."""
        return tuple(o.split("=", 1)[0].strip() for o in self.overrides)


def arms_for(recipe: Recipe) -> dict[str, Arm]:
    """The three arms of a resolved recipe (:data:`ARM_NAMES` order), from its method's registry entry."""
    name = recipe.fusion.method
    entry = method(name)
    if not entry.arms:
        raise RecipeError(f"fusion.method: compare has no smallest-only or oracle arm for {name!r}")
    smallest, oracle = hook(entry.arms)(recipe)
    return {RECIPE: Arm(RECIPE, (), "the recipe as given"), SMALLEST: smallest, ORACLE: oracle}


# -- the rules (the registry entries' ``arms`` hooks) -------------------------------------------------------------
def slicing_arms(recipe: Recipe, weakest: str | None = None) -> tuple[Arm, Arm]:
    """Width slicing and generative distillation: the smallest width's model (a pretrained target: every tier at the
    weakest tier's share), and width 1.0 for every tier. ``weakest``: the tier whose width counts (default the
    narrowest)."""
    f, tiers = recipe.fusion, _tiers(recipe)
    widths = {t: f.widths[t] for t in tiers if t in f.widths}
    if weakest is None:
        weakest = min(widths, key=lambda t: (widths[t], _strength(recipe, t)))
    w = widths[weakest]
    head: list[tuple[str, Any]] = [("fusion.tiers", {}), ("fusion.auto_widths", False)]
    if recipe.model.pretrained:
        window = f.window_widths.get(weakest, w)
        wanted = [("fusion.method", f.method if f.method != MIXED else tier_methods(recipe)[weakest]), *head,
                  ("fusion.widths", {t: w for t in tiers})]
        if f.window_widths:
            wanted.append(("fusion.window_widths", {t: window for t in tiers}))
        about = (f"every client trains what the weakest tier ({weakest}) trains of the pretrained target: width {w:g}"
                 + (f", window {window:g}" if f.window_widths else "") + " for every tier, the recipe's own policy")
    else:
        every = {t: widths.get(t, w) for t in tiers}  # a mixed recipe's tiers of other methods: the weakest's width
        wanted = [("fusion.method", SUBMODEL), *head, ("fusion.policy", "static"), ("fusion.grow_round", recipe.rounds),
                  *SLICE_FORWARD, ("fusion.widths", every)]
        about = (f"every client trains the smallest width's model ({min(every.values()):g} of every sliced axis: the "
                 "static slice inside "
                 "a target silenced around it, every round), so the scored target is that small model")
    return Arm(SMALLEST, _changes(recipe, wanted), about), _oracle(recipe)


def distill_arms(recipe: Recipe, weakest: str | None = None) -> tuple[Arm, Arm]:
    """Distillation: the weakest tier's family trained by every tier and scored itself; width 1.0 slicing."""
    weakest = weakest or _weakest(recipe, _tiers(recipe))
    family = recipe.section(DistillConfig).tier_family[weakest]
    wanted = [("fusion.method", DISTILL), ("fusion.tiers", {}), ("distill.tier_family", {t: family for t in _tiers(recipe)}),
              ("distill.back_distill", False), ("distill.server_steps", 1)]
    about = (f"every client trains the weakest tier's ({weakest}) family model {family!r} (FedAvg within the family, no "
             "distillation either way); scored: that family model, on the same held-out text")
    return Arm(SMALLEST, _changes(recipe, wanted), about, score=f"family_{family}_"), _oracle(recipe)


def lora_arms(recipe: Recipe, weakest: str | None = None) -> tuple[Arm, Arm]:
    """LoRA: the smallest rank on that tier's quantised base for every tier; the largest rank on the unquantised
    base for every tier."""
    tiers, lora = _tiers(recipe), recipe.section(LoRAConfig)
    weakest = weakest or min(tiers, key=lambda t: (lora.ranks[t], _strength(recipe, t)))
    rank, bits, top = lora.ranks[weakest], lora.quantize.get(weakest, 0), max(lora.ranks[t] for t in tiers)
    smallest = Arm(SMALLEST, _changes(recipe, [("lora.ranks", {t: rank for t in tiers}),
                                               ("lora.quantize", {t: bits for t in tiers})]),
                   f"every client trains the weakest tier's ({weakest}) adapter: rank {rank} on the "
                   + (f"{bits}-bit base" if bits else "unquantised base"))
    oracle = Arm(ORACLE, _changes(recipe, [("lora.ranks", {t: top for t in tiers}), ("lora.quantize", {t: 0 for t in tiers})]),
                 f"every client trains the largest rank of the recipe ({top}) on the unquantised base, memory ignored "
                 "(LoRA never trains the whole base: the most its adapters take, not full fine-tuning)")
    return smallest, oracle


def mixed_arms(recipe: Recipe, weakest: str | None = None) -> tuple[Arm, Arm]:
    """A mixed federation: the weakest tier's method for every tier, with that method's smallest-only rule."""
    weakest = weakest or _weakest(recipe, _tiers(recipe))
    tier_method = tier_methods(recipe)[weakest]
    smallest, _ = hook(method(tier_method).arms)(recipe, weakest)
    return smallest, _oracle(recipe)


def units_arms(recipe: Recipe, weakest: str | None = None) -> tuple[Arm, Arm]:
    """The exact mode has no arms: it is refused with the reason."""
    raise RecipeError(f"fusion.method: compare refuses {UNITS!r}: the exact mode trains the target centrally and "
                      "exactly (devices only compute tiles of its matrix products), so no device trains a smaller part "
                      "and its curve is the oracle's by construction; compare its cost with `fedfusion report` instead")


def _oracle(recipe: Recipe) -> Arm:
    """Every tier at width 1.0: each client trains the whole target (static, its own forward pass, no growth)."""
    wanted = [("fusion.method", SUBMODEL), ("fusion.tiers", {}), ("fusion.policy", "static"), ("fusion.grow_round", 0),
              *SLICE_FORWARD, ("fusion.auto_widths", False), ("fusion.widths", {t: 1.0 for t in _tiers(recipe)})]
    return Arm(ORACLE, _changes(recipe, wanted),
               "every client trains the whole target (width 1.0 for every tier), memory ignored")


# -- helpers --------------------------------------------------------------------------------------------------------
def _tiers(recipe: Recipe) -> list[str]:
    return list(recipe.population.mix)


def _strength(recipe: Recipe, tier: str) -> tuple[float, float, str]:
    """A tier's place from weakest to strongest: its catalog memory, then TFLOPS (then its name, for a fixed order)."""
    from fedfusion.devices.catalog import population_catalog

    device = population_catalog(recipe.population)[tier]
    return device.memory_gb, device.tflops, tier


def _weakest(recipe: Recipe, tiers: list[str]) -> str:
    """The tier with the least memory in the device catalog (ties: the least TFLOPS)."""
    return min(tiers, key=lambda t: _strength(recipe, t))


def _get(recipe: Recipe, key: str) -> Any:
    value: Any = recipe
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _yaml(value: Any) -> str:
    """``value`` as an override's right-hand side."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _changes(recipe: Recipe, wanted: list[tuple[str, Any]]) -> tuple[str, ...]:
    """The overrides that set each wanted ``(key, value)`` the recipe does not already have. With
    ``fusion.auto_widths`` the resolved widths are the fitted ones, which an arm turning the fit off would lose: its
    widths are then always stated."""
    fitted = ("fusion.widths",) if recipe.fusion.auto_widths else ()
    return tuple(f"{key}={_yaml(value)}" for key, value in wanted if _get(recipe, key) != value or key in fitted)


# -- the equal-budget check -----------------------------------------------------------------------------------------
def flat(recipe: Recipe) -> dict[str, Any]:
    """Every key of a recipe, dotted (``fusion.widths.phone``), with its value."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = value

    walk("", asdict(recipe))
    return out


def _covered(key: str, declared: tuple[str, ...]) -> bool:
    """Whether an override of one of ``declared`` sets ``key`` (itself, or a mapping that holds it)."""
    return any(key == d or key.startswith(d + ".") for d in declared)


def budget_problems(base: Recipe, arm_recipe: Recipe, arm: Arm) -> list[str]:
    """Why ``arm_recipe`` (the arm, resolved) does not share ``base``'s (the recipe arm, same seed) budget: an
    override of a budget key, or a key that differs although no override of the arm names it. Empty: it does."""
    problems = [f"{arm.name} arm: override {key!r} changes the budget (only {', '.join(DESIGN_SECTIONS)} may differ)"
                for key in arm.declared() if key.split(".", 1)[0] not in DESIGN_SECTIONS]
    mine, theirs = flat(arm_recipe), flat(base)
    absent = "<absent>"
    for key in sorted(set(mine) | set(theirs)):
        a, b = theirs.get(key, absent), mine.get(key, absent)
        if a != b and not (_covered(key, arm.declared()) and key.split(".", 1)[0] in DESIGN_SECTIONS):
            problems.append(f"{arm.name} arm: {key} is {b!r}, the recipe arm's {a!r}")
    return problems


def check_equal_budget(base: Recipe, arm_recipes: dict[str, Recipe], arms: dict[str, Arm]) -> None:
    """Raise :class:`UnequalBudget` naming every key where an arm's resolved recipe leaves the recipe's budget."""
    problems = [p for name, r in arm_recipes.items() for p in budget_problems(base, r, arms[name])]
    if problems:
        raise UnequalBudget("the arms must share the recipe's budget: " + "; ".join(problems))

