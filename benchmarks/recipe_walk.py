"""The recipe's walk down the floors, measured from the source: no module of the package is imported.

Why: a reader following the recipe from the run's entry point should go down the floors with few returns to a room
already left; the one earlier figure (91 stops, 60 returns) was counted by hand, so it could not be re-run. This
counts it statically, with the ``ast`` module over every ``.py`` file of ``fedfusion/``, ``strategies/`` and
``clients/``.

Definitions (each is what the code below does; tests/test_recipe_walk.py checks them on a package counted by hand):

- **Entries**, one walk each, each from scratch: the handler that ``fedfusion.cli``'s ``run`` subparser sets
  (``run.set_defaults(func=H)``: the recipe loaded, checked, run), and the function named by ``--run`` (default
  ``run_federation``, the federated run alone), which must be one the handler itself passes the recipe to.
- **Recipe values** in a walked function: a parameter annotated ``Recipe``; a parameter that a stop (below) passed a
  recipe value to (by position or keyword; a ``**kwargs`` parameter keeps the names of the recipe-valued keywords it
  took, and forwarding it binds those names; a ``**`` mapping of unknown keys binds only a ``**kwargs``); a local
  bound (``=``, ``:=``, tuple unpacking, a ``for`` over a recipe value) to a recipe value, to a call of a package
  function annotated ``-> Recipe``, or to a literal container (list, tuple, dict, comprehension) holding one; and, as
  expressions, attribute chains and subscripts of a recipe value (``recipe.fusion.widths``), a method call on one
  (``recipe.data_source()``), ``getattr(recipe, x)``, a conditional with a recipe-valued branch, and ``self.attr``
  where a walked method set ``self.attr`` to a recipe value. Values other functions compute from the recipe are not.
- **Stop**: a call, in a walked function (its nested functions and lambdas included), to a function, method or class
  of the package that passes a recipe value: as an argument, a ``*``/``**`` argument, an element of a literal
  container or comprehension argument, or the receiver of a method (``recipe.fusion.label(...)``).
  ``functools.partial(f, ...)`` counts as a call of ``f``. A call of a package function annotated ``-> Recipe`` is a
  stop too: the recipe comes out of it, and loading and checking it are the first rooms a run reads it in.
- **Resolving a callee**: the module's imports (module-level and in-function: ``from X import f``, ``import X as Y``,
  ``Y.f``; re-exports followed), local aliases (``build = A if c else B``: each of ``A`` and ``B`` is a stop),
  ``self.m``, ``cls(...)`` and ``Class.m`` in the class and its package bases, and ``x.m`` where ``x``'s class is
  known: an annotation (parameter, dataclass field, property, a callee's return) or ``x = Class(...)``. A class is
  entered through its ``__init__`` (a dataclass without one is a stop not entered). A call passing a recipe value that
  resolves outside the package (a builtin, a method of ``str``/``dict``/``Path``, torch, Flower) is *external*; one
  whose callee is unknown (a callable parameter, a registry hook, a method of an object of unknown class) is
  *unresolved*. Both are counted and listed; neither is a stop.
- **Walk**: depth-first from the entry; a function's calls in source order (line, then column: an outer call before
  the calls in its arguments); a stop to a function not yet walked enters it before the next call; a function is
  walked once (a later stop to it is counted, not entered).
- **Sequence**: the entry's module, then each stop's callee module (where the callee is defined), in walk order.
  A **return to a room already left** is a transition A -> B with A != B where B appeared earlier in the sequence
  (coming back to the caller's module after a stop's walk counts when the caller's next stop is there). A **call back
  up the floors** is a transition A -> B where B's floor lies above A's in ``tests/test_layout.py``'s layout (its
  ``USES`` and ``package_of``, loaded from that file: B's package reaches A's, or B is an entry point and A is not).
- **Whole-Recipe signatures below run/**: every function of the package, walked or not, with a parameter annotated
  ``Recipe`` in a module on a floor that ``run`` uses (``run`` itself and the entry points excluded).

What it cannot see: calls on an object of unknown class that pass no recipe value (``course.train(...)`` on a course
built from the recipe) and registry hooks called through a ``"module:function"`` path. The first show as *methods
reading the recipe never reached*, the second as unresolved calls; neither is a stop.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import platform
import shlex
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BUILTINS = set(dir(__import__("builtins")))
UNTYPED = {"getattr", "next", "max", "min", "sorted", "list", "tuple", "iter"}  # builtins whose value's class is the input's


@dataclass
class Layout:
    """The floors: what each package may use (``USES``) and the package of a module (None: an entry point)."""

    uses: dict[str, set[str]]
    package_of: Callable[[str], str | None]

    def reaches(self, package: str) -> set[str]:
        seen, todo = {package}, [package]
        while todo:
            for used in self.uses[todo.pop()]:
                if used not in seen:
                    seen.add(used)
                    todo.append(used)
        return seen

    def upward(self, a: str, b: str) -> bool:
        """Whether moving from module ``a`` to module ``b`` climbs the floors."""
        pa, pb = self.package_of(a), self.package_of(b)
        if pa == pb:
            return False
        if pb is None:
            return True
        return pa is not None and pa in self.reaches(pb)


def real_layout() -> tuple[Layout, dict[str, Path]]:
    """The package's layout, from ``tests/test_layout.py`` itself (loaded by path; it imports pytest, not torch)."""
    spec = importlib.util.spec_from_file_location("_layout", ROOT / "tests" / "test_layout.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return Layout(mod.USES, mod.package_of), dict(mod.DIRS)


def modules(dirs: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under each folder (``__init__`` is its package)."""
    found = {}
    for name, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([name, *parts])] = path
    return found


Def = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass
class Symbol:
    """A function, method or class of the package: ``module:qualname``."""

    module: str
    qualname: str
    node: Def | ast.ClassDef
    cls: str | None = None  # a method's class qualname

    @property
    def key(self) -> str:
        return f"{self.module}:{self.qualname}"


@dataclass
class Index:
    """Every module's parsed source, its top-level names and its imports."""

    paths: dict[str, Path]
    trees: dict[str, ast.Module] = field(default_factory=dict)
    symbols: dict[str, Symbol] = field(default_factory=dict)
    roots: set[str] = field(default_factory=set)  # the top-level package names

    def __post_init__(self) -> None:
        self.roots = {m.split(".")[0] for m in self.paths}
        for mod, path in self.paths.items():
            tree = self.trees[mod] = ast.parse(path.read_text(encoding="utf-8"))
            for node in tree.body:
                self._add(mod, node, "", None)

    def _add(self, mod: str, node: ast.stmt, prefix: str, cls: str | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            qual = prefix + node.name
            self.symbols[f"{mod}:{qual}"] = Symbol(mod, qual, node, cls)
            if isinstance(node, ast.ClassDef):
                for child in node.body:
                    self._add(mod, child, qual + ".", qual)

    def package(self, mod: str) -> str:
        return mod if self.paths[mod].name == "__init__.py" else mod.rpartition(".")[0]

    def imports(self, mod: str, body: ast.AST) -> dict[str, str]:
        """Local name -> ``module`` or ``module:name`` for the imports anywhere in ``body``."""
        out: dict[str, str] = {}
        for node in ast.walk(body):
            if isinstance(node, ast.Import):
                for a in node.names:
                    out[a.asname or a.name.partition(".")[0]] = a.name if a.asname else a.name.partition(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = self.package(mod).split(".")
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
                for a in node.names:
                    full = f"{base}.{a.name}"
                    out[a.asname or a.name] = full if full in self.paths else f"{base}:{a.name}"
        return out

    def lookup(self, ref: str, depth: int = 0) -> Symbol | str | None:
        """``module`` or ``module:name`` to a package symbol, a package module name, or None (outside the package)."""
        mod, _, name = ref.partition(":")
        if mod not in self.paths or depth > 8:
            return None
        if not name:
            return mod
        if f"{mod}:{name}" in self.symbols:
            return self.symbols[f"{mod}:{name}"]
        if f"{mod}.{name}" in self.paths:
            return f"{mod}.{name}"
        target = self.module_imports(mod).get(name)  # a re-export
        return self.lookup(target, depth + 1) if target else None

    def module_imports(self, mod: str) -> dict[str, str]:
        tree = self.trees[mod]
        return self.imports(mod, ast.Module(body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))],
                                            type_ignores=[]))

    def member(self, cls: Symbol, name: str, depth: int = 0) -> Symbol | None:
        """``cls.name``: in the class, else in its package bases."""
        if f"{cls.key}.{name}" in self.symbols:
            return self.symbols[f"{cls.key}.{name}"]
        assert isinstance(cls.node, ast.ClassDef)
        for base in cls.node.bases:
            found = self.resolve_name(cls.module, dotted(base), {})
            if isinstance(found, Symbol) and isinstance(found.node, ast.ClassDef) and depth < 8:
                if hit := self.member(found, name, depth + 1):
                    return hit
        return None

    def resolve_name(self, mod: str, name: str | None, local: dict[str, str]) -> Symbol | str | None:
        """A dotted name (``f``, ``X.f``, ``C.m``) as seen in ``mod`` with the in-function imports ``local``."""
        if not name:
            return None
        head, *rest = name.split(".")
        imports = {**self.module_imports(mod), **local}
        if head in imports:
            found = self.lookup(imports[head])
        else:
            found = self.symbols.get(f"{mod}:{head}")
        for part in rest:
            if isinstance(found, str):
                found = self.lookup(f"{found}:{part}")
            elif isinstance(found, Symbol) and isinstance(found.node, ast.ClassDef):
                found = self.member(found, part)
            else:
                return None
        return found


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := dotted(node.value)):
        return f"{base}.{node.attr}"
    return None


