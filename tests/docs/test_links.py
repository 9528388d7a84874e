"""The docs point only at what the repository holds: every relative link in README.md and
docs/ names a file or folder that exists, and a link to a heading (`file.md#anchor`, `#anchor`)
names a heading that file has, as GitHub makes its anchors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces
    to `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text, not its target
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", doc.read_text()), flags=re.M):
        a = anchor(heading)
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")  # a repeated heading gets -1, -2...
    return out


def links(doc: Path) -> list[str]:
    return [
        t
        for t in LINK.findall(FENCE.sub("", doc.read_text()))
        if not re.match(r"^[a-z][a-z0-9+.-]*:", t)  # http:, https:, mailto:
    ]


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(REPO)))
def test_every_relative_link_resolves(doc: Path) -> None:
    broken = []
    for target in links(doc):
        path, _, fragment = target.partition("#")
        to = (doc.parent / path).resolve() if path else doc
        if not to.exists():
            broken.append(f"{target}: no {to.relative_to(REPO) if to.is_relative_to(REPO) else to}")
        elif fragment and to.suffix == ".md" and fragment not in anchors(to):
            broken.append(f"{target}: {to.name} has no heading with that anchor")
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)


def test_anchors_are_made_as_github_makes_them() -> None:
    assert anchor("Where a lone query's time goes, read from `Server-Timing`; AMD Zen 4 (x)") == (
        "where-a-lone-querys-time-goes-read-from-server-timing-amd-zen-4-x"
    )
    assert anchor("Bring a pretrained tower (`transformers`)") == (
        "bring-a-pretrained-tower-transformers"
    )
