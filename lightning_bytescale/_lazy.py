"""Names a package loads from their modules on first use (PEP 562), so importing it stays cheap.

A package ``__init__`` keeps a ``_LAZY`` table (public name -> the module that defines it) and
takes its module-level ``__getattr__`` (and, where wanted, ``__dir__``) from here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(
    namespace: dict[str, Any], names: Mapping[str, str], *, cache: bool = False
) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports each name of ``names`` from its module when first asked for.

    ``namespace`` is the package's ``globals()``; with ``cache`` the value is stored there, so
    later lookups no longer reach this function.
    """
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        if cache:
            namespace[name] = value
        return value

    return __getattr__


def public_dir(namespace: dict[str, Any]) -> Callable[[], list[str]]:
    """A module ``__dir__``: the package's ``__all__`` (read when called) and its dunder names."""

    def __dir__() -> list[str]:
        return sorted(set(namespace["__all__"]) | {name for name in namespace if name.startswith("__")})

    return __dir__
