"""Every relative link in README.md and docs/ points to a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ROOT

PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

# [text](target) and ![alt](target), with an optional "title"; and [label]: target definitions.
INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def relative_links(text: str) -> list[str]:
    """The targets of the page's links that name a file: code is left out, and so are
    links to other sites and to anchors of the page itself."""
    prose = CODE_SPAN.sub("", FENCE.sub("", text))
    targets = INLINE.findall(prose) + DEFINITION.findall(prose)
    return [t for t in targets if not EXTERNAL.match(t) and not t.startswith("#")]


def test_the_pages_are_found() -> None:
    """The pages checked are those on disk, found in docs/ and its subfolders alike: a
    glob that stopped matching would leave the link test checking nothing."""
    found = {str(page.relative_to(ROOT)) for page in PAGES if page.is_file()}
    assert {"README.md", "docs/architecture.md", "docs/serving.md",
            "docs/workloads/README.md", "docs/workloads/speech.md"} <= found
    assert len(found) == len(PAGES)


def test_links_are_found_outside_code() -> None:
    text = ("[a](docs/a.md#x) ![b](img/b.png \"title\") [c](https://example.com) [d](#here)\n"
            "`[e](not-a-link.md)`\n```\n[f](not-either.md)\n```\n[g]: ref/g.md\n")
    assert relative_links(text) == ["docs/a.md#x", "img/b.png", "ref/g.md"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_point_to_existing_files(page: Path) -> None:
    missing = []
    for target in relative_links(page.read_text()):
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"