def annotation_name(node: ast.AST | None) -> str | None:
    """The class an annotation names: ``X``, ``m.X``, ``"X"``, ``X | None``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(node, ast.Subscript):  # dict[str, float], type[T]
        return annotation_name(node.value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        sides = [annotation_name(s) for s in (node.left, node.right)]
        named = [s for s in sides if s and s != "None"]
        return named[0] if len(named) == 1 else None
    return dotted(node) if node is not None else None


def in_order(node: ast.AST) -> Iterator[ast.Call]:
    """The calls in ``node`` (nested functions and lambdas included), by source position."""
    calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
    return iter(sorted(calls, key=lambda c: (c.lineno, c.col_offset)))


@dataclass
class Walk:
    """One depth-first walk of the recipe from ``entry`` (``module:qualname``)."""

    index: Index
    entry: str
    stops: list[dict[str, Any]] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)
    external: list[str] = field(default_factory=list)
    walked: set[str] = field(default_factory=set)
    self_attrs: dict[str, set[str]] = field(default_factory=dict)  # class key -> attributes holding recipe values

    def run(self) -> Walk:
        self.visit(self.index.symbols[self.entry], set())
        return self

    def unreached(self) -> list[str]:
        """Methods never walked that read a ``self`` attribute a walked method set to a recipe value: the walk cannot
        see who calls them (an object of unknown class, e.g. a course run by the lifecycle)."""
        out = []
        for cls_key, attrs in self.self_attrs.items():
            for key, sym in self.index.symbols.items():
                if key.startswith(cls_key + ".") and key not in self.walked and any(
                        isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
                        and n.attr in attrs for n in ast.walk(sym.node)):
                    out.append(key)
        return sorted(out)

    # --- one function -------------------------------------------------------------------------------------------
    def visit(self, fn: Symbol, bound: set[str], kw_keys: frozenset[str] = frozenset()) -> None:
        """Walk ``fn`` with the parameters in ``bound`` holding recipe values (``kw_keys``: the recipe-valued keys its
        ``**kwargs`` holds, ``*`` for keys not known)."""
        self.walked.add(fn.key)
        node = fn.node
        if isinstance(node, ast.ClassDef):
            return
        local = self.index.imports(fn.module, node)
        ctx = Context(self, fn, local, set(bound))
        if node.args.kwarg and node.args.kwarg.arg in bound:
            ctx.kw_keys = {node.args.kwarg.arg: kw_keys}
        args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        ctx.tracked |= {a.arg for a in args if annotation_name(a.annotation) in ("Recipe", "recipe.Recipe")}
        ctx.types.update({a.arg: t for a in args if (t := ctx.class_of_annotation(a.annotation))})
        if fn.cls and args and not any(dotted(d) == "staticmethod" for d in node.decorator_list):
            owner = self.index.symbols[f"{fn.module}:{fn.cls}"]
            if any(dotted(d) == "classmethod" for d in node.decorator_list):
                ctx.classes[args[0].arg] = owner
            else:
                ctx.types[args[0].arg] = owner
        ctx.settle(node)
        for call in in_order(node):
            ctx.call(call)


@dataclass
class Context:
    """What one walked function knows: its recipe values, local aliases of functions and the classes of names."""

    walk: Walk
    fn: Symbol
    local: dict[str, str]
    tracked: set[str]
    types: dict[str, Symbol | str] = field(default_factory=dict)  # a package class, or "external"
    aliases: dict[str, list[ast.expr]] = field(default_factory=dict)
    classes: dict[str, Symbol] = field(default_factory=dict)  # a classmethod's ``cls``
    kw_keys: dict[str, frozenset[str]] = field(default_factory=dict)  # **kwargs -> its recipe-valued keys ("*": unknown)

    @property
    def index(self) -> Index:
        return self.walk.index

    def class_of_annotation(self, node: ast.AST | None, mod: str | None = None) -> Symbol | str | None:
        """The package class an annotation names; ``"external"`` for any other type it names (``str``, ``Path``)."""
        name = annotation_name(node)
        found = self.index.resolve_name(mod or self.fn.module, name, {} if mod else self.local)
        if isinstance(found, Symbol) and isinstance(found.node, ast.ClassDef):
            return found
        return "external" if name and name not in ("Any", "object", "None") and found is None else None

    def returns_of(self, call: ast.Call) -> Symbol | str | None:
        """The class of a call's value: the class called, or a package function's return annotation."""
        if dotted(call.func) in UNTYPED:
            return None
        found = self.resolve(call.func)
        if found == "external":
            return "external"
        if isinstance(found, list) and len(found) == 1:
            sym = found[0]
            if isinstance(sym.node, ast.ClassDef):
                return sym
            return self.class_of_annotation(sym.node.returns, sym.module)
        return None

    def resolve(self, node: ast.expr) -> list[Symbol] | str | None:
        """A callee expression to package symbols, ``"external"``, or None (unknown)."""
        if isinstance(node, ast.Name) and node.id in self.aliases:
            each = [self.resolve(branch) for branch in self.aliases[node.id]]
            syms = [s for f in each if isinstance(f, list) for s in f]
            return syms if syms and len(syms) == len(each) else None
        if isinstance(node, ast.Name) and node.id in self.classes:  # cls(...) in a classmethod
            return [self.classes[node.id]]
        if isinstance(node, ast.Attribute) and (cls := self.class_of(node.value)):
            if cls == "external":
                return "external"
            assert isinstance(cls, Symbol)
            hit = self.index.member(cls, node.attr)
            return [hit] if hit else None
        name = dotted(node)
        found = self.index.resolve_name(self.fn.module, name, self.local) if name else None
        if isinstance(found, Symbol):
            return [found]
        if name and found is None:
            head = name.split(".")[0]
            imported = {**self.index.module_imports(self.fn.module), **self.local}.get(head)
            if (head in BUILTINS and head not in self.tracked and head not in self.types and "." not in name) or (
                    imported and imported.split(".")[0].split(":")[0] not in self.index.roots):
                return "external"
        return None

    def class_of(self, node: ast.expr) -> Symbol | str | None:
        """The package class of an expression's value, where an annotation or a constructor tells it (``"external"``:
        a type from outside the package)."""
        if isinstance(node, ast.Name):
            return self.types.get(node.id)
        if isinstance(node, (ast.Constant, ast.JoinedStr, ast.List, ast.Dict, ast.Tuple, ast.Set, ast.ListComp,
                             ast.DictComp, ast.SetComp, ast.BinOp)):
            return "external"
        if isinstance(node, ast.Call):
            return self.returns_of(node)
        if isinstance(node, ast.Subscript):
            return "external" if self.class_of(node.value) == "external" else None
        if isinstance(node, ast.Attribute) and (owner := self.class_of(node.value)):
            if owner == "external":
                return "external"
            assert isinstance(owner, Symbol) and isinstance(owner.node, ast.ClassDef)
            for stmt in owner.node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == node.attr:
                    return self.class_of_annotation(stmt.annotation, owner.module)
                if isinstance(stmt, ast.FunctionDef) and stmt.name == node.attr and any(
                        dotted(d) == "property" for d in stmt.decorator_list):
                    return self.class_of_annotation(stmt.returns, owner.module)
        return None

    def is_recipe(self, node: ast.AST) -> bool:
        """Whether ``node`` is a recipe value (the module docstring's definition)."""
        if isinstance(node, ast.Name):
            return node.id in self.tracked
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and self.fn.cls and node.value.id == "self" and (
                    node.attr in self.walk.self_attrs.get(f"{self.fn.module}:{self.fn.cls}", set())):
                return True
            return self.is_recipe(node.value)
        if isinstance(node, (ast.Subscript, ast.Starred)):
            return self.is_recipe(node.value)
        if isinstance(node, ast.IfExp):
            return self.is_recipe(node.body) or self.is_recipe(node.orelse)
        if isinstance(node, ast.BoolOp):
            return any(self.is_recipe(v) for v in node.values)
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute) and self.is_recipe(node.func.value):
                return True
            if dotted(node.func) == "getattr" and node.args and self.is_recipe(node.args[0]):
                return True
            return self.makes_recipe(node.func)
        return False

    def makes_recipe(self, func: ast.expr) -> bool:
        """Whether ``func`` resolves to a package function annotated ``-> Recipe``."""
        found = self.resolve(func)
        return isinstance(found, list) and any(
            isinstance(s.node, (ast.FunctionDef, ast.AsyncFunctionDef)) and annotation_name(s.node.returns) == "Recipe"
            for s in found)

    def carries(self, node: ast.AST) -> bool:
        """An argument that passes a recipe value: one, or a literal container / comprehension of them."""
        if self.is_recipe(node):
            return True
        if isinstance(node, ast.Dict):
            return any(self.carries(v) for v in node.values)
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            return any(self.carries(e) for e in node.elts)
        if isinstance(node, ast.DictComp):
            return self.carries(node.value)
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            return self.carries(node.elt)
        return False

    def settle(self, body: ast.AST) -> None:
        """Bind recipe values and function aliases over the body's assignments, to a fixpoint."""
        cls_key = f"{self.fn.module}:{self.fn.cls}" if self.fn.cls else None
        changed = True
        while changed:
            changed = False
            for node in ast.walk(body):
                pairs: list[tuple[ast.AST, ast.AST]] = []
                if isinstance(node, ast.Assign):
                    pairs = [(t, node.value) for t in node.targets]
                elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                    pairs = [(node.target, node.value)]
                elif isinstance(node, (ast.For, ast.comprehension)) and self.is_recipe(node.iter):
                    pairs = [(node.target, node.iter)]
                for target, value in pairs:
                    for t, v in unpack(target, value):
                        if isinstance(t, ast.Name) and isinstance(v, ast.expr) and (cls := self.class_of(v)):
                            self.types.setdefault(t.id, cls)
                        if isinstance(t, ast.Name) and isinstance(v, ast.IfExp) and t.id not in self.aliases and all(
                                isinstance(self.resolve(b), list) for b in (v.body, v.orelse)):
                            self.aliases[t.id] = [v.body, v.orelse]
                        if not self.carries(v):
                            continue
                        if isinstance(t, ast.Name) and t.id not in self.tracked:
                            self.tracked.add(t.id)
                            changed = True
                        elif (cls_key and isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                              and t.value.id == "self" and t.attr not in self.walk.self_attrs.setdefault(cls_key, set())):
                            self.walk.self_attrs[cls_key].add(t.attr)
                            changed = True

    # --- one call -----------------------------------------------------------------------------------------------
    def call(self, call: ast.Call) -> None:
        func, args, keywords = call.func, list(call.args), list(call.keywords)
        if dotted(func) in ("partial", "functools.partial") and args:
            func, args = args[0], args[1:]
        receiver = isinstance(func, ast.Attribute) and self.is_recipe(func.value)
        positional = [i for i, a in enumerate(args) if self.carries(a)]
        named = [k for k in keywords if self.carries(k.value)]
        if not (receiver or positional or named or self.makes_recipe(func)):
            return
        where = f"{self.fn.module}:{call.lineno} {ast.unparse(call)[:100]}"
        found = self.resolve(func)
        if found == "external":
            self.walk.external.append(where)
            return
        if not isinstance(found, list):
            self.walk.unresolved.append(where)
            return
        for sym in found:
            self.stop(sym, receiver, positional, named, where, (len(args), {k.arg for k in keywords if k.arg}))

    def stop(self, sym: Symbol, receiver: bool, positional: list[int], named: list[ast.keyword], where: str,
             given: tuple[int, set[str]] = (0, set())) -> None:
        """Record a stop at ``sym`` and walk it, if not walked yet, with the parameters the recipe reaches bound."""
        target = self.index.member(sym, "__init__") if isinstance(sym.node, ast.ClassDef) else sym
        self.walk.stops.append({"callee": sym.key, "module": sym.module, "at": where, "caller": self.fn.key,
                                "entered": target is not None and target.key not in self.walk.walked})
        if target is None or target.key in self.walk.walked:
            return
        assert isinstance(target.node, (ast.FunctionDef, ast.AsyncFunctionDef))
        a = target.node.args
        params = [p.arg for p in [*a.posonlyargs, *a.args]]
        bound_self = bool(target.cls) and not any(dotted(d) == "staticmethod" for d in target.node.decorator_list)
        first = params[:1] if bound_self else []
        rest = params[1:] if bound_self else params
        bound = set(first if receiver else [])
        bound |= {rest[i] for i in positional if i < len(rest)}
        if a.vararg and any(i >= len(rest) for i in positional):
            bound.add(a.vararg.arg)
        names: list[str] = []
        for k in named:
            if k.arg is not None:
                names.append(k.arg)
            elif isinstance(k.value, ast.Name) and k.value.id in self.kw_keys:
                names += sorted(self.kw_keys[k.value.id])  # a forwarded **kwargs: the keys it is known to hold
            else:
                names.append("*")  # a mapping of unknown keys: only the callee's **kwargs takes it
        open_ = set(rest[given[0]:]) | {p.arg for p in a.kwonlyargs}
        kw_keys = set()
        for name in names:
            if name in open_:
                bound.add(name)
            elif a.kwarg:
                bound.add(a.kwarg.arg)
                kw_keys.add(name)
        self.walk.visit(target, bound, frozenset(kw_keys))


