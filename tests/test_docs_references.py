"""What the README, docs/ and the code name can be looked up by its reader.

1. Every dotted ``fedfusion.<module>[.<name>...]`` in README.md, docs/*.md and the Python files of fedfusion/,
   strategies/, clients/, benchmarks/ and tests/ names a module that exists today, optionally followed by a name
   that module defines (a function, class, constant, attribute or field). A module that moved leaves no old path.
2. No tracker numbers: the same files, the recipes and .ci/ cite no issue by number, item, build section or
   hash number, and no "the issue's" goal or floor; they say what the thing is instead. benchmarks/results/ is a
   record of past runs and is not read.
"""

from __future__ import annotations

import importlib.util
import re
from importlib.machinery import PathFinder
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
CODE_DIRS = ("fedfusion", "strategies", "clients", "benchmarks", "tests")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SELF = Path(__file__).resolve()  # its patterns and examples name what the others must not
CODE = sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py") if "results" not in p.parts and p.resolve() != SELF)
OTHER = [*sorted((ROOT / "recipes").glob("*.yaml")), *sorted(p for p in (ROOT / ".ci").iterdir() if p.is_file())]

DOTTED = re.compile(r"(?<![\w/.-])fedfusion(?:\.[A-Za-z_]\w*)+")
TRACKER = re.compile(
    r"\bissues?\s*#?\d+"            # issue 25, issues #4
    r"|(?<![\w&#/])#\d+\b"          # #26 (a markdown anchor like file.md#5-... is preceded by a word character)
    r"|\bBuild \d+\b|\bitem \d+\b"  # an issue's sections
    r"|\bthe issue's\b|\(issue:",   # an issue named without its number
    re.I)


def _module_source(name: str) -> str | None:
    """The source of module ``name`` if it exists (its package's ``__init__`` for a package), else None. Found as
    the import system would (the top package's own ``__path__``, then each package's folders), importing only the
    top package: ``find_spec`` of a dotted name imports every parent, and one of them pulled peft and bitsandbytes
    (seconds) into this test."""
    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)
        locations = list(getattr(importlib.import_module(top), "__path__", None) or []) if rest else []
    except (ImportError, ValueError):
        return None
    for i in range(len(rest)):
        if spec is None or spec.submodule_search_locations is None:  # a module has no sub-modules
            return None
        spec = PathFinder.find_spec(".".join([top, *rest[: i + 1]]), locations)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin).read_text(encoding="utf-8")


def _defines(source: str, name: str) -> bool:
    """Whether ``source`` defines ``name``: a def or class, an assignment or annotated field, an import, or an entry
    of ``__all__`` (a name the module makes on first use)."""
    n = re.escape(name)
    return re.search(rf"(?m)\b(?:def|class)\s+{n}\b|^\s*(?:self\.)?{n}\s*(?::|=)|\bself\.{n}\s*(?::|=)"
                     rf"|\bimport\b[^\n]*\b{n}\b|\bas\s+{n}\b|__all__[^\]]*[\"']{n}[\"']", source) is not None


def resolves(dotted: str) -> bool:
    """The longest prefix of ``dotted`` that is a module, and every later part a name defined in that module's
    source (a class's field counts as the module's: ``Fold.server_cost``)."""
    parts = dotted.split(".")
    if any(p.startswith("__") for p in parts):  # fedfusion.__version__, __main__: Python's own names
        return True
    for i in range(len(parts), 1, -1):
        source = _module_source(".".join(parts[:i]))
        if source is not None:
            return all(_defines(source, p) for p in parts[i:])
    return False


def _names(path: Path) -> list[tuple[int, str]]:
    return [(n, m.rstrip(".")) for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            for m in DOTTED.findall(line)]


@pytest.mark.parametrize("group", ["docs", "code"])
def test_every_fedfusion_name_in_docs_and_code_exists(group):
    files = DOCS if group == "docs" else CODE
    cache: dict[str, bool] = {}
    missing = [f"{path.relative_to(ROOT)}:{n}: {name}" for path in files for n, name in _names(path)
               if not cache.setdefault(name, resolves(name))]
    assert not missing, "names of modules or objects that do not exist:\n" + "\n".join(missing)


def test_a_moved_module_is_caught():
    assert resolves("fedfusion.models.growth") and resolves("fedfusion.models.growth.silence")
    assert resolves("fedfusion.fusion.base.Fold.server_cost") and resolves("fedfusion.devices.memory.estimate_memory")
    assert not resolves("fedfusion.growth") and not resolves("fedfusion.planner.estimate_memory")
    assert not resolves("fedfusion.models.growth.no_such_function")


def _tracker_hits(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    return [f"{rel}:{n}: {line.strip()[:120]}" for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if TRACKER.search(line)]


def test_no_tracker_numbers_in_code_or_docs():
    hits = [h for path in [*DOCS, *CODE, *OTHER] for h in _tracker_hits(path)]
    assert not hits, "say what the thing is, not which issue asked for it:\n" + "\n".join(hits)


def test_tracker_references_are_caught():
    caught = ["(issue 25)", "issue #7's criterion", "fixes #26", "(issue 25, Build 3)", "issue 14, item 11",
              "the issue's floor", "(issue: under 50 ms)"]
    assert all(TRACKER.search(s) for s in caught)
    kept = ["the issue time of a message", "(issue, deadline)", "docs/deployment.md#5-a-ray-cluster", "output.tracker",
            "color #fff", "step 3 of 4"]
    assert not any(TRACKER.search(s) for s in kept)
