"""Numbers the README and docs/ quote come from the results files they cite.

Two rules, both over decimal numbers (``8.163``, ``+0.49%``, ``1.5x``: counts and settings are integers or sit in code):

1. Marked blocks: every number inside ``<!-- numbers: PATH -->`` ... ``<!-- /numbers -->`` (a paragraph, a sentence
   or a table) must appear in PATH, a benchmark's report (PATH from the repository root).
2. Cited sentences: every other number must appear in one of the results files its sentence cites. A sentence cites
   a file by a markdown link to ``benchmarks/results/NAME.md`` (or ``.json``, a run's full record) or by holding a
   marked block of it. A sentence ends at ``.``, ``?`` or ``!`` followed by a capital letter, a bracket or ``*``; a
   paragraph, a list item, a heading and a table row each stand alone. Code (fenced blocks and inline spans) and
   link targets are not read: commands and file names are settings, not results.

In README.md and docs/*.md a number must also be somewhere a file backs it: in a marked block or in a sentence that
cites a file. A version, a default or a setting goes in code (``1.42``), where it is not read.
"Appear" allows rounding half up to the quoted decimals (7.20 quotes 7.195)."""

from __future__ import annotations

import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"<!-- numbers: (\S+) -->(.*?)<!-- /numbers -->", re.S)
# a decimal, signed unless it ends a range (the 4.8 of 2.5-4.8); a unit may follow (1.5x)
NUMBER = re.compile(r"(?:(?<![\w.\-])-)?(?<![\w.])\d+\.\d+(?!\d|\.\d)")
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
CODE = re.compile(r"`(?:[^`\n]|\n(?!\s*\n))*`")  # an inline span may wrap, not across a blank line
CITE = re.compile(r"\]\(([^)\s#]*benchmarks/results/[^)\s#]+\.(?:md|json))(?:#[^)]*)?\)")
TARGET = re.compile(r"\]\([^)\s]*\)")
MARK = re.compile(r"\x00([^\x00]+)\x00")  # a marked block, reduced to its path
SENTENCE_END = re.compile(r"(?<=[.?!])\s+(?=[A-Z*(\[\x00])")
ITEM = re.compile(r"\n(?=\s*(?:[-*] |\d+\. |#))")


def blocks(text: str) -> list[tuple[str, str]]:
    return BLOCK.findall(text)


def held(quoted: str, source: str) -> bool:
    """``quoted`` is a number of ``source`` or one of them rounded (half up) to its decimals: 7.20 quotes 7.195, but
    1.00 does not quote 11.005."""
    step = Decimal(1).scaleb(-len(quoted.split(".")[1]))
    return any(Decimal(n).quantize(step, ROUND_HALF_UP) == Decimal(quoted) for n in NUMBER.findall(source)
               if len(n.split(".")[1]) >= len(quoted.split(".")[1]))


def sentences(text: str) -> list[str]:
    """The units rule 2 reads: code blanked, every marked block reduced to ``\\x00PATH\\x00``."""
    text = BLOCK.sub(lambda m: f"\x00{m.group(1)}\x00", FENCE.sub("", text))
    text = CODE.sub(" ", text)
    units: list[str] = []
    for paragraph in re.split(r"\n\s*\n", text):
        if paragraph.lstrip().startswith("|"):
            units += paragraph.splitlines()
            continue
        for item in ITEM.split(paragraph):
            units += SENTENCE_END.split(item)
    return units


def cited_numbers(doc: Path, text: str) -> list[tuple[str, list[Path], str]]:
    """Per sentence outside marked blocks: its numbers, the files it cites (paths resolved from ``doc``) and its text."""
    out = []
    for unit in sentences(text):
        cites = [(doc.parent / p).resolve() for p in CITE.findall(unit)]
        cites += [(ROOT / p).resolve() for p in MARK.findall(unit)]
        numbers = NUMBER.findall(TARGET.sub("]", MARK.sub(" ", unit)))
        if numbers:
            out.append((" ".join(unit.split()), cites, numbers))
    return out


