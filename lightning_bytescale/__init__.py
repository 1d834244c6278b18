"""lightning-bytescale: ByteScale Hybrid Data Parallelism for PyTorch Lightning.

The public API is the names in ``__all__``; every one of them is resolved on first use, so
``import lightning_bytescale`` stays light (the planner and simulator command lines import the
package without loading torch or Lightning)::

    import lightning_bytescale as lb

    lb.attention(q, k, v)                      # packed causal attention (local or zigzag ring)
    trainer = pl.Trainer(strategy=lb.ByteScaleStrategy(capacity=8192))

``import lightning_bytescale`` also makes the strategy names ``bytescale``, ``bytescale_spawn``
and ``bytescale_fork`` known to Lightning: the strategy module registers them beside the class
(``ByteScaleStrategy.register_strategies``), and this package imports that module at once when
``lightning.pytorch`` is already imported, or else right after its first import (a ``wrapt``
post-import hook), so ``Trainer(strategy="bytescale")`` works in either import order.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

import wrapt

from lightning_bytescale._lazy import lazy_getattr, public_dir
from lightning_bytescale.errors import (
    ByteScaleError,
    ConfigError,
    LossNormalizationError,
    MissingPackedAttentionError,
    NonFiniteError,
    ParameterDivergenceError,
    PeerFailureError,
    PlanDivergenceError,
    PlanWorldSizeError,
    StepError,
)

__version__ = "0.1.0"

# Public name -> the module that defines it, imported on first access (PEP 562).
_LAZY: dict[str, str] = {
    "ByteScaleStrategy": "lightning_bytescale.lightning.strategy",
    "ByteScaleDataModule": "lightning_bytescale.lightning.datamodule",
    "TelemetryCallback": "lightning_bytescale.lightning.telemetry",
    "attention": "lightning_bytescale.packed_attention.api",
    "attention_context": "lightning_bytescale.packed_attention.context",
    "token_loss": "lightning_bytescale.engine.loss",
    "PlannerConfig": "lightning_bytescale.planner.config",
    "make_plan": "lightning_bytescale.planner.planners",
    "register_planner": "lightning_bytescale.planner.planners",
    "PlanError": "lightning_bytescale.planner.errors",
    "DataError": "lightning_bytescale.data.errors",
}

if TYPE_CHECKING:  # for type checkers and IDEs; at run time ``__getattr__`` imports them
    from lightning_bytescale.data.errors import DataError
    from lightning_bytescale.engine.loss import token_loss
    from lightning_bytescale.lightning.datamodule import ByteScaleDataModule
    from lightning_bytescale.lightning.strategy import ByteScaleStrategy
    from lightning_bytescale.lightning.telemetry import TelemetryCallback
    from lightning_bytescale.packed_attention.api import attention
    from lightning_bytescale.packed_attention.context import attention_context
    from lightning_bytescale.planner.config import PlannerConfig
    from lightning_bytescale.planner.errors import PlanError
    from lightning_bytescale.planner.planners import make_plan, register_planner

__all__ = [
    "ByteScaleDataModule",
    "ByteScaleError",
    "ByteScaleStrategy",
    "ConfigError",
    "DataError",
    "LossNormalizationError",
    "MissingPackedAttentionError",
    "NonFiniteError",
    "ParameterDivergenceError",
    "PeerFailureError",
    "PlanDivergenceError",
    "PlanError",
    "PlanWorldSizeError",
    "PlannerConfig",
    "StepError",
    "TelemetryCallback",
    "__version__",
    "attention",
    "attention_context",
    "make_plan",
    "register_planner",
    "token_loss",
]


__getattr__ = lazy_getattr(globals(), _LAZY, cache=True)  # later lookups skip it
__dir__ = public_dir(globals())


_LIGHTNING = "lightning.pytorch"
_STRATEGY_MODULE = "lightning_bytescale.lightning.strategy"


def _register_strategies(_lightning: Any = None) -> None:
    """Import the strategy module, whose last line registers the strategy names with Lightning."""
    importlib.import_module(_STRATEGY_MODULE)


if _LIGHTNING in sys.modules:
    _register_strategies()
else:
    wrapt.register_post_import_hook(_register_strategies, _LIGHTNING)
