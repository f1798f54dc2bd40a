"""The method registry (fedfusion.config.methods) is the one list of methods: a method's name, as a string
literal, appears only in its own folder, its client role modules and its registry entry; every hook an entry names
resolves; the lists the rest of the package reads are the registry's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fedfusion.config import choices, methods
from fedfusion.config.methods import BY_NAME, FOLD_ORDER, METHODS, ROLES, hook

ROOT = Path(__file__).parents[1]
FOLDERS = {"fedfusion": ROOT / "fedfusion", "fedfusion.clients": ROOT / "clients",
           "fedfusion.strategies": ROOT / "strategies"}
REGISTRY = ROOT / "fedfusion" / "config" / "methods.py"

# (file, the name the literal is assigned to) -> why that literal may equal a method's name
WHITELIST = {
    ("fedfusion/wire/specs.py", "UNITS_ACTION"): "a wire message type (train.units), the ClientApp's @app.train key",
    ("fedfusion/wire/specs.py", "UNITS_RECORD"): "the name of the ArrayRecord a units message carries",
}


def path_of(module: str) -> Path:
    """The file or folder of a dotted module name (clients/ and strategies/ install as fedfusion.clients/...)."""
    for prefix in sorted(FOLDERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            rest = module[len(prefix):].lstrip(".").split(".") if module != prefix else []
            base = FOLDERS[prefix].joinpath(*rest)
            return base if base.is_dir() else base.with_suffix(".py")
    raise AssertionError(f"{module} is not a module of the package")


def homes(name: str) -> list[Path]:
    """Where ``name`` may be written: its folder, its client role modules, the registry."""
    entry = BY_NAME[name]
    return [path_of(entry.package), *(path_of(module) for _, module in entry.roles), REGISTRY]


def literals(path: Path) -> list[tuple[int, str, str]]:
    """(line, value, the name it is assigned to or '') of every string constant in ``path`` that equals a method."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for statement in ast.walk(tree):
        if not isinstance(statement, ast.stmt):
            continue
        target = ""
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and isinstance(statement.targets[0], ast.Name):
            target = statement.targets[0].id
        for node in ast.iter_child_nodes(statement):
            if isinstance(node, ast.stmt):
                continue  # a nested statement is visited on its own
            for leaf in ast.walk(node):
                if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str) and leaf.value in BY_NAME:
                    found.append((leaf.lineno, leaf.value, target))
    return sorted(found)


def sources() -> list[Path]:
    return sorted(p for folder in FOLDERS.values() for p in folder.rglob("*.py"))


def test_a_method_is_named_only_in_its_folder_its_client_roles_and_the_registry():
    outside = []
    for path in sources():
        rel = path.relative_to(ROOT).as_posix()
        for line, name, target in literals(path):
            if (rel, target) in WHITELIST:
                continue
            if not any(path == home or home in path.parents for home in homes(name)):
                outside.append(f"{rel}:{line}: {name!r}")
    assert not outside, "method names outside their homes (use fedfusion.config.methods' constants):\n" + "\n".join(outside)


# Adding a method touches its folder, its client role and one registry line, proven on generative: no module outside
# those homes names it (an identifier, an import or a string that is not a docstring). Its recipe section, its choices,
# its message spec and its replies are in its folder; the recipe, the choices and the wire read them from its entry.