def unpack(target: ast.AST, value: ast.AST) -> Iterator[tuple[ast.AST, ast.AST]]:
    """Pairs of (target, value) of an assignment, tuples unpacked element by element where both sides are tuples."""
    if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) and len(
            target.elts) == len(value.elts):
        for t, v in zip(target.elts, value.elts):
            yield from unpack(t, v)
    elif isinstance(target, (ast.Tuple, ast.List)):
        for t in target.elts:
            yield t, value
    else:
        yield target, value


def run_handler(index: Index, cli: str) -> str:
    """``module:function`` of the handler the CLI's ``run`` subparser sets (``run.set_defaults(func=H)``)."""
    tree = index.trees[cli]
    names = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
             and isinstance(n.value.func, ast.Attribute) and n.value.func.attr == "add_parser" and n.value.args
             and isinstance(n.value.args[0], ast.Constant) and n.value.args[0].value == "run"
             for t in n.targets if isinstance(t, ast.Name)}
    for n in ast.walk(tree):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "set_defaults"
                and dotted(n.func.value) in names):
            for k in n.keywords:
                if k.arg == "func" and (name := dotted(k.value)):
                    return f"{cli}:{name}"
    raise LookupError(f"no run handler in {cli}")


def recipe_signatures(index: Index, layout: Layout, top: str) -> list[str]:
    """Every function with a parameter annotated ``Recipe`` in a module on a floor ``top`` uses (``top`` excluded)."""
    below = layout.reaches(top) - {top}
    out = []
    for sym in index.symbols.values():
        if isinstance(sym.node, ast.ClassDef) or layout.package_of(sym.module) not in below:
            continue
        a = sym.node.args
        if any(annotation_name(p.annotation) == "Recipe" for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]):
            out.append(f"{sym.key} ({layout.package_of(sym.module)})")
    return sorted(out)