def unheld(doc: Path, text: str) -> list[str]:
    """Rule 2's failures: a sentence's numbers that none of the files it cites holds."""
    failures = []
    for unit, cites, numbers in cited_numbers(doc, text):
        if not cites:
            continue
        sources = [p.read_text(encoding="utf-8") for p in cites if p.is_file()]
        missing = [n for n in numbers if not any(held(n, s) for s in sources)]
        if missing or len(sources) < len(cites):
            names = ", ".join(p.name for p in cites)
            failures.append(f"{missing} not in {names}: {unit[:160]}")
    return failures


def test_the_readme_marks_its_measured_numbers():
    assert blocks((ROOT / "README.md").read_text(encoding="utf-8")), "no <!-- numbers: ... --> block in README.md"


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_number_in_a_marked_block_is_in_the_file_it_cites(doc):
    for path, body in blocks(doc.read_text(encoding="utf-8")):
        source = (ROOT / path).read_text(encoding="utf-8")
        missing = [n for n in NUMBER.findall(body) if not held(n, source)]
        assert not missing, f"{doc.name} quotes {missing} as from {path}, which does not hold them"


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_number_in_a_sentence_that_cites_a_results_file_is_in_that_file(doc):
    failures = unheld(doc, doc.read_text(encoding="utf-8"))
    assert not failures, f"{doc.name}:\n" + "\n".join(failures)


def bare(doc: Path, text: str) -> list[str]:
    """Numbers in no marked block and in no sentence that cites a results file, with their sentences."""
    return [f"{numbers}: {unit[:160]}" for unit, cites, numbers in cited_numbers(doc, text) if not cites]


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_number_has_a_file_behind_it(doc):
    uncited = bare(doc, doc.read_text(encoding="utf-8"))
    for line in uncited:
        print(f"{doc.relative_to(ROOT)}: {line}")
    assert not uncited, (f"{doc.name} numbers in no marked block and no sentence citing a results file:\n"
                         + "\n".join(uncited))


def test_a_number_missing_from_its_file_is_caught(tmp_path):
    cited = tmp_path / "r.md"
    cited.write_text("| a | 0.123 |\n")
    body = "<!-- numbers: r.md -->the arm reaches 0.123, not 0.456, and is 2.5x faster.<!-- /numbers -->"
    [(path, text)] = blocks(body)
    assert [n for n in NUMBER.findall(text) if not held(n, cited.read_text())] == ["0.456", "2.5"]
    assert held("7.20", "7.195 ± 0.243") and held("0.24", "7.195 ± 0.243") and held("0.243", "7.195 ± 0.243")
    assert not held("1.00", "11.005") and not held("0.2", "10.243") and not held("7.2", "7.149")
    assert NUMBER.findall("1.3-2.5x, -0.119 and x-1.5") == ["1.3", "2.5", "-0.119", "1.5"]


def test_a_number_outside_a_block_is_checked_against_the_file_its_sentence_cites(tmp_path):
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "r.md").write_text("| a | 0.123 | 9.5 |\n")
    doc = tmp_path / "README.md"
    text = ("The arm ends at 0.123 and 9.75 ([r.md](benchmarks/results/r.md)). Another sentence says 4.56 and cites "
            "nothing. In code `--lr 0.003` is a setting ([r.md](benchmarks/results/r.md#x)).\n\n"
            "| arm | value |\n|---|---|\n| a | 0.124 ([r](benchmarks/results/r.md)) |\n| b | 7.7 |\n\n"
            "- a list item: 9.5 ([r](benchmarks/results/missing.md))\n")
    failures = unheld(doc, text)
    assert len(failures) == 3, failures
    assert "['9.75']" in failures[0] and "['0.124']" in failures[1] and "missing.md" in failures[2]
    uncited = [numbers for unit, cites, numbers in cited_numbers(doc, text) if not cites]
    assert uncited == [["4.56"], ["7.7"]]
