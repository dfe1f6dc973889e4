"""docs/notes/: one short page per decision, each indexed once in its README and each citing
the commits that hold its evidence (the run logs live in git history, not in the tree)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

NOTES = Path(__file__).resolve().parents[1] / "docs" / "notes"
INDEX = NOTES / "README.md"
PAGES = sorted(page for page in NOTES.glob("*.md") if page != INDEX)
MAX_LINES = 60
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")
LINK = re.compile(r"\]\(([^)#]+)(?:#[^)]*)?\)")


def test_the_index_lists_every_page_once_and_nothing_else() -> None:
    linked = LINK.findall(INDEX.read_text(encoding="utf-8"))
    assert sorted(linked) == sorted(page.name for page in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=[page.stem for page in PAGES])
def test_a_page_is_short_and_cites_its_evidence_by_commit(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert text.startswith("# "), f"{page.name}: no title"
    assert len(text.splitlines()) <= MAX_LINES, f"{page.name}: over {MAX_LINES} lines"
    evidence = text[text.find("**Evidence:**"):] if "**Evidence:**" in text else ""
    assert COMMIT.search(evidence), f"{page.name}: no **Evidence:** naming a commit"


@pytest.mark.parametrize("page", PAGES, ids=[page.stem for page in PAGES])
def test_a_page_links_only_to_files_that_exist(page: Path) -> None:
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        assert (page.parent / target).exists(), f"{page.name}: broken link {target}"