def measure(dirs: dict[str, Path], layout: Layout, entry: str | None = None, cli: str = "fedfusion.cli",
            top: str = "run") -> dict[str, Any]:
    """The walk's figures (the module docstring's definitions) over the packages in ``dirs``."""
    index = Index(modules(dirs))
    entry = entry or run_handler(index, cli)
    walk = Walk(index, entry).run()
    seq = [entry.partition(":")[0], *(s["module"] for s in walk.stops)]
    moves = list(zip(seq, seq[1:]))
    returns = [f"{a} -> {b}" for i, (a, b) in enumerate(moves) if a != b and b in seq[: i + 1]]
    upward = [f"{a} -> {b}" for a, b in moves if layout.upward(a, b)]
    sigs = recipe_signatures(index, layout, top)
    return {
        "entry": entry, "stops": len(walk.stops), "functions_walked": len(walk.walked),
        "distinct_modules": len(set(seq)), "transitions": sum(a != b for a, b in moves),
        "returns": len(returns), "upward": len(upward), "unresolved": len(walk.unresolved),
        "external": len(walk.external), "unreached_readers": len(unreached := walk.unreached()),
        "sequence": seq, "visits": dict(Counter(seq).most_common()), "return_moves": returns, "upward_moves": upward,
        "stop_list": walk.stops, "unresolved_calls": walk.unresolved, "external_calls": walk.external,
        "recipe_signatures": sigs, "unreached_reader_list": unreached,
    }