def names_generative(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every identifier, attribute, argument, import or non-docstring string in ``path`` that contains
    "generative" (any case)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        words: list[str] = []
        if isinstance(node, ast.Name):
            words = [node.id]
        elif isinstance(node, ast.Attribute):
            words = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            words = [node.name]
        elif isinstance(node, ast.arg) or isinstance(node, ast.keyword) and node.arg:
            words = [str(node.arg)]
        elif isinstance(node, ast.alias):
            words = [node.name, node.asname or ""]
        elif isinstance(node, ast.ImportFrom):
            words = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words = [node.value]
        found += [(getattr(node, "lineno", 0), w) for w in words if "generative" in w.lower()]
    return sorted(found)


def test_adding_a_method_touches_its_folder_its_client_role_and_one_registry_line():
    found = {}
    for path in sources():
        if not any(path == home or home in path.parents for home in homes(methods.GENERATIVE)):
            if hits := names_generative(path):
                found[path.relative_to(ROOT).as_posix()] = hits[:3]
    assert not found, f"generative named outside its homes (move it into fedfusion/fusion/generative/, or read the registry): {found}"


def test_the_recipe_composes_each_entrys_section_after_fusion():
    """A method's recipe section is its entry's (``Method.section``): a field of ``Recipe`` under the method's name,
    after ``fusion``, read typed through ``Recipe.section``, its keys' choices checked with every recipe's, its
    mappings stated whole (``WHOLE``) as the common sections' are."""
    from dataclasses import fields

    from fedfusion.config.recipe import RECIPE_CHOICES, SECTIONS, WHOLE_MAPPINGS, Recipe

    assert SECTIONS == {m.name: hook(m.section) for m in METHODS if m.section}
    assert {"distill", "lora", "generative"} <= set(SECTIONS)  # and any method added with a section
    names = [f.name for f in fields(Recipe)]
    assert names[names.index("fusion") + 1:][:len(SECTIONS)] == list(SECTIONS)
    recipe = Recipe()
    for name, kind in SECTIONS.items():
        assert isinstance(getattr(recipe, name), kind) and recipe.section(kind) is getattr(recipe, name)
        for key, allowed in kind.CHOICES.items():
            assert RECIPE_CHOICES[f"{name}.{key}"] is allowed
        for key in getattr(kind, "WHOLE", ()):
            assert f"{name}.{key}" in WHOLE_MAPPINGS and isinstance(getattr(recipe.section(kind), key), dict)
    assert [k for k in WHOLE_MAPPINGS if k.partition(".")[0] in SECTIONS] == [
        "distill.families", "distill.tier_family", "lora.ranks", "lora.quantize"]
    with pytest.raises(KeyError, match="no method's recipe section"):
        recipe.section(type(recipe.fusion))


def test_a_methods_specs_are_the_wires():
    from fedfusion.wire.specs import SPEC_TYPES, spec_types

    declared = [hook(path) for m in METHODS for path in m.specs]
    assert declared and spec_types() == SPEC_TYPES + tuple(declared)


def test_the_generative_scan_finds_what_it_looks_for(tmp_path):
    code = tmp_path / "x.py"
    code.write_text('"""generative in a docstring is prose."""\nfrom a.generative.b import GenerativeSpec\n'
                    'def f(generative):\n    return x.generative, run_generative, "generative-model"\n')
    assert names_generative(code) == [(2, "GenerativeSpec"), (2, "a.generative.b"), (3, "generative"),
                                      (4, "generative"), (4, "generative-model"), (4, "run_generative")]


def test_the_grep_finds_what_it_looks_for(tmp_path):
    code = tmp_path / "x.py"
    code.write_text('A = "lora"\nif m == "units":\n    f(x="mixed", y=f"{m}/lora")\nUNITS_ACTION = "units"\n')
    assert literals(code) == [(1, "lora", "A"), (2, "units", ""), (3, "mixed", ""), (4, "units", "UNITS_ACTION")]


def test_every_whitelisted_literal_is_still_there():
    for rel, target in WHITELIST:
        assert any(t == target for _, _, t in literals(ROOT / rel)), (rel, target)


def test_every_home_exists():
    for entry in METHODS:
        for home in homes(entry.name):
            assert home.exists(), (entry.name, home)


@pytest.mark.parametrize("entry", METHODS, ids=lambda m: m.name)
def test_every_hook_of_an_entry_resolves(entry):
    for path in (entry.build, entry.plan, entry.mixed_plan, entry.report_note, entry.trained, entry.central):
        if path:
            assert hook(path) is not None
    for role, module in entry.roles:
        assert path_of(module).is_file(), (role, module)


def test_the_lists_are_the_registrys():
    assert choices.FUSION_METHODS == tuple(m.name for m in METHODS) == methods.FUSION_METHODS
    assert choices.MIXABLE == ("submodel", "distill", "generative")
    assert FOLD_ORDER == ("submodel", "lora", "generative", "distill")
    assert list(ROLES) == ["submodel", "window", "smallmodel", "lora", "generative", "units"]
    assert list(methods.SERVER_WORK) == ["distill", "generative"]  # a mixed run prices distillation first
    assert all(m.plan for m in METHODS), "fedfusion plan needs every method's view"
    assert all(m.build for m in METHODS if m.fold_rank is not None), "a folded method needs a builder"
    assert all(m.mixed_plan for m in METHODS if m.mixable), "a mixed plan needs every mixable method's rows"


def code_names(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every identifier (names, attributes, definitions, imports, arguments) and string constant in
    ``path``'s code, docstrings left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Name):
            found.append((line, node.id))
        elif isinstance(node, ast.Attribute):
            found.append((line, node.attr))
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            found.append((line, node.name))
        elif isinstance(node, ast.arg):
            found.append((line, node.arg))
        elif isinstance(node, ast.ImportFrom):
            found += [(line, node.module or "")] + [(line, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(line, a.name) for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found.append((line, node.value))
    return found


NAMES = set(BY_NAME) | set(ROLES)  # the methods and their client roles


def test_the_client_app_names_no_method():
    """The client app only dispatches (a role's node state is the role's own: fedfusion.clients.node): no method's
    or role's name, registry constant or module anywhere in its code."""
    client_app = ROOT / "fedfusion" / "client_app.py"
    named = [f"{line}: {text!r}" for line, text in code_names(client_app)
             if any(name in text.lower() for name in NAMES)]
    assert not named, "client_app.py names a method:\n" + "\n".join(named)


def test_the_method_grep_of_the_client_app_finds_what_it_looks_for(tmp_path):
    code = tmp_path / "x.py"
    code.write_text('"""about lora"""\nfrom fedfusion.config.methods import GENERATIVE\nimport fedfusion.clients.units\n'
                    'def f(keeps_window): return x.LoRASpec or "mixed"\n')
    names = sorted(text for _, text in code_names(code) if any(name in text.lower() for name in NAMES))
    assert names == ["GENERATIVE", "LoRASpec", "fedfusion.clients.units", "keeps_window", "mixed"], names


def test_every_role_names_its_node_state():
    """The client app loads and saves a role's ``Node`` (fedfusion.clients.node) around its ``train``: every role
    module defines one at its top level (read from the source: importing the LoRA role takes seconds)."""
    for role, module in ROLES.items():
        tree = ast.parse(path_of(module).read_text(encoding="utf-8"))
        top = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        top |= {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        assert "Node" in top, (role, module)


def test_every_message_type_of_a_role_has_a_handler():
    from fedfusion.client_app import app
    from fedfusion.wire.specs import ACTIONS

    for action, role in ACTIONS.items():
        assert f"train.{action}" in app._registered_funcs and hook(f"{ROLES[role]}:answer") is not None


def test_a_built_method_carries_its_registry_name():
    from fedfusion.fusion.distill.method import DistillMethod
    from fedfusion.fusion.generative.method import GenerativeMethod
    from fedfusion.fusion.lora.method import LoRAMethod
    from fedfusion.fusion.submodel.method import SubModelMethod

    for cls in (SubModelMethod, DistillMethod, LoRAMethod, GenerativeMethod):
        assert cls.name in FOLD_ORDER, cls
