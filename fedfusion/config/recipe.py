"""Recipes: an experiment's sections composed into one :class:`Recipe`, loading with overrides, and the rules that
read several sections.

A recipe is a YAML file checked against the section dataclasses (:mod:`fedfusion.config.sections`, OmegaConf
structured configs), so an unknown key or a wrong type fails at load time with the key's full name; value checks
follow in :meth:`Recipe.check`: each section checks its own fields (its ``check`` method, beside them), and the few
rules that read several sections sit together here (``_check_across``). The methods' own sections (``distill``,
``lora``, ...) are not written here: each method's registry entry names its section class (``Method.section``, in its
folder's ``config`` module, on the config floor) and :func:`_compose` makes it a field of :class:`Recipe` under the
method's name, so adding a method touches neither this module nor :mod:`fedfusion.config.choices`.

The package imports nothing of fedfusion's implementation: checks that need one (the device catalog, the selector's
options, the files a recipe names, the partitioner, an installed tracker) are
:func:`fedfusion.run.check.check_recipe`'s, which a run calls before it writes anything or imports torch.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from difflib import get_close_matches
from functools import lru_cache
from importlib import resources
from itertools import takewhile
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedfusion.config.choices import CHOICES, MIXABLE
from fedfusion.config.methods import FACTS, LORA, METHODS, MIXED, SLICES, SUBMODEL, UNITS, call, hook
from fedfusion.config.sections import (
    AvailabilitySection,
    DataConfig,
    DataSource,
    EngineConfig,
    FaultConfig,
    FusionConfig,
    ModelConfig,
    OutputConfig,
    PopulationConfig,
    PrivacyConfig,
    RecipeError,
    ReportConfig,
    SelectionConfig,
    TrainConfig,
    UnitsSection,
)

# method name -> its recipe section's class (its registry entry's ``section``), in registry order
SECTIONS: dict[str, type] = {m.name: hook(m.section) for m in METHODS if m.section}
METHOD_SECTIONS = tuple(SECTIONS)  # the recipe keys of the methods' own sections
# recipe key -> its allowed values: the common keys' (fedfusion.config.choices) and each method section's ``CHOICES``
RECIPE_CHOICES: dict[str, tuple] = {**CHOICES, **{f"{name}.{key}": allowed for name, kind in SECTIONS.items()
                                                  for key, allowed in getattr(kind, "CHOICES", {}).items()}}

T = TypeVar("T")


def _compose(cls: type[T]) -> type[T]:
    """``cls`` with a field per method section (:data:`SECTIONS`), named for its method and defaulting to the
    section's defaults, placed after ``fusion`` (so a resolved recipe.yaml lists them there), before ``@dataclass``
    makes the fields: OmegaConf's schema, ``recipe.<name>`` and :func:`fedfusion.config.methods.call` see a plain
    field. A type checker does not: typed code reads a method's section with :meth:`Recipe.section`."""
    annotations: dict[str, Any] = {}
    for name, kind in cls.__annotations__.items():
        annotations[name] = kind
        if name == "fusion":
            for section, section_kind in SECTIONS.items():
                annotations[section] = section_kind
                setattr(cls, section, field(default_factory=section_kind))
    cls.__annotations__ = annotations
    return cls


