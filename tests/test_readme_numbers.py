"""Numbers the README and docs/ quote come from the results files they cite: every number inside a block marked
``<!-- numbers: PATH -->`` ... ``<!-- /numbers -->`` (a paragraph, a sentence or a table cell) must appear in PATH,
a benchmark's markdown report (PATH from the repository root)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"<!-- numbers: (\S+) -->(.*?)<!-- /numbers -->", re.S)
NUMBER = re.compile(r"(?<![\w.])-?\d+\.\d+(?!\d|\.\d)")  # decimals (a unit may follow: 1.5x); counts and settings are not results


def blocks(text: str) -> list[tuple[str, str]]:
    return BLOCK.findall(text)


def test_the_readme_marks_its_measured_numbers():
    assert blocks((ROOT / "README.md").read_text(encoding="utf-8")), "no <!-- numbers: ... --> block in README.md"


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_number_in_a_marked_block_is_in_the_file_it_cites(doc):
    for path, body in blocks(doc.read_text(encoding="utf-8")):
        source = (ROOT / path).read_text(encoding="utf-8")
        missing = [n for n in NUMBER.findall(body) if n not in source]
        assert not missing, f"{doc.name} quotes {missing} as from {path}, which does not hold them"


def test_a_number_missing_from_its_file_is_caught(tmp_path):
    cited = tmp_path / "r.md"
    cited.write_text("| a | 0.123 |\n")
    body = "<!-- numbers: r.md -->the arm reaches 0.123, not 0.456, and is 2.5x faster.<!-- /numbers -->"
    [(path, text)] = blocks(body)
    assert [n for n in NUMBER.findall(text) if n not in cited.read_text()] == ["0.456", "2.5"]
