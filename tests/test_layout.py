"""The package layout is the map of the flow: config -> wire, devices -> data -> models -> train -> fusion ->
selection, analysis -> run -> entry points. Every module's whole import closure (module-level and function-level imports,
read from the source, nothing imported) stays inside the packages its own package may use, so there is no
import cycle anywhere and a recipe loads without importing any implementation."""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("layout")  # with -n, one worker parses the sources (edges below)

ROOT = Path(__file__).parents[1]
DIRS = {"fedfusion": ROOT / "fedfusion", "fedfusion.strategies": ROOT / "strategies", "fedfusion.clients": ROOT / "clients"}

# what each package may import directly; what it may reach through them follows (the closure below)
USES = {
    "config": set(),
    "wire": {"config"},
    "devices": {"config"},
    "data": {"config", "devices", "wire"},
    "models": {"config", "data", "wire"},
    "train": {"models", "data"},
    "fusion": {"config", "wire", "devices", "data", "models", "train"},
    "selection": {"config", "devices"},
    "units": {"devices"},  # the exact (units) mode's GEMM tiles, verification and timeline: no Flower
    "phone": {"models", "train", "wire"},
    "strategies": {"fusion", "selection", "wire", "devices"},
    "clients": {"wire", "data", "models", "train", "phone", "units"},
    # the plan, the report, edge vs cloud: what a run or a recipe costs and shows, read by a run and by the CLI
    "analysis": {"config", "wire", "devices", "data", "models", "train", "fusion", "units"},
    "run": {"config", "wire", "devices", "data", "models", "train", "fusion", "selection", "strategies", "units",
            "analysis"},
}
ENTRY_POINTS = {"fedfusion", "fedfusion.__main__", "fedfusion.cli", "fedfusion.server_app", "fedfusion.client_app",
                "fedfusion.deploy", "fedfusion.phone.commands"}  # phone.commands: the CLI's phone commands


def allowed(package: str) -> set[str]:
    """``package`` and every package it reaches through USES."""
    seen, todo = {package}, [package]
    while todo:
        for used in USES[todo.pop()]:
            if used not in seen:
                seen.add(used)
                todo.append(used)
    return seen


def modules() -> dict[str, Path]:
    found = {}
    for name, folder in DIRS.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([name, *parts])] = path
    return found


MODULES = modules()


def imports(module: str) -> set[str]:
    """The project modules ``module`` imports anywhere in its source (``from a.b import c`` counts ``a.b.c``
    when that is a module, else ``a.b``)."""
    path, found = MODULES[module], set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


@lru_cache(maxsize=1)
def edges() -> dict[str, set[str]]:
    """Each module's project imports: parsed (~1 s) by the first test that needs them, not by every xdist worker
    that collects this file."""
    return {m: imports(m) for m in MODULES}


def package_of(module: str) -> str | None:
    """The layout package a module belongs to; None for entry points and the root."""
    if module in ENTRY_POINTS:
        return None
    parts = module.split(".")
    if floor := lower_floor(module):  # a method's module that sits below fusion/, though in its folder
        return floor
    return parts[1] if parts[1] in USES else None


# the modules of a method's folder (fedfusion.fusion.<method>.<name>) on a floor below fusion/, by name: its recipe
# section (the recipe composes it), its message specs and what its client role replies (its client role reads them,
# and clients/ may not import fusion/)
FOLDER_FLOORS = {"config": "config", "spec": "wire", "reply": "models"}


def lower_floor(module: str) -> str | None:
    """The floor of ``fedfusion.fusion.<method>.<name>`` when ``name`` is one of :data:`FOLDER_FLOORS`, else None."""
    parts = module.split(".")
    if len(parts) == 4 and parts[:2] == ["fedfusion", "fusion"]:
        return FOLDER_FLOORS.get(parts[3])
    return None


