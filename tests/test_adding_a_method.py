"""Adding a method touches its folder, its client role and one registry line, proven on generative: a copy of the
source tree gets a second generative under another name (its folder and client role copied with the name replaced,
its name constant and registry entry repeated under the new name) and no other edit. In that tree the new method is a
``fusion.method`` choice with its own recipe section and choices, a client role and a message spec, its builder
builds it for the recipe's tiers, ``fedfusion plan`` prints for it what it prints for generative, and the copy passes
the layout's and the registry's tests (but the one that pins the registry's present lists)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
NEW = "echo"
TREE = ("fedfusion", "clients", "strategies", "recipes", "tests")  # the source tree, and the tests run in it
REGISTRY = Path("fedfusion", "config", "methods.py")


def renamed(text: str) -> str:
    """``text`` with generative's name replaced by :data:`NEW`, in each case it is written in."""
    return text.replace("generative", NEW).replace("Generative", NEW.title()).replace("GENERATIVE", NEW.upper())


def generative_entry(source: str) -> str:
    """The text of generative's ``Method(...)`` entry in the registry's ``source``."""
    entry = next(node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
                 and getattr(node.func, "id", "") == "Method" and node.args and getattr(node.args[0], "id", "") == "GENERATIVE")
    text = ast.get_source_segment(source, entry)
    assert text
    return text


def with_new_entry(source: str) -> str:
    """The registry's source with generative's name constant and entry each repeated, renamed, after the original."""
    constant, entry = 'GENERATIVE = "generative"\n', generative_entry(source)
    assert source.count(constant) == 1 and source.count(entry + ",\n") == 1
    return (source.replace(constant, constant + renamed(constant))
            .replace(entry + ",\n", f"{entry},\n    {renamed(entry)},\n"))


def clone_generative(tree: Path) -> None:
    """Copy the source tree to ``tree`` and add generative's copy there: its folder, its client role, one entry."""
    for name in TREE:
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree)  # pytest's settings and markers
    folder = tree / "fedfusion" / "fusion"
    shutil.copytree(folder / "generative", folder / NEW, ignore=shutil.ignore_patterns("__pycache__"))
    for path in (folder / NEW).glob("*.py"):
        path.write_text(renamed(path.read_text(encoding="utf-8")), encoding="utf-8")
    (tree / "clients" / f"{NEW}.py").write_text(renamed((ROOT / "clients" / "generative.py").read_text(encoding="utf-8")),
                                                encoding="utf-8")
    (tree / REGISTRY).write_text(with_new_entry((ROOT / REGISTRY).read_text(encoding="utf-8")), encoding="utf-8")


# run in the copy: what the rest of the package makes of the new method (as JSON)
PROBE = f"""
import json
from fedfusion.config import choices, methods
from fedfusion.config.recipe import RECIPE_CHOICES, load_recipe, to_yaml
from fedfusion.config.sections import RecipeError
from fedfusion.run.federation import build_methods
from fedfusion.run.targets import lm_target
from fedfusion.wire.specs import RoleSpec, spec_types

recipe = load_recipe("rolling", ["fusion.method={NEW}", "{NEW}.top_k=2"])
try:
    load_recipe("rolling", ["fusion.method={NEW}", "{NEW}.device_state=nowhere"])
    refused = ""
except RecipeError as e:
    refused = str(e)
spec = next(t for t in spec_types() if t.__name__ == "{NEW.title()}Spec")
built = build_methods(recipe, lm_target(recipe))
print(json.dumps({{
    "choice": "{NEW}" in choices.FUSION_METHODS and "{NEW}" in choices.MIXABLE and "{NEW}" in methods.FOLD_ORDER,
    "section": type(recipe.{NEW}).__name__, "top_k": recipe.{NEW}.top_k, "yaml": "\\n{NEW}:\\n" in to_yaml(recipe),
    "choices": list(RECIPE_CHOICES["{NEW}.device_state"]), "refused": refused,
    "role": methods.ROLES["{NEW}"], "role_spec": RoleSpec("{NEW}").to_config(),
    "node": methods.hook(methods.ROLES["{NEW}"] + ":Node").__name__,
    "spec": spec.__module__, "built": sorted({{(type(m).__name__, m.name) for m in built.values()}}),
}}))
"""


def run_in(tree: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_copy_adds_a_constant_and_an_entry_to_the_registry():
    source = (ROOT / REGISTRY).read_text(encoding="utf-8")
    changed = with_new_entry(source)
    ast.parse(changed)
    added = set(changed.splitlines()) - set(source.splitlines())
    assert f'{NEW.upper()} = "{NEW}"' in added and any(line.startswith(f"    Method({NEW.upper()},") for line in added)
    assert len(changed.splitlines()) - len(source.splitlines()) == 1 + len(generative_entry(source).splitlines())


@pytest.mark.slow  # a copy of the source tree and fresh Python processes that import torch (~40 s)
def test_a_copy_of_generative_under_a_new_name_needs_no_other_edit(tmp_path):
    tree = tmp_path / "tree"
    clone_generative(tree)
    got = json.loads(run_in(tree, "-c", PROBE).splitlines()[-1])
    assert got["choice"] and got["yaml"] and got["section"] == f"{NEW.title()}Config" and got["top_k"] == 2
    assert got["choices"] == ["node", "server"]
    assert got["refused"].startswith(f"{NEW}.device_state: 'nowhere' is not one of"), got["refused"]
    assert got["role"] == f"fedfusion.clients.{NEW}" and got["role_spec"] == {"role": NEW} and got["node"] == "Node"
    assert got["spec"] == f"fedfusion.fusion.{NEW}.spec"
    assert got["built"] == [[f"{NEW.title()}Method", NEW]]
    plans = {name: run_in(tree, "-m", "fedfusion", "plan", "rolling", f"fusion.method={name}")
             for name in ("generative", NEW)}
    assert " ".join(renamed(plans["generative"]).split()) == " ".join(plans[NEW].split())  # the title is centred
    # the layout (floors, no cycle, a recipe loads no implementation) and the registry's rules (names only in their
    # homes, every hook resolves, every role keeps a node state, ...) hold with the new method; the present lists are
    # pinned by test_the_lists_are_the_registrys, and importing every benchmark script is no business of the copy
    run_in(tree, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "tests/test_layout.py",
           "tests/test_method_registry.py", "-k", "not lists_are_the_registrys and not every_benchmark_script_imports")