ROWS = [("entry", "entry"), ("stops", "stops"), ("functions walked", "functions_walked"),
        ("distinct modules", "distinct_modules"), ("module changes", "transitions"),
        ("returns to a room already left", "returns"), ("calls back up the floors", "upward"),
        ("unresolved calls passing the recipe", "unresolved"), ("external calls passing the recipe", "external"),
        ("methods reading the recipe that the walk never reached", "unreached_readers")]
LISTS = [("Returns to a room already left", "return_moves"), ("Calls back up the floors", "upward_moves"),
         ("Unresolved calls", "unresolved_calls"), ("External calls", "external_calls"),
         ("Methods reading the recipe never reached", "unreached_reader_list")]


def markdown(data: dict[str, Any]) -> str:
    """The report: each walk's figures side by side, then each walk's visit counts, sequence, stops and lists."""
    walks: dict[str, dict[str, Any]] = data["walks"]
    sigs = data["recipe_signatures"]
    by_floor = ", ".join(f"{k} {v}" for k, v in Counter(x.rpartition("(")[2].rstrip(")") for x in sigs).items())
    lines = ["# The recipe's walk down the floors", "",
             f"Machine: {data['machine']}. Static: the `ast` of every module of fedfusion/, strategies/, clients/; "
             "nothing imported. Definitions: the docstring of benchmarks/recipe_walk.py; floors: tests/test_layout.py. "
             "Two walks: from `fedfusion run`'s handler (the recipe loaded, checked, run) and from the function it "
             "calls for the federated run (the run alone; functions are walked afresh).", "",
             "| figure | " + " | ".join(walks) + " |", "|---|" + "---|" * len(walks),
             *(f"| {label} | " + " | ".join(f"`{w[k]}`" if k == "entry" else str(w[k]) for w in walks.values()) + " |"
               for label, k in ROWS), "",
             f"Whole-Recipe signatures below run/ (any function, walked or not): {len(sigs)} ({by_floor or 'none'}).", ""]
    for label, w in walks.items():
        lines += [f"## {label}: visits per module", "", "| module | visits |", "|---|---|",
                  *(f"| `{m}` | {n} |" for m, n in w["visits"].items()), "",
                  f"## {label}: sequence", "", " -> ".join(f"`{m}`" for m in w["sequence"]), "",
                  f"## {label}: stops", "", "| # | callee | call | entered |", "|---|---|---|---|",
                  *(f"| {i} | `{s['callee']}` | `{s['at'].replace('|', '/')}` | {'yes' if s['entered'] else ''} |"
                    for i, s in enumerate(w["stop_list"], 1)), ""]
        for title, key in LISTS:
            lines += [f"## {label}: {title.lower()}", "", *([f"- `{x.replace('`', '')}`" for x in w[key]] or ["(none)"]), ""]
    lines += ["## Whole-Recipe signatures below run/", "", *(f"- `{x}`" for x in sigs), ""]
    return "\n".join(lines)


