"""Every `fedfusion run|plan|deploy` command the README and docs/ show must load: recipe and overrides valid.

A command a new user copies from the docs and that exits 2 on a recipe error is a broken doc; this parses
each one with the CLI's own argument parser and loads its recipe as the CLI would (nothing runs).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from fedfusion.cli import parser
from fedfusion.fusion.submodel.plan import fit_widths
from fedfusion.run.check import load_checked

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"\bfedfusion (run|plan|deploy)\b")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # RECIPE, RUN_DIR: a synopsis, not a command to copy
SHELL_OPERATORS = {"&&", "||", ";", "|", ">", ">>", "2>&1"}
# Files the docs tell users to create themselves before the command that names them (docs/knowledge.md:
# `fedfusion facts my-facts` writes the facts pair; the README's data section asks for your own parquet file);
# the test stands them in (the facts as `fedfusion facts` writes them, for the command's clients; an empty file
# otherwise), so that the rest of the command (recipe, every other override) is still checked.
FACTS_FILES = {"my-facts/train.jsonl", "my-facts/probes.jsonl"}
USER_FILES = {*FACTS_FILES, "my-data/posts.parquet"}


def shown_commands(command: re.Pattern[str] = COMMAND) -> list[tuple[str, str]]:
    """(where, command text) for every fedfusion run/plan/deploy (or ``command``) in a fenced code block or an
    inline code span."""
    found = []
    for doc in DOCS:
        lines = doc.read_text(encoding="utf-8").splitlines()
        fenced, i = False, 0
        while i < len(lines):
            number, line = i + 1, lines[i]
            i += 1
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if fenced:
                while line.rstrip().endswith("\\") and i < len(lines):  # shell line continuation
                    line = line.rstrip()[:-1] + " " + lines[i].strip()
                    i += 1
                if (m := command.search(line)) is not None:
                    found.append((f"{doc.name}:{number}", line[m.start():]))
            else:
                for span in re.findall(r"`([^`]+)`", line):
                    if command.match(span):
                        found.append((f"{doc.name}:{number}", span))
    return found


def argv_of(command: str) -> list[str] | None:
    """The command's arguments after `fedfusion`, or None where the docs show no concrete command."""
    tokens = shlex.split(command, comments=True)
    for k, token in enumerate(tokens):
        if token in SHELL_OPERATORS:
            tokens = tokens[:k]
            break
    args = tokens[1:]
    if len(args) < 2:
        return None  # the subcommand named in prose (`fedfusion plan shows the whole table`)
    if args[1] == "/":
        return None  # a list of subcommands (`fedfusion run / plan / report / devices`), not a command
    if any(PLACEHOLDER.match(a) or a.startswith("[") for a in args[1:]):
        return None  # a synopsis (`fedfusion run RECIPE [key=value ...]`)
    return args


COMMANDS = shown_commands()


def test_the_docs_show_commands_to_check():
    checked = [c for _, c in COMMANDS if argv_of(c) is not None]
    assert len(checked) >= 8, checked
    assert any(c.startswith("fedfusion deploy") for c in checked)


def stand_in(path: Path, overrides: list[str]) -> None:
    """A user's file the docs name: a facts dataset for the command's ``population.num_clients``, else empty."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if str(path.relative_to(path.parents[1])) in FACTS_FILES:
        from fedfusion.data.facts import write_facts

        clients = next((int(o.partition("=")[2]) for o in overrides if o.startswith("population.num_clients=")), 16)
        write_facts(path.parent, clients, 2 * clients, seed=0)
    else:
        path.touch()


@pytest.mark.parametrize("where,command", COMMANDS, ids=[w for w, _ in COMMANDS])
@pytest.mark.usefixtures("lora_base_installed", "smollm2_config_dir")  # the docs ask users to install them before their commands
def test_shown_command_loads_its_recipe(where, command, tmp_path):
    argv = argv_of(command)
    if argv is None:
        pytest.skip("not a concrete command")
    args = parser().parse_args(argv)  # an unknown flag or a missing argument fails here
    if args.command == "run" and args.resume:
        return  # resumes a run directory the user made earlier, with its own recipe.yaml
    if args.recipe.startswith("runs/"):
        return  # a run directory's own recipe.yaml (`fedfusion run runs/x/recipe.yaml`): made by an earlier run
    overrides = []
    for item in args.overrides:
        key, _, value = item.partition("=")
        if value in USER_FILES:
            stand_in(tmp_path / value, args.overrides)
            item = f"{key}={tmp_path / value}"
        overrides.append(item)
    recipe = args.recipe if not args.recipe.endswith(".yaml") else str(ROOT / args.recipe)
    loaded = load_checked(recipe, overrides)  # RecipeError names the bad key
    if args.command != "plan":  # plan shows the fit, tiers that fit nothing included; a run stops on them
        fit_widths(loaded.fusion, loaded.train, loaded.population, loaded.model, loaded.data_source())


EDGE_CLOUD = shown_commands(re.compile(r"\bfedfusion edge-cloud\b"))


@pytest.mark.parametrize("where,command", EDGE_CLOUD, ids=[w for w, _ in EDGE_CLOUD])
def test_shown_edge_cloud_command_runs(where, command, tmp_path):
    """`fedfusion edge-cloud` prices from the catalog in well under a second, so the shown commands run whole
    (writing into a temporary folder instead of the one shown)."""
    from fedfusion.cli import main

    argv = argv_of(command)
    if argv is None:
        pytest.skip("not a concrete command")
    if "--out" in argv:
        argv[argv.index("--out") + 1] = str(tmp_path)
    assert main(argv) == 0
