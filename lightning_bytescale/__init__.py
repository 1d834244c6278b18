"""lightning-bytescale: ByteScale Hybrid Data Parallelism for PyTorch Lightning.

``import lightning_bytescale`` registers the strategy names ``bytescale``, ``bytescale_spawn``
and ``bytescale_fork`` with Lightning, so ``Trainer(strategy="bytescale")`` works.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "attention_context": ("lightning_bytescale.packed_attention", "attention_context"),
    "token_loss": ("lightning_bytescale.engine.loss", "token_loss"),
    "ByteScaleStrategy": ("lightning_bytescale.lightning.strategy", "ByteScaleStrategy"),
    "ByteScaleDataModule": ("lightning_bytescale.lightning.datamodule", "ByteScaleDataModule"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'lightning_bytescale' has no attribute {name!r}")


class _RegisterWhenLightningLoads(importlib.abc.MetaPathFinder):
    """Register the strategies right after ``lightning.pytorch`` finishes importing.

    Importing Lightning costs seconds; the planner, simulator and profiler command lines never
    need it.  So ``import lightning_bytescale`` registers at once when Lightning is already
    loaded, and otherwise the first import of ``lightning.pytorch`` (which every ``Trainer``
    needs) registers them.
    """

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _LIGHTNING or self not in sys.meta_path:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            importlib.import_module("lightning_bytescale.lightning.strategy")

        loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


_LIGHTNING = "lightning.pytorch"


def _register_strategies() -> None:
    if _LIGHTNING in sys.modules:
        importlib.import_module("lightning_bytescale.lightning.strategy")
    elif not any(isinstance(f, _RegisterWhenLightningLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWhenLightningLoads())


_register_strategies()