def closure(module: str) -> dict[str, list[str]]:
    """Every module ``module`` reaches through imports, each with one import chain that reaches it."""
    paths, todo = {module: [module]}, [module]
    while todo:
        here = todo.pop()
        for nxt in sorted(edges()[here]):
            if nxt not in paths:
                paths[nxt] = [*paths[here], nxt]
                todo.append(nxt)
    del paths[module]
    return paths


def test_every_module_reaches_only_the_packages_below_it():
    bad = []
    for module in sorted(MODULES):
        package = package_of(module)
        if package is None:
            continue
        ok = allowed(package)
        for reached, chain in closure(module).items():
            if reached != "fedfusion" and (package_of(reached) not in ok or reached in ENTRY_POINTS):
                bad.append(f"{package}: {' -> '.join(chain)}")
    assert not bad, "imports against the layout:\n" + "\n".join(bad)


def test_no_import_cycle_anywhere():
    cyclic = sorted(m for m in MODULES if m in closure(m))
    assert not cyclic, f"modules that import themselves through others: {cyclic}"


def test_every_module_lives_in_a_package_of_the_layout():
    flat = sorted(m for m in MODULES if package_of(m) is None and m not in ENTRY_POINTS and m.count(".") > 0
                  and m.split(".")[1] not in ("catalog", "recipes"))
    assert not flat, f"modules outside the layout's packages: {flat}"


def test_the_root_package_imports_nothing_of_fedfusion():
    assert not edges()["fedfusion"]


def test_the_packages_above_a_method_section_import_nothing():
    """Importing ``fedfusion.fusion.<method>.config`` (or its ``spec``, ``reply``) runs ``fedfusion.fusion``'s and the
    method folder's ``__init__``: they stay empty, so composing a method's section into the recipe, or a client role
    reading its spec, loads nothing else."""
    sections = [m for m in MODULES if lower_floor(m)]
    assert sections, "no method section found"
    for module in sections:
        for package in ("fedfusion.fusion", module.rpartition(".")[0]):
            assert not edges()[package], f"{package} imports {sorted(edges()[package])}"


@pytest.mark.slow  # a fresh Python process (~1 s)
def test_loading_a_recipe_imports_no_torch_and_no_implementation():
    import subprocess
    import sys

    # the packages above each method section the recipe composes, read from the registry (their __init__ imports
    # nothing: test_the_packages_above_a_method_section_import_nothing)
    above = ("import fedfusion.config.methods as r; above = {'fedfusion.fusion'} | "
             "{m.section.partition(':')[0].rpartition('.')[0] for m in r.METHODS if m.section}; ")
    code = ("import sys, fedfusion.config.recipe; " + above + "print(sorted(m for m in sys.modules if m == 'torch' or "
            "m.startswith('fedfusion.') and not m.startswith('fedfusion.config') and not m.endswith('.config')"
            " and m not in above))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.slow  # ~10 s: one process importing torch, transformers and every script
def test_every_benchmark_script_imports():
    """A benchmark is run by hand, not by the suite: a moved module it imports must fail here, not for a reviewer.
    (Importing runs no benchmark: each does its work under ``if __name__ == "__main__"``; the CUDA ones check for a
    GPU there.)"""
    import subprocess
    import sys

    names = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))
    code = f"import importlib, sys; sys.path.insert(0, 'benchmarks'); [importlib.import_module(n) for n in {names!r}]"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_registry_imports_only_what_the_recipe_and_the_wire_may_reach():
    """The recipe composes each method's section and ``wire.specs.spec_types`` each method's specs by importing the
    registry's ``"module:Class"`` paths at run time, which the import scan above cannot see: those modules must be
    the ones of the floors that import them (a method folder's ``config`` and ``spec``)."""
    from fedfusion.config.methods import METHODS

    for entry in METHODS:
        for path, floor in ((entry.section, "config"), *((p, "wire") for p in entry.specs)):
            if path:
                module = path.partition(":")[0]
                assert module.startswith(entry.package + ".") and lower_floor(module) == floor, (entry.name, path)
