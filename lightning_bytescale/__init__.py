"""lightning-bytescale: ByteScale Hybrid Data Parallelism for PyTorch Lightning.

``import lightning_bytescale`` registers the strategy names ``bytescale``, ``bytescale_spawn``
and ``bytescale_fork`` with Lightning, so ``Trainer(strategy="bytescale")`` works.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "attention": ("lightning_bytescale.attention", "attention"),
    "attention_context": ("lightning_bytescale.attention", "attention_context"),
    "token_loss": ("lightning_bytescale.engine.loss", "token_loss"),
    "ByteScaleStrategy": ("lightning_bytescale.strategy", "ByteScaleStrategy"),
    "ByteScaleDataModule": ("lightning_bytescale.data.datamodule", "ByteScaleDataModule"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'lightning_bytescale' has no attribute {name!r}")


def _register_strategies() -> None:
    try:
        importlib.import_module("lightning_bytescale.strategy")
    except ModuleNotFoundError as err:  # pragma: no cover - only while the package is being built
        if err.name != "lightning_bytescale.strategy":
            raise


_register_strategies()
