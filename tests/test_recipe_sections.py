"""The recipe is resolved once, at the top: only the run-level modules take the whole ``Recipe``; every module
below them takes its own sections (``DataConfig``, ``FusionConfig``, ...) or a small value object
(``DataSource``). Read from the source (function signatures parsed, nothing imported), as tests/test_layout.py
reads imports."""

from __future__ import annotations

import ast
import inspect
from dataclasses import fields
from pathlib import Path

import pytest

from fedfusion.config.methods import METHODS, hook
from fedfusion.config.recipe import Recipe, load_recipe
from fedfusion.config.sections import (
    DataConfig,
    FusionConfig,
    ModelConfig,
    RecipeError,
    TrainConfig,
)
from fedfusion.fusion.distill.config import DistillConfig, FamilyConfig

ROOT = Path(__file__).parents[1]
FOLDERS = (ROOT / "fedfusion", ROOT / "strategies", ROOT / "clients")
# the modules that may hold the whole recipe: its home (config/) and what runs or serves a run from it
RUN_LEVEL = ("fedfusion/config/", "fedfusion/run/", "fedfusion/cli.py", "fedfusion/server_app.py",
             "fedfusion/client_app.py", "fedfusion/deploy.py", "fedfusion/__main__.py",
             "fedfusion/phone/commands.py")  # the CLI's phone commands (export-device, gateway, device)
# what build_methods hands a build hook beside the recipe's sections
BUILD_GIVEN = {"source", "target", "tiers"}
# what `fedfusion plan` hands a plan view (a mixed view's part: each method's part of it, priced at the run level),
# and what a mixed plan hands each method's part of it, beside the recipe's sections
PLAN_GIVEN = {"source", "part"}
MIXED_PLAN_GIVEN = {"source", "usable", "tiers"}


def names_recipe(annotation: ast.expr | None) -> bool:
    """Whether an annotation names ``Recipe`` anywhere (``Recipe``, ``recipe.Recipe``, ``"Recipe"``,
    ``Recipe | None``)."""
    for node in ast.walk(annotation) if annotation is not None else ():
        if isinstance(node, ast.Name) and node.id == "Recipe" or isinstance(node, ast.Attribute) and node.attr == "Recipe":
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and names_recipe(quoted(node.value)):
            return True
    return False


def quoted(text: str) -> ast.expr | None:
    """A quoted annotation as an expression; None for a string that is not one (a ``Literal``'s value)."""
    try:
        return ast.parse(text, mode="eval").body
    except SyntaxError:
        return None


