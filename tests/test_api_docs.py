"""docs/api.md is generated from the package: the generator's rules, and the page covers every public name."""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gen() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("gen_api_docs", ROOT / "scripts" / "gen_api_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def _module(name: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__["__name__"] = name
    exec(compile(source, name, "exec"), module.__dict__)
    return module


def test_public_names_follow_all_else_own_definitions_and_lazy_names(gen):
    declared = _module("m_all", "__all__ = ['b', 'A', '_hidden']\nA = 1\nb = 2\n_hidden = 3\nc = 4\n")
    assert gen.public_names(declared) == ["A", "b"]
    implicit = _module(
        "m_own",
        "from os.path import join\n_LAZY = {'Later': ('x', 'y')}\n"
        "class Mine: pass\ndef helper(): pass\ndef _private(): pass\nCONSTANT = 3\n",
    )
    assert gen.public_names(implicit) == ["helper", "Later", "Mine"]  # not `join` (imported), not CONSTANT


def test_first_sentence_and_signatures(gen):
    assert (
        gen.first_sentence("Plan one batch, e.g. 8 ranks. Then more.\n\nBody.")
        == "Plan one batch, e.g. 8 ranks."
    )
    assert gen.first_sentence("Data: sources,\n   tokenizers.") == "Data: sources, tokenizers."
    assert (
        gen.first_sentence("Calls :func:`attention` and :class:`~x.Plan`.")
        == "Calls `attention` and `x.Plan`."
    )
    assert gen.first_sentence("a | b") == "a \\| b"
    assert gen.first_sentence(None) == ""

    def f(x: int, *, scale: float | None = None) -> str:
        return ""

    assert gen.signature_of("f", f) == "f(x: int, *, scale: float | None = None) -> str"
    assert gen.signature_of("LIMIT", 3) == "LIMIT = 3"
    assert gen.kind_of(ValueError) == "exception"


def test_the_page_lists_every_public_name_of_every_module(gen):
    page = (ROOT / "docs" / "api.md").read_text()
    sections = dict(re.findall(r"\n## `([\w.]+)`\n(.*?)(?=\n## |\Z)", page, flags=re.S))
    missing = []
    for name in gen.module_names():
        module = importlib.import_module(name)
        if name not in sections:
            missing.append(f"section {name}")
            continue
        missing += [
            f"{name}.{attr}" for attr in gen.public_names(module) if f"| `{attr}` |" not in sections[name]
        ]
    assert not missing, f"docs/api.md is stale, run `python scripts/gen_api_docs.py`; missing: {missing}"
