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
from fedfusion.config.recipe import Recipe

ROOT = Path(__file__).parents[1]
FOLDERS = (ROOT / "fedfusion", ROOT / "strategies", ROOT / "clients")
# the modules that may hold the whole recipe: its home (config/) and what runs or serves a run from it
RUN_LEVEL = ("fedfusion/config/", "fedfusion/run/", "fedfusion/cli.py", "fedfusion/server_app.py",
             "fedfusion/client_app.py", "fedfusion/deploy.py", "fedfusion/__main__.py",
             "fedfusion/phone/commands.py")  # the CLI's phone commands (export-device, gateway, device)
# what build_methods hands a build hook beside the recipe's sections
BUILD_GIVEN = {"source", "target", "tiers"}


def names_recipe(annotation: ast.expr | None) -> bool:
    """Whether an annotation names ``Recipe`` anywhere (``Recipe``, ``recipe.Recipe``, ``"Recipe"``,
    ``Recipe | None``)."""
    for node in ast.walk(annotation) if annotation is not None else ():
        if isinstance(node, ast.Name) and node.id == "Recipe" or isinstance(node, ast.Attribute) and node.attr == "Recipe":
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and names_recipe(ast.parse(node.value).body[0].value):
            return True
    return False


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
              "def d(x: config.recipe.Recipe): ...\ndef e(data: DataConfig, recipe_like: int): ...\n"
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