def whole_recipe_parameters(source: str) -> list[str]:
    """``function(parameter)`` for every parameter of ``source`` annotated ``Recipe``, or named ``recipe`` with no
    annotation (the whole recipe passed untyped)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))):
                if names_recipe(arg.annotation) or (arg.annotation is None and arg.arg == "recipe"):
                    found.append(f"{getattr(node, 'name', 'lambda')}({arg.arg})")
    return found


def test_the_scan_finds_a_whole_recipe_however_it_is_written():
    source = ("def a(recipe: Recipe): ...\ndef b(r: 'Recipe | None'): ...\ndef c(recipe): ...\n"
              "def d(x: config.recipe.Recipe): ...\ndef e(data: DataConfig, recipe_like: Literal['a b']): ...\n"
              "class K:\n    def f(self, *, recipe: Recipe): ...\n")
    assert whole_recipe_parameters(source) == ["a(recipe)", "b(r)", "c(recipe)", "d(x)", "f(recipe)"]


def test_no_module_below_the_run_level_takes_the_whole_recipe():
    offenders = []
    for folder in FOLDERS:
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(RUN_LEVEL):
                offenders += [f"{rel}: {f}" for f in whole_recipe_parameters(path.read_text(encoding="utf-8"))]
    assert not offenders, "take the sections you read, not the whole Recipe:\n" + "\n".join(offenders)


@pytest.mark.parametrize("entry", [m for m in METHODS if m.build], ids=lambda m: m.name)
def test_a_build_hook_names_only_recipe_sections_and_what_build_methods_gives(entry):
    """``methods.call`` passes a build hook the recipe's section of each parameter's name: a misspelt or made-up
    parameter would fail only when a run builds that method."""
    sections = {f.name for f in fields(Recipe)}
    params = set(inspect.signature(hook(entry.build)).parameters)
    assert params <= sections | BUILD_GIVEN, params - sections - BUILD_GIVEN
    assert {"target", "tiers"} <= params


@pytest.mark.parametrize("entry", [m for m in METHODS if m.plan], ids=lambda m: m.name)
def test_a_plan_view_names_only_recipe_sections_and_what_the_plan_gives(entry):
    """``methods.call`` passes a plan view (and a mixable method's part of a mixed plan) the recipe's section of each
    parameter's name, as it does a build hook."""
    sections = {f.name for f in fields(Recipe)}
    params = set(inspect.signature(hook(entry.plan)).parameters)
    assert params <= sections | PLAN_GIVEN, params - sections - PLAN_GIVEN
    if entry.mixed_plan:
        params = set(inspect.signature(hook(entry.mixed_plan)).parameters)
        assert params <= sections | MIXED_PLAN_GIVEN, params - sections - MIXED_PLAN_GIVEN
        assert {"usable", "tiers"} <= params


@pytest.mark.parametrize("entry", [m for m in METHODS if m.rules], ids=lambda m: m.name)
def test_a_methods_rules_name_only_recipe_sections_and_its_tiers_and_report_in_its_section(entry):
    """A method's rules across sections (its entry's ``rules``) take the sections they read and the tiers that train
    it, live in its folder's ``config`` module (the config floor: a recipe loads without torch), and each names a
    key."""
    sections = {f.name for f in fields(Recipe)}
    params = set(inspect.signature(hook(entry.rules)).parameters)
    assert params <= sections | {"tiers"}, params - sections - {"tiers"}
    assert {entry.name, "tiers"} <= params
    assert entry.rules.startswith(f"{entry.package}.config:")


def test_a_methods_rules_cover_the_tiers_that_train_it():
    with pytest.raises(RecipeError, match=r"^lora\.ranks: no rank for tier 'desktop' of population\.mix$"):
        load_recipe("rolling", ["fusion.method=lora", "data.source=chatterbot", "lora.ranks={phone: 4, laptop: 8}"])
    with pytest.raises(RecipeError, match=r"^distill\.tier_family: no family for tier 'desktop' of population\.mix$"):
        load_recipe("distill", ["distill.tier_family={phone: tiny, laptop: small}"])
    assert load_recipe("quickstart", ["lora.ranks={phone: 4}"]).lora.ranks == {"phone": 4}  # no tier trains lora


def test_a_section_checks_its_own_fields_naming_the_key():
    with pytest.raises(RecipeError, match=r"^data\.held_out: must be in \(0, 1\), got 1\.5$"):
        DataConfig(held_out=1.5).check()
    with pytest.raises(RecipeError, match=r"^distill\.families\.tiny\.num_heads: 3 does not divide hidden_size 32$"):
        DistillConfig(families={"tiny": FamilyConfig(num_heads=3)}, tier_family={"phone": "tiny"}).check()
    FusionConfig().check()  # the defaults are a valid section


def test_only_the_sections_some_tier_trains_with_are_checked():
    """An unused method's section is not the run's: a bad value there is not an error until a tier uses it."""
    assert load_recipe("quickstart", ["distill.kd_weight=2"]).distill.kd_weight == 2
    with pytest.raises(RecipeError, match=r"^distill\.kd_weight: must be in \[0, 1\], got 2"):
        load_recipe("distill", ["distill.kd_weight=2"])


def test_a_cross_section_rule_reports_after_the_sections_it_reads():
    """train.seq_len against model.max_position is the recipe's rule, not either section's."""
    TrainConfig(seq_len=1024).check()
    ModelConfig(max_position=512).check()
    with pytest.raises(RecipeError, match=r"^train\.seq_len: 1024 exceeds model\.max_position 512$"):
        load_recipe("rolling", ["train.seq_len=1024", "model.max_position=512"])


def test_the_data_source_is_what_the_data_modules_read():
    recipe = load_recipe("quickstart", ["seed=3"])
    source = recipe.data_source()
    assert (source.data, source.num_clients, source.seed, source.tokenizer) == (
        recipe.data, recipe.population.num_clients, 3, recipe.model.pretrained)
