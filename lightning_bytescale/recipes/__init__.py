"""The training recipes: the LightningModule they train, the Hydra schema and the YAML configs.

The YAML config groups ship inside the package (``lightning_bytescale/recipes/conf``), so
``bytescale-train`` works after a plain ``pip install``.  See ``docs/recipes.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> its module, imported on first access (PEP 562), so importing one module of
# this package does not import the others.
_LAZY: dict[str, str] = {
    "PretrainModule": "lightning_bytescale.recipes.module",
    "compose_pretrain": "lightning_bytescale.recipes.config",
    "register_configs": "lightning_bytescale.recipes.config",
}

__all__ = sorted(_LAZY, key=str.lower)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(__all__) | {name for name in globals() if name.startswith("__")})
