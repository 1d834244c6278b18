"""Every ``lightning_bytescale`` name the README and docs mention exists, spelled as written.

A dotted name (``lightning_bytescale.sim.step_lower_bound``) and every name of a
``from lightning_bytescale... import a, b`` line, in prose and in code blocks alike, must import
(the longest importable module prefix, then attributes).  A renamed or moved name then fails
here instead of in a reader's first paste.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOTTED = re.compile(r"\blightning_bytescale(?:\.[A-Za-z_]\w*)+")
FROM_IMPORT = re.compile(
    r"from (lightning_bytescale(?:\.[A-Za-z_]\w*)*) import (?:\(([^)]*)\)|([A-Za-z_][\w, ]*))"
)


def mentioned_names(text: str) -> set[str]:
    names = set(DOTTED.findall(text))
    for match in FROM_IMPORT.finditer(text):
        for item in (match.group(2) or match.group(3)).split(","):
            name = item.split("#")[0].strip().split(" as ")[0].strip()
            if name:
                names.add(f"{match.group(1)}.{name}")
    return names


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_name_a_page_mentions_exists(page):
    missing = sorted(n for n in mentioned_names(page.read_text()) if not resolves(n))
    assert not missing, f"{page.name} mentions names that do not exist: {missing}"


def test_the_extractor_finds_dotted_and_imported_names_and_missing_ones_fail():
    text = (
        "Use `lightning_bytescale.sim.step_lower_bound`.\n"
        "```python\nfrom lightning_bytescale import (\n    ByteScaleStrategy,\n    token_loss,  # the loss\n)\n"
        "from lightning_bytescale.planner import make_plan as plan\n```\n"
    )
    assert mentioned_names(text) == {
        "lightning_bytescale.sim.step_lower_bound",
        "lightning_bytescale.ByteScaleStrategy",
        "lightning_bytescale.token_loss",
        "lightning_bytescale.planner",  # the module of the second import, itself a dotted name
        "lightning_bytescale.planner.make_plan",
    }
    assert all(resolves(n) for n in mentioned_names(text))
    assert not resolves("lightning_bytescale.sim.no_such_name")
    assert not resolves("lightning_bytescale.no_such_module.name")