def federated_entry(handler: dict[str, Any], name: str) -> str:
    """The function named ``name`` that the handler itself calls with the recipe (a stop of the handler's walk)."""
    for stop in handler["stop_list"]:
        if stop["caller"] == handler["entry"] and stop["callee"].rpartition(":")[2] == name:
            return stop["callee"]
    raise LookupError(f"{handler['entry']} passes the recipe to no {name}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default="run_federation", help="the function the run handler calls for the federated run")
    p.add_argument("--name", default="recipe_walk", help="results stem")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    layout, dirs = real_layout()
    command = shlex.join(["python", "benchmarks/recipe_walk.py", *(argv if argv is not None else sys.argv[1:])])
    handler = measure(dirs, layout)
    run = measure(dirs, layout, entry=federated_entry(handler, a.run))
    sigs = handler.pop("recipe_signatures")
    run.pop("recipe_signatures")
    data = {"command": command, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "settings": {"run": a.run}, "recipe_signatures": sigs,
            "walks": {"from the run handler": handler, f"from {a.run}": run}}
    md = markdown(data)
    title, _, rest = md.partition("\n\n")
    md = f"{title}\n\nCommand: `{command}`\n\n{rest}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.name}.json").write_text(json.dumps(data, indent=1))
    (RESULTS / f"{a.name}.md").write_text(md)
    print(md.split("\n## ")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