@dataclass
@_compose
class Recipe:
    """One experiment: the common sections below, and after ``fusion`` each method's own (:func:`_compose`)."""

    name: str = "quickstart"
    seed: int = 0
    # federated rounds; 0 with data.source=facts: as many as the facts need, ceil(facts / data.facts_per_round)
    # (resolved by fedfusion.run.check before anything is written; the run directory's recipe.yaml holds the number)
    rounds: int = 12
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    population: PopulationConfig = field(default_factory=PopulationConfig)
    fusion: FusionConfig = field(default_factory=FusionConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    availability: AvailabilitySection = field(default_factory=AvailabilitySection)
    train: TrainConfig = field(default_factory=TrainConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    units: UnitsSection = field(default_factory=UnitsSection)

    def data_source(self) -> DataSource:
        """What rebuilds this recipe's client data in any process (:class:`DataSource`)."""
        return DataSource(self.data, self.population.num_clients, self.seed, self.model.pretrained)

    def section(self, kind: type[T]) -> T:
        """The method section of class ``kind`` (``recipe.section(LoRAConfig)`` is ``recipe.lora``, typed: a
        composed field is one a type checker cannot see)."""
        for name, section_kind in SECTIONS.items():
            if section_kind is kind:
                return getattr(self, name)
        raise KeyError(f"{kind.__name__} is no method's recipe section (fedfusion.config.methods' Method.section)")

    def check(self) -> None:
        """Value checks beyond types: every key's allowed values (:data:`RECIPE_CHOICES`), the rounds, each section's
        own ``check``, then the rules across sections (:func:`_check_across`, which also checks the population and the
        sections of the methods some tier uses); raises RecipeError naming the first bad key."""
        for key, allowed in RECIPE_CHOICES.items():
            value: Any = self
            for part in key.split("."):
                value = getattr(value, part)
            if value not in allowed:
                raise RecipeError(f"{key}: {value!r} is not one of {', '.join(allowed)}")
        if self.rounds < 0 or (self.rounds == 0 and self.data.source != "facts"):
            raise RecipeError(f"rounds: must be > 0 (0, as many as the facts need, only with data.source=facts), "
                              f"got {self.rounds}")
        for section in (self.data, self.model, self.selection, self.train, self.engine, self.faults,
                        self.availability, self.output, self.privacy, self.fusion, self.units):
            section.check()
        _check_across(self)


def builtin_recipe_path(name: str) -> Path:
    """Path of a recipe shipped with the package (e.g. ``quickstart``)."""
    return Path(str(resources.files("fedfusion.recipes").joinpath(f"{name}.yaml")))


def builtin_recipes() -> dict[str, str]:
    """Name -> description of every recipe shipped with the package: the file's opening comment, as one line."""
    found = {}
    for entry in sorted(resources.files("fedfusion.recipes").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            lines = entry.read_text(encoding="utf-8").splitlines()
            comment = [line.lstrip("#").strip() for line in takewhile(lambda x: x.startswith("#"), lines)]
            found[entry.name.removesuffix(".yaml")] = " ".join(comment)
    return found


def resolve_recipe_path(ref: str | Path) -> Path:
    """A recipe reference is a file path, or the bare name of a built-in recipe."""
    path = Path(ref)
    if path.is_file():
        return path
    if path.is_dir():
        inside = ", ".join(sorted(p.name for p in path.glob("*.y*ml"))) or "none"
        raise RecipeError(f"recipe {str(ref)!r}: a directory, not a recipe file; give one of its YAML files "
                          f"({inside}) or a built-in recipe name")
    if path.suffix == "" and builtin_recipe_path(str(ref)).is_file():
        return builtin_recipe_path(str(ref))
    names = list(builtin_recipes())
    close = get_close_matches(str(ref), names, n=1)
    hint = f"did you mean {close[0]!r}? " if close and path.suffix == "" else ""
    raise RecipeError(f"recipe {str(ref)!r}: no such file and no built-in recipe of that name; {hint}"
                      f"built-in: {', '.join(names)}")


# Mappings a recipe states whole: given in a file (or as a whole override) they replace the default
# rather than merge into it, so ``mix: {phone: 1.0}`` means phones only. The common sections' are listed here, a
# method section's in its ``WHOLE`` (beside its fields, as its ``CHOICES``).
WHOLE_MAPPINGS = ("data.partitioner", "population.mix", "fusion.widths", "fusion.tiers", "selection.options",
                  "availability.model", *(f"{name}.{key}" for name, kind in SECTIONS.items()
                                          for key in getattr(kind, "WHOLE", ())))


def _copy(cfg: DictConfig) -> DictConfig:
    """An independent copy of ``cfg``, as ``copy.deepcopy`` makes it (``OmegaConf.merge`` copies its first config so),
    through pickle: 2 ms for a recipe against 6 ms, and a test suite merges recipes hundreds of times."""
    copied: DictConfig = pickle.loads(pickle.dumps(cfg))
    return copied


def _merge(base: DictConfig, cfg: Any, what: str, replace: tuple[str, ...]) -> DictConfig:
    try:
        target = _copy(base)  # the base is left alone (a cached file config, the schema)
        for key in replace:
            OmegaConf.update(target, key, {}, merge=False)
        merged = OmegaConf.unsafe_merge(target, cfg)  # merge() without its deepcopy of the target: ours is fresh
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        msg = str(exc).splitlines()[0]
        raise RecipeError(f"{what}: bad key {key!r}: {msg}") from None
    if not isinstance(merged, DictConfig):  # a structured recipe merges into a mapping; say so if it did not
        raise RecipeError(f"{what}: not a mapping of recipe sections")
    return merged


def load_recipe(ref: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Load a recipe file (or built-in name), apply ``key=value`` overrides, check (:meth:`Recipe.check`).

    Needs no torch, so a bad recipe is reported in about a second; :func:`fedfusion.run.check.check_recipe` adds
    the checks that need the implementation. ``fusion.auto_widths`` is resolved by
    :func:`fedfusion.fusion.submodel.plan.fit_widths`, which a run calls before it writes anything.
    """
    path = resolve_recipe_path(ref)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError):  # unreadable or not UTF-8: OmegaConf.load below reports it as before
        text = None
    cfg = _merge_overrides(_file_config(path, text), overrides)  # not changed: _merge copies a base it changes
    recipe: Recipe = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    recipe.check()
    return recipe


@lru_cache(maxsize=32)
def _file_config(path: Path, text: str | None) -> DictConfig:
    """The recipe file at ``path`` merged into the schema, cached by the file's text (a test suite loads the same
    few recipes hundreds of times; the load and merge were ~0.4 s each). Callers never change it in place."""
    try:
        raw = OmegaConf.load(path)
    except Exception as exc:  # yaml errors come in several types
        raise RecipeError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, DictConfig):
        raise RecipeError(f"{path}: a recipe must be a mapping of sections")
    if not raw:  # not silently the defaults: a recipe states at least its name
        raise RecipeError(f"{path}: empty recipe; state at least its name (e.g. `name: my-run`) and what differs from "
                          "the defaults (recipes/rolling.yaml is the defaults plus an lr schedule and an epoch cap)")
    given = tuple(k for k in WHOLE_MAPPINGS if OmegaConf.select(raw, k, default=None) is not None)
    return _merge(_schema(), raw, str(path), given)


@lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """The recipe's structured schema, built once (80 ms a time); merged from, never changed in place."""
    return OmegaConf.structured(Recipe)


def _whole_mapping_near(key: str) -> bool:
    """Whether ``key`` is, is inside, or contains one of :data:`WHOLE_MAPPINGS` (an override there replaces)."""
    return any(key == w or key.startswith(w + ".") or w.startswith(key + ".") for w in WHOLE_MAPPINGS)


def _merge_overrides(cfg: DictConfig, overrides: list[str] | tuple[str, ...]) -> DictConfig:
    """Apply ``key=value`` overrides in order. Overrides that replace no whole mapping are merged in one step (one
    merge costs ~20 ms, a recipe with a dozen overrides was 0.5 s of CPU); if that fails, or a whole mapping is
    involved, they are applied one by one, which names the override at fault."""
    keys = [item.split("=", 1)[0].strip() for item in overrides if "=" in item]
    nested = any(b.startswith(a + ".") for a in keys for b in keys)  # a section and a key inside it: in order
    if overrides and len(keys) == len(overrides) and not nested and not any(_whole_mapping_near(k) for k in keys):
        try:
            return _merge(cfg, OmegaConf.from_dotlist(list(overrides)), "overrides", ())
        except Exception:  # the one-by-one path below raises the precise error
            pass
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r}: expected key=value")
        key = item.split("=", 1)[0].strip()
        try:
            dot = OmegaConf.from_dotlist([item])
        except OmegaConfBaseException as exc:
            raise RecipeError(f"override {item!r}: {str(exc).splitlines()[0]}") from None
        cfg = _merge(cfg, dot, f"override {item!r}", (key,) if key in WHOLE_MAPPINGS else ())
    return cfg


def grow_round_at(fraction: float, rounds: int) -> int:
    """The round a ``fusion.grow_round`` fraction of ``rounds`` names: round(fraction x rounds), at least 1."""
    return max(1, round(fraction * rounds))


def tier_methods(recipe: Recipe) -> dict[str, str]:
    """The fusion method of every tier of the population (:meth:`FusionConfig.tier_method`)."""
    return {tier: recipe.fusion.tier_method(tier) for tier in recipe.population.mix}


def nodes_per_client(recipe: Recipe) -> int:
    """SuperNodes each client of the population runs (``units.supernodes`` in the units mode, else 1): node
    ``partition-id`` p is client ``p // k``'s node ``p % k`` (the simulation and ``fedfusion deploy`` start
    ``num_clients x k`` nodes)."""
    return recipe.units.supernodes if recipe.fusion.method == UNITS else 1


def uses(recipe: Recipe, method: str) -> bool:
    """Whether some tier of the recipe's population trains with ``method``."""
    return method in tier_methods(recipe).values()


# Rules across sections: each one names the key it reports and reads more than one section; a section's own rules
# are its ``check``.


def _check_across(recipe: Recipe) -> None:
    """The rules that span sections, in the order they report."""
    for entry in METHODS:
        if entry.unclipped and recipe.privacy.mode in ("clip", "local") and uses(recipe, entry.name):
            raise RecipeError(f"privacy.mode: {recipe.privacy.mode} clips a reply against the model sent, but "
                              f"{entry.unclipped}")
    if recipe.privacy.secure_aggregation:
        _secure_aggregation(recipe)
    _data_and_method(recipe)
    if recipe.train.seq_len > recipe.model.max_position:
        raise RecipeError(f"train.seq_len: {recipe.train.seq_len} exceeds model.max_position {recipe.model.max_position}")
    _tiers(recipe)
    recipe.population.check()  # after each tier's method and width: a missing width is the likelier slip
    _method_sections(recipe)
    _wire(recipe)
    _grow_round(recipe)
    recipe.fusion.check_windows()  # after the grow round's range: a method's own settings before its combinations
    if recipe.fusion.method == UNITS:
        _units_mode(recipe)
    f = recipe.fusion
    if f.outer != "none" and not uses(recipe, SUBMODEL):
        raise RecipeError(f"fusion.outer: a server optimizer steps folded slices (fusion.method=submodel); "
                          f"{f.method!r} does not use it")
    if recipe.train.checkpoint and (f.method != SUBMODEL or f.policy == "ordered"):
        raise RecipeError("train.checkpoint: applies to width slices and full-forward windows (fusion.method=submodel, "
                          f"not policy ordered), got method {f.method!r}, policy {f.policy!r}")
    fused = recipe.model.family in ("gpt2", "opt") and not recipe.model.pretrained
    if f.axes and fused and (("heads" in f.axes) != ("hidden" in f.axes)):
        raise RecipeError(f"fusion.axes: a {recipe.model.family} model slices 'heads' and 'hidden' together "
                          "(head_dim = hidden / heads)")
    if recipe.selection.clients_per_round > recipe.population.num_clients and f.method != UNITS:
        raise RecipeError(f"selection.clients_per_round: {recipe.selection.clients_per_round} exceeds "
                          f"population.num_clients {recipe.population.num_clients}")


def _data_and_method(recipe: Recipe) -> None:
    """Which data each method trains on: facts with slices, generative or LoRA; chatterbot only with LoRA; a
    dataset's distillation transfers from a file; general text scored only for facts on a pretrained target."""
    d, method = recipe.data, recipe.fusion.method
    if d.source == "facts":
        if not d.path and d.people < recipe.population.num_clients:
            raise RecipeError(f"data.people: {d.people} people cannot give each of "
                              f"{recipe.population.num_clients} clients one")
        if not set(tier_methods(recipe).values()) <= set(FACTS):
            raise RecipeError(f"fusion.method: data.source=facts runs with {', '.join(FACTS[:-1])} or {FACTS[-1]} "
                              f"fusion, got {method!r}")
        if d.general_chars and not recipe.model.pretrained:
            raise RecipeError("data.general_chars: scores what a pretrained target forgets; set model.pretrained")
    if d.general_chars < 0 or (d.general_chars and d.source != "facts"):
        raise RecipeError(f"data.general_chars: >= 0, and only with data.source=facts, got {d.general_chars} "
                          f"with source {d.source!r}")


def _tiers(recipe: Recipe) -> None:
    """``fusion.tiers``: given exactly for fusion.method=mixed, one known, mixable method for every tier of the mix;
    every slicing tier has a width."""
    f, mix = recipe.fusion, recipe.population.mix
    if f.method != MIXED and f.tiers:
        raise RecipeError(f"fusion.tiers: per-tier methods need fusion.method=mixed, got {f.method!r}")
    if f.method == MIXED:
        for tier in mix:
            if tier not in f.tiers:
                raise RecipeError(f"fusion.tiers: no method for tier {tier!r} of population.mix")
        for tier, method in f.tiers.items():
            if tier not in mix:
                raise RecipeError(f"fusion.tiers.{tier}: not a tier of population.mix ({', '.join(mix)})")
            if method == LORA:
                raise RecipeError(f"fusion.tiers.{tier}: lora cannot be mixed: its target is a frozen pretrained base "
                                  f"plus one adapter update, the others train the whole target; use one of "
                                  f"{', '.join(MIXABLE)}")
            if method not in MIXABLE:
                raise RecipeError(f"fusion.tiers.{tier}: {method!r} is not one of {', '.join(MIXABLE)}")
    for tier, method in tier_methods(recipe).items():
        if method in SLICES and not f.auto_widths and tier not in f.widths:
            raise RecipeError(f"fusion.widths: no width for tier {tier!r} of population.mix")


def _method_sections(recipe: Recipe) -> None:
    """Which methods train on chatterbot; then for every method some tier trains, in registry order, its section's
    own ``check`` and its rules across sections (its entry's ``rules``, given the tiers that train it)."""
    source = recipe.data.source
    if (recipe.fusion.method == LORA) != (source == "chatterbot") and source not in ("dataset", "facts"):
        raise RecipeError(f"data.source: fusion.method=lora trains on instruction pairs (data.source=chatterbot or "
                          f"dataset) or on facts, and only it trains on chatterbot; got method "
                          f"{recipe.fusion.method!r} with source {source!r}")
    methods = tier_methods(recipe)
    for entry in METHODS:
        tiers = [tier for tier, name in methods.items() if name == entry.name]
        if tiers and entry.section:
            getattr(recipe, entry.name).check()
        if tiers and entry.rules:
            call(entry.rules, recipe, tiers=tiers)


def _wire(recipe: Recipe) -> None:
    """The wire formats apply to the tiers whose replies are the model trained (sub-models, LoRA adapters), and a
    quantised message is not what Flower's DP mods can clip (they compare reply and payload value by value)."""
    f = recipe.fusion
    for key, value in (("wire_dtype", f.wire_dtype), ("wire_up", f.wire_up)):
        if value == "float32":
            continue
        if not (uses(recipe, SUBMODEL) or uses(recipe, LORA)):
            raise RecipeError(f"fusion.{key}: {value} applies to the tiers of fusion.method=submodel or lora only, "
                              f"got {f.method!r}")
        if recipe.privacy.mode in ("clip", "local") and value in ("int8", "int4"):
            raise RecipeError(f"fusion.{key}: {value} cannot go with privacy.mode={recipe.privacy.mode} (Flower's "
                              "DP mods clip the reply against the payload value by value); use float32 or float16 down "
                              "and float32 up")


def _grow_round(recipe: Recipe) -> None:
    """``fusion.grow_round`` within the rounds; a fraction of them resolved to a round once ``rounds`` is known
    (rounds 0: when the facts set it, :func:`fedfusion.run.check.check_recipe`)."""
    f = recipe.fusion
    given = f.grow_round
    if isinstance(given, float) and given.is_integer():  # 4.0 in YAML is round 4
        given = f.grow_round = int(given)
    if isinstance(given, float) and not 0 < given < 1:
        raise RecipeError(f"fusion.grow_round: a round number or a fraction in (0, 1) of the rounds, got {given}")
    if isinstance(given, float) and recipe.rounds:
        f.grow_round = grow_round_at(given, recipe.rounds)
    elif given < 0 or (recipe.rounds and given > recipe.rounds):
        raise RecipeError(f"fusion.grow_round: must be in [0, rounds={recipe.rounds}], got {given} (the "
                          "small model grows into the target after that round: run more rounds, give a fraction "
                          "of them (e.g. 0.33), or set fusion.grow_round to at most rounds; 0 grows nothing)")


def _units_mode(recipe: Recipe) -> None:
    """fusion.method=units: the exact mode trains one Llama target centrally on language-model text, its step's
    batch cut into micro-batches over each device's SuperNodes."""
    u, batch = recipe.units, recipe.train.batch_size
    if u.supernodes > batch:
        raise RecipeError(f"units.supernodes: {u.supernodes} SuperNodes per device need as many micro-batches, more "
                          f"than train.batch_size {batch}")
    if u.micro_batches and u.supernodes > u.micro_batches:
        raise RecipeError(f"units.supernodes: micro-batch c runs on a device's node c mod {u.supernodes}, so with "
                          f"units.micro_batches {u.micro_batches} some of the {u.supernodes} would get no work; use at "
                          f"most {u.micro_batches}")
    if u.micro_batches and batch % u.micro_batches:
        raise RecipeError(f"units.micro_batches: {u.micro_batches} does not divide train.batch_size {batch}")
    if recipe.model.family != "llama":
        raise RecipeError(f"model.family: fusion.method=units routes a Llama's linear layers, got {recipe.model.family!r}")
    if recipe.data.source not in ("shakespeare", "text", "dataset"):
        raise RecipeError(f"data.source: fusion.method=units trains on language-model text (shakespeare, text or "
                          f"dataset), got {recipe.data.source!r}")
    if not -1 <= u.stall_partition < recipe.population.num_clients:
        raise RecipeError(f"units.stall_partition: -1 (off) or a partition below population.num_clients "
                          f"{recipe.population.num_clients}, got {u.stall_partition}")
    if u.stall_after < 0 or u.stall_s < 0:
        raise RecipeError(f"units.stall_after, units.stall_s: must be >= 0, got {u.stall_after}, {u.stall_s}")
    if recipe.privacy.mode != "none":
        raise RecipeError("privacy.mode: the units mode sends no model update to clip; leave it 'none'")


def _secure_aggregation(recipe: Recipe) -> None:
    """Secure aggregation sums target-shaped changes: it needs a method that folds a sum (width slices and full
    windows; LoRA, whose own rules say which of its methods), the plain mean, exact float32 replies and a round of at
    least two clients."""
    f, why = recipe.fusion, "privacy.secure_aggregation: the server folds one sum of masked updates, so"
    methods = set(tier_methods(recipe).values())
    if methods not in ({SUBMODEL}, {LORA}):
        raise RecipeError(f"{why} every tier must train fusion.method=submodel or every tier lora, got {f.method!r}")
    if f.aggregate != "mean":
        raise RecipeError(f"{why} fusion.aggregate must be mean (a {f.aggregate} needs each client's values)")
    if f.window_rank:
        raise RecipeError(f"{why} fusion.window_rank must be 0 (a low-rank reply is factors, not a change)")
    if f.wire_up != "float32":
        raise RecipeError(f"{why} fusion.wire_up must be float32 (the masked vector is its own fixed-point encoding)")
    if recipe.selection.clients_per_round < 2:
        raise RecipeError(f"{why} selection.clients_per_round must be >= 2, got {recipe.selection.clients_per_round}")


def to_yaml(recipe: Recipe) -> str:
    """The fully resolved recipe as YAML (re-loading it reproduces the run)."""
    return OmegaConf.to_yaml(OmegaConf.structured(recipe))
