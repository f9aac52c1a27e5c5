"""The user-facing pages: every relative link resolves (file and heading), and the README stays a short page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(
    [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "README.md", *ROOT.glob("docs/*.md")]
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def _links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(FENCE.sub("", page.read_text()))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_slug_matches_githubs():
    assert _slug("Collective fusion (Inductor)") == "collective-fusion-inductor"
    assert _slug("The bundled example's report and real targets") == "the-bundled-examples-report-and-real-targets"
    assert _slug("`data_parallel`") == "data_parallel"


def test_readme_is_a_short_page():
    """Reference lives in docs/, figures in benchmarks/README.md; the README is what a newcomer reads first."""
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines; move reference to docs/ and figures to benchmarks/README.md"


def test_graph_break_hints_point_at_an_existing_section():
    from dynamo_ext import graph_breaks

    match = re.search(r"See (\S+), '([^']+)'", graph_breaks.SEE_DOCS)
    assert match, graph_breaks.SEE_DOCS
    page, section = ROOT / match.group(1), match.group(2)
    assert page.exists() and _slug(section) in _anchors(page), graph_breaks.SEE_DOCS
