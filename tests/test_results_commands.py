"""Every result in ``benchmarks/results/`` names the command that wrote it, and that command runs on today's code.

The convention (benchmarks/results_files.py writes it; docs of a benchmark's report follow it):

- a result's markdown holds one or more lines that start ``Command: `...` ``: the whole command, one per line, in
  backticks; the first such line is the command that wrote the file (for a report of cached runs, the command that
  runs them), later ones the re-render that wrote it from cached runs, earlier invocations whose runs it holds, or
  the command that drew a figure it names;
- its JSON, where it is a mapping, holds ``"command"``: one of the markdown's commands, word for word;
- any other file (a figure) shares the stem of a markdown, or is named by one;
- a result measured on code or recipes that no longer exist moves to ``benchmarks/results/archive/``, its markdown's
  first line ``Archived: <what changed since>``; archived files are not checked further;
- no file holds an absolute path of one machine (``/work/``, ``/home/``, ``/tmp/``, ``/root/``, ``/Users/``).

A command is checked without running it: ``python benchmarks/X.py ...`` parses with the script's own
``build_parser()`` (and the script's ``check_args(args)`` where its arms are not argparse choices); a recipe it names
(``--recipe``, a positional ``recipe``, the script's ``RECIPE``) exists and its ``key=value`` overrides load onto it;
``fedfusion ...`` / ``python -m fedfusion ...`` parses with the CLI's parser, and ``run`` / ``plan`` / ``deploy`` load
their recipe with their overrides. No Flower runtime is started; the script imports take seconds (torch, Flower).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import shlex
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
ARCHIVE = RESULTS / "archive"
COMMAND = re.compile(r"^Command: `([^`]+)`", re.M)
ARCHIVED = "Archived: "
ABSOLUTE = re.compile(rb"(?<![\w.~/-])/(?:work|home|tmp|root|Users)/")
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def result_files() -> list[Path]:
    """Every file of the results folder outside ``archive/``."""
    return sorted(p for p in RESULTS.iterdir() if p.is_file())


def commands(md: Path) -> list[str]:
    return COMMAND.findall(md.read_text(encoding="utf-8"))


def all_commands() -> list[tuple[str, str]]:
    """(markdown name, command) for every command of every markdown result."""
    return [(md.name, c) for md in result_files() if md.suffix == ".md" for c in commands(md)]


def words(command: str) -> list[str]:
    """The command's words without a leading ``nice -n N`` and environment assignments."""
    argv = shlex.split(command)
    while argv and (argv[0] == "nice" or ENV.match(argv[0])):
        argv = argv[3:] if argv[0] == "nice" and argv[1:2] == ["-n"] else argv[1:]
    return argv


def parse_quietly(parser, argv: list[str]):
    """``parser.parse_args(argv)``, its usage error returned as text instead of exiting."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parser.parse_args(argv), ""
        except SystemExit:
            return None, err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "exit"


def recipe_problem(recipe: str | None, overrides: list[str]) -> str:
    """Why ``recipe`` with ``overrides`` does not load ("" when it does)."""
    from fedfusion.config.recipe import load_recipe, resolve_recipe_path
    from fedfusion.config.sections import RecipeError

    if recipe is None:
        return ""
    try:
        if overrides:
            load_recipe(recipe, overrides)
        else:
            resolve_recipe_path(recipe)
    except RecipeError as exc:
        return str(exc) if str(exc).startswith("recipe ") else f"recipe {recipe!r}: {exc}"
    return ""


def load_script(name: str) -> ModuleType:
    """The benchmark script ``benchmarks/<name>.py`` as a module (importing runs none: each works under ``main``)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def problem(command: str) -> str:
    """Why ``command`` would not run on today's code ("" when it would, as far as parsing tells)."""
    argv = words(command)
    if argv[:3] in (["python", "-m", "fedfusion"], ["python3", "-m", "fedfusion"]):
        argv = ["fedfusion", *argv[3:]]
    if argv[:1] == ["fedfusion"]:
        from fedfusion.cli import parser

        args, error = parse_quietly(parser(), argv[1:])
        if args is None:
            return f"fedfusion: {error}"
        if args.command in ("run", "plan", "deploy"):
            return recipe_problem(args.recipe, args.overrides)
        return ""
    if argv[:1] not in (["python"], ["python3"]) or len(argv) < 2 or not argv[1].startswith("benchmarks/"):
        return "neither `python benchmarks/X.py ...` nor `fedfusion ...` / `python -m fedfusion ...`"
    script = ROOT / argv[1]
    if not script.is_file() or script.suffix != ".py":
        return f"no script {argv[1]}"
    module = load_script(script.stem)
    if not hasattr(module, "build_parser"):
        return f"{argv[1]} has no build_parser()"
    script_parser = module.build_parser()
    script_parser.prog = argv[1]
    args, error = parse_quietly(script_parser, argv[2:])
    if args is None:
        return error
    if hasattr(module, "check_args") and (bad := module.check_args(args)):
        return f"{argv[1]}: {bad}"
    recipe = getattr(args, "recipe", None) or getattr(module, "RECIPE", None)
    return recipe_problem(recipe, [o for o in getattr(args, "overrides", None) or [] if "=" in o])


