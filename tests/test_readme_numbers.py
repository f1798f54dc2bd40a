"""Numbers the README and docs/ quote come from the results files they cite: every number inside a block marked
``<!-- numbers: PATH -->`` ... ``<!-- /numbers -->`` (a paragraph, a sentence or a table cell) must appear in PATH,
a benchmark's markdown report (PATH from the repository root)."""

from __future__ import annotations

import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"<!-- numbers: (\S+) -->(.*?)<!-- /numbers -->", re.S)
NUMBER = re.compile(r"(?<![\w.])-?\d+\.\d+(?!\d|\.\d)")  # decimals (a unit may follow: 1.5x); counts and settings are not results


def blocks(text: str) -> list[tuple[str, str]]:
    return BLOCK.findall(text)


def held(quoted: str, source: str) -> bool:
    """``quoted`` is a number of ``source`` or one of them rounded (half up) to its decimals: 7.20 quotes 7.195, but
    1.00 does not quote 11.005."""
    step = Decimal(1).scaleb(-len(quoted.split(".")[1]))
    return any(Decimal(n).quantize(step, ROUND_HALF_UP) == Decimal(quoted) for n in NUMBER.findall(source)
               if len(n.split(".")[1]) >= len(quoted.split(".")[1]))


def test_the_readme_marks_its_measured_numbers():
    assert blocks((ROOT / "README.md").read_text(encoding="utf-8")), "no <!-- numbers: ... --> block in README.md"


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_number_in_a_marked_block_is_in_the_file_it_cites(doc):
    for path, body in blocks(doc.read_text(encoding="utf-8")):
        source = (ROOT / path).read_text(encoding="utf-8")
        missing = [n for n in NUMBER.findall(body) if not held(n, source)]
        assert not missing, f"{doc.name} quotes {missing} as from {path}, which does not hold them"


def test_a_number_missing_from_its_file_is_caught(tmp_path):
    cited = tmp_path / "r.md"
    cited.write_text("| a | 0.123 |\n")
    body = "<!-- numbers: r.md -->the arm reaches 0.123, not 0.456, and is 2.5x faster.<!-- /numbers -->"
    [(path, text)] = blocks(body)
    assert [n for n in NUMBER.findall(text) if not held(n, cited.read_text())] == ["0.456", "2.5"]
    assert held("7.20", "7.195 ± 0.243") and held("0.24", "7.195 ± 0.243") and held("0.243", "7.195 ± 0.243")
    assert not held("1.00", "11.005") and not held("0.2", "10.243") and not held("7.2", "7.149")
