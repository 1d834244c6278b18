"""Every relative link in the project's Markdown points at a file that exists, and at a heading that exists.

Anchors follow GitHub's rule: the heading text in lower case, without characters other than
letters, digits, spaces, hyphens and underscores, spaces turned into hyphens, and ``-1``,
``-2``, ... for repeated headings.  Links and headings inside fenced code blocks do not count.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: Counter[str] = Counter()
    found = set()
    for line in prose_lines(page.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        found.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return found


def test_slug_follows_github():
    assert slug("Loggers and W&B") == "loggers-and-wb"
    assert (
        slug("How do I log a per-step sum from `training_step`?")
        == "how-do-i-log-a-per-step-sum-from-training_step"
    )
    assert slug("## `lightning_bytescale.hf`".lstrip("# ")) == "lightning_bytescalehf"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for line in prose_lines(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(
                    f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}"
                )
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)} has broken links: {broken}"
