"""The documentation stays a guide a user reads (issue 40): every page under docs/ (docs/history/ excepted,
the record of how numbers moved) is at most MAX_PROSE_LINES lines of prose, every relative link in the README
and in docs/ points to a file that exists, and docs/index.md lists every page.

The line rule: a page's prose lines are its non-blank lines outside fenced code blocks and outside tables
(lines starting with `|`). Tables and commands are what a reader looks up, not what they read through, so
they are not counted; the page as a whole is also held to MAX_TOTAL_LINES so that tables cannot grow without
bound either."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MAX_PROSE_LINES = 300
MAX_TOTAL_LINES = 450
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def pages() -> list[Path]:
    return sorted(p for p in DOCS.glob("*.md"))


def prose_lines(text: str) -> int:
    count, fenced = 0, False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
            continue
        if fenced or not stripped or stripped.startswith("|"):
            continue
        count += 1
    return count


def relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # links inside code are not links
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:|#|/", t)]


def test_prose_lines_rule():
    text = "# T\n\nprose\n\n| a |\n|---|\n```bash\ncode\n```\nmore\n"
    assert prose_lines(text) == 3


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_page_is_short(page):
    text = page.read_text()
    assert prose_lines(text) <= MAX_PROSE_LINES, (
        f"{page.relative_to(ROOT)} has {prose_lines(text)} prose lines (limit {MAX_PROSE_LINES}): move history to "
        "docs/history/ and keep the page a guide to the present")
    assert len(text.splitlines()) <= MAX_TOTAL_LINES, f"{page.relative_to(ROOT)}: over {MAX_TOTAL_LINES} lines"


@pytest.mark.parametrize("page", [ROOT / "README.md", *pages(), *sorted((DOCS / "history").glob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_exist(page):
    missing = [t for t in relative_links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_index_lists_every_page():
    index = DOCS / "index.md"
    listed = {(DOCS / t.split("#")[0]).resolve() for t in relative_links(index)}
    every = {p.resolve() for p in [*pages(), *(DOCS / "history").glob("*.md")] if p != index}
    unlisted = sorted(str(p.relative_to(ROOT)) for p in every - listed)
    assert not unlisted, f"docs/index.md does not list: {unlisted}"
