"""The docs stay readable: a README that shows the API early and stays short, results pages
of current facts within their size, and no figure that nothing shows or that is missing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_the_readme_shows_the_api_in_its_first_60_lines_and_stays_short():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 12 * 1024
    head = "\n".join(text.splitlines()[:60])
    assert "ubep.Buffer(" in head and "buf.dispatch(" in head and "buf.combine(" in head
    assert "pip install ubep" in head


def test_the_docs_stay_within_their_sizes():
    pages = sorted(DOCS.rglob("*.md"))
    assert sum(p.stat().st_size for p in pages) <= 150 * 1024
    for page in (DOCS / "results").glob("*.md"):
        assert page.stat().st_size <= 20 * 1024, page.name


def test_every_figure_is_shown_and_every_figure_shown_exists():
    shown = set()
    for page in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        shown |= set(re.findall(r"figures/([\w.-]+\.png)", page.read_text()))
    on_disk = {p.name for p in (DOCS / "figures").glob("*.png")}
    assert shown == on_disk, (sorted(shown - on_disk), sorted(on_disk - shown))