@pytest.fixture(scope="module", autouse=True)
def _benchmark_scripts_imported_here_only():
    """The scripts import each other by bare name (benchmarks/ on sys.path): take that path and the scripts' modules
    (``units``, ``selection``, ...) back out after this module, so no later test imports one by accident."""
    path = list(sys.path)
    yield
    sys.path[:] = path
    for name, module in list(sys.modules.items()):
        if Path(getattr(module, "__file__", None) or "/").parent == BENCHMARKS:
            del sys.modules[name]


def test_every_markdown_result_names_its_command():
    missing = [md.name for md in result_files() if md.suffix == ".md" and not commands(md)]
    assert not missing, f"results without a `Command: `...`` line: {missing}"


def test_every_json_result_names_its_markdowns_command():
    bad = []
    for js in (p for p in result_files() if p.suffix == ".json"):
        md = js.with_suffix(".md")
        if not md.is_file():
            bad.append(f"{js.name}: no {md.name} beside it")
            continue
        data = json.loads(js.read_text(encoding="utf-8"))
        if isinstance(data, dict) and data.get("command") not in commands(md):
            bad.append(f"{js.name}: command {data.get('command')!r} is none of {md.name}'s")
    assert not bad, "\n".join(bad)


def test_every_other_result_belongs_to_a_markdown():
    mds = {p.stem: p.read_text(encoding="utf-8") for p in result_files() if p.suffix == ".md"}
    orphans = [p.name for p in result_files() if p.suffix not in (".md", ".json")
               and p.stem not in mds and not any(p.name in text for text in mds.values())]
    assert not orphans, f"files no markdown result names: {orphans}"


def test_no_result_holds_an_absolute_machine_path():
    bad = [f"{p.relative_to(RESULTS)}: {m.group().decode()}..." for p in sorted(RESULTS.rglob("*")) if p.is_file()
           for m in [ABSOLUTE.search(p.read_bytes())] if m]
    assert not bad, f"absolute machine paths (give repository-relative ones): {bad}"


def test_every_archived_result_says_what_changed():
    """Each archived file has a markdown of its stem (itself, or a note beside a JSON or figure) that opens with it."""
    files = sorted(p for p in ARCHIVE.iterdir() if p.is_file()) if ARCHIVE.is_dir() else []
    bad = [p.name for p in files if not (p.with_suffix(".md").is_file()
                                         and p.with_suffix(".md").read_text(encoding="utf-8").startswith(ARCHIVED))]
    assert not bad, f"archived results without a `{ARCHIVED}<what changed since>` first line in their markdown: {bad}"


def test_the_command_parser_catches_a_broken_command():
    """The checks below can fail: a missing script, an unknown flag or arm, a missing recipe, an unknown key."""
    assert problem("python benchmarks/no_such_script.py")
    assert problem("python benchmarks/quickstart_policies.py --no-such-flag")
    assert problem("python benchmarks/quickstart_policies.py --arms no-such-arm")
    assert problem("python benchmarks/knowledge.py --arms no_such_arm")
    assert problem("python benchmarks/overhead.py no_such_recipe")
    assert problem("fedfusion run no_such_recipe")
    assert problem("fedfusion run rolling no_such.key=1")
    assert problem("python benchmarks/quickstart_policies.py --recipe rolling train.no_such_key=1")
    assert not problem("nice -n 10 python benchmarks/quickstart_policies.py --recipe rolling rounds=2")
    assert not problem("python -m fedfusion run rolling rounds=2 --out runs/x")


COMMANDS = all_commands()


@pytest.mark.slow  # seconds: imports every benchmark script (torch, transformers, Flower)
@pytest.mark.parametrize(("md", "command"), COMMANDS,
                         ids=[f"{md}:{sum(m == md for m, _ in COMMANDS[:i])}" for i, (md, _) in enumerate(COMMANDS)])
def test_every_command_runs_on_todays_code(md: str, command: str):
    why = problem(command)
    assert not why, f"{md}: `{command}`: {why}"
