"""One error tree: every exception the package defines is a ``ByteScaleError``, one class per condition.

The test imports every module of the package (so every class is defined), then walks
``ByteScaleError.__subclasses__()`` recursively and every module's namespace: each class derives
from ``ByteScaleError``, has a docstring of its own and a name no other class has; the only
second names are the documented backwards-compatible aliases of the same class; and
``docs/troubleshooting.md`` lists every class.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import lightning_bytescale
from lightning_bytescale.errors import ByteScaleError, ConfigError, PlanDivergenceError

ROOT = Path(__file__).resolve().parents[1]

# Not a ByteScaleError on purpose: a stop signal must not be caught by ``except Exception``.
NOT_ERRORS = {"lightning_bytescale.lightning.preemption.PreemptedError"}
# Documented second names of one class (docs/troubleshooting.md), kept for existing ``except``s.
ALIASES = {"ByteScaleConfigError": ConfigError, "DivergentPlanError": PlanDivergenceError}


def _all_modules() -> list:
    modules = [lightning_bytescale]
    for info in pkgutil.walk_packages(lightning_bytescale.__path__, "lightning_bytescale."):
        if info.name.endswith("__main__"):
            continue  # running it is the command line itself
        if info.name.startswith("lightning_bytescale.hf"):
            pytest.importorskip("transformers")
        modules.append(importlib.import_module(info.name))
    return modules


@pytest.fixture(scope="module")
def modules() -> list:
    return _all_modules()


def _subclasses(cls: type) -> list[type]:
    found, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                todo.append(sub)
    return found


@pytest.fixture(scope="module")
def tree(modules) -> list[type]:
    return [c for c in _subclasses(ByteScaleError) if c.__module__.startswith("lightning_bytescale")]


def test_every_exception_class_the_package_defines_is_a_bytescale_error(modules):
    outside = []
    for module in modules:
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.__name__
                and f"{obj.__module__}.{obj.__qualname__}" not in NOT_ERRORS
                and not issubclass(obj, ByteScaleError)
            ):
                outside.append(f"{module.__name__}.{name}")
    assert not outside, f"exception classes outside the ByteScaleError tree: {outside}"


def test_class_names_are_unique_and_every_class_has_its_own_docstring(tree):
    names = [c.__name__ for c in tree]
    assert len(tree) >= 20, names
    duplicates = sorted({n for n in names if names.count(n) > 1})
    assert not duplicates, f"two classes share a name: {duplicates}"
    undocumented = [c.__name__ for c in tree if not (c.__dict__.get("__doc__") or "").strip()]
    assert not undocumented, f"error classes without a docstring: {undocumented}"


def test_the_only_second_names_are_the_documented_aliases(modules, tree):
    aliases = {}
    for module in modules:
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and obj in tree and name != obj.__name__:
                aliases.setdefault(name, obj)
    assert aliases == ALIASES


def test_there_is_one_non_finite_and_one_dead_peer_class(tree):
    names = [c.__name__ for c in tree]
    assert names.count("NonFiniteError") == 1 and names.count("PeerFailureError") == 1
    assert not [n for n in names if "Peer" in n and n != "PeerFailureError"]


def test_troubleshooting_lists_every_class_and_alias(tree):
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    missing = [n for n in [c.__name__ for c in tree] + list(ALIASES) if f"`{n}`" not in page]
    assert not missing, f"docs/troubleshooting.md's error tree lacks {missing}"
