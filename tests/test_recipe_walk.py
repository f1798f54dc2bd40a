"""benchmarks/recipe_walk.py counts the recipe's walk right: on a three-module package whose figures are counted by
hand below, and on the real package (it finds the run's entry and reaches run_federation)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import recipe_walk  # noqa: E402

sys.path.remove(str(ROOT / "benchmarks"))

SOURCES = {
    "low/recipe.py": '''
class Recipe:
    size: int = 1

    def half(self) -> int:
        return self.size // 2


def count(n):
    return n
''',
    "mid/work.py": '''
from pkg.low.recipe import Recipe, count


def train(size, other):
    count(size)
    count(other)
    return size


def spare(x):
    return len(x)


def whole(recipe: Recipe) -> None:
    pass
''',
    "top/run.py": '''
from functools import partial

from pkg.low.recipe import Recipe, count
from pkg.mid import work
from pkg.mid.work import train as fit


def go(recipe: Recipe, extra):
    fit(recipe.size, extra)
    helper(recipe)
    work.spare(recipe)
    mystery(recipe)
    count(extra)
    step = helper if extra else fit
    partial(step, recipe)


def helper(r: Recipe):
    section = r.size
    r.half()
    fit(section, 0)
''',
}


def test_a_tiny_package_counted_by_hand(tmp_path):
    pkg = tmp_path / "pkg"
    for rel, text in SOURCES.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(text)
    (pkg / "__init__.py").touch()
    uses = {"low": set(), "mid": {"low"}, "top": {"mid", "low"}}
    layout = recipe_walk.Layout(uses, lambda m: m.split(".")[1] if m.count(".") and m.split(".")[1] in uses else None)
    got = recipe_walk.measure({"pkg": pkg}, layout, entry="pkg.top.run:go", top="top")
    # go: fit(recipe.size) -> train [count(size)]; helper(recipe) -> [r.half(), fit(section) again];
    # work.spare(recipe) [len: external]; mystery(recipe): unresolved; count(extra): no recipe;
    # partial(step, recipe): step is helper or fit, both walked already
    assert [s["callee"] for s in got["stop_list"]] == [
        "pkg.mid.work:train", "pkg.low.recipe:count", "pkg.top.run:helper", "pkg.low.recipe:Recipe.half",
        "pkg.mid.work:train", "pkg.mid.work:spare", "pkg.top.run:helper", "pkg.mid.work:train"]
    top, mid, low = "pkg.top.run", "pkg.mid.work", "pkg.low.recipe"
    assert got["sequence"] == [top, mid, low, top, low, mid, mid, top, mid]
    assert got["stops"] == 8 and got["distinct_modules"] == 3 and got["functions_walked"] == 6  # go, train, count, helper, half, spare
    # low->top, top->low, low->mid, mid->top, top->mid return; low->top, low->mid, mid->top climb
    assert got["returns"] == 5 and got["upward"] == 3
    assert got["unresolved"] == 1 and "mystery(recipe)" in got["unresolved_calls"][0]
    assert got["external"] == 1 and "len(x)" in got["external_calls"][0]
    assert got["recipe_signatures"] == ["pkg.mid.work:whole (mid)"]


@pytest.mark.slow  # parses and walks the whole package twice: ~2 s
def test_the_real_package_walks_from_the_run_command():
    layout, dirs = recipe_walk.real_layout()
    got = recipe_walk.measure(dirs, layout)
    assert got["entry"].startswith("fedfusion.cli:")
    assert got["stops"] > 0
    assert recipe_walk.federated_entry(got, "run_federation") == "fedfusion.run.federation:run_federation"
    run = recipe_walk.measure(dirs, layout, entry="fedfusion.run.federation:run_federation")
    assert 0 < run["stops"] < got["stops"]
