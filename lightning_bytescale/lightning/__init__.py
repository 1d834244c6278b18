"""The Lightning floor: the strategy, its launcher, the data module and the callbacks.

Everything here may import Lightning and every floor below it (``engine``, ``packed_attention``,
``offload``, ``data``, ``models``, ``planner``, ``sim``); nothing below imports this floor.
See ``docs/architecture.md``.
"""

from __future__ import annotations

from lightning_bytescale._lazy import lazy_getattr, public_dir

# Public name -> its module, imported on first access (PEP 562), so importing one module of
# this package does not import the others.
_LAZY: dict[str, str] = {
    "ByteScaleStrategy": "lightning_bytescale.lightning.strategy",
    "ByteScaleDataModule": "lightning_bytescale.lightning.datamodule",
    "ByteScaleScriptLauncher": "lightning_bytescale.lightning.launcher",
    "ConfigLogger": "lightning_bytescale.lightning.config_logger",
    "PreemptedError": "lightning_bytescale.lightning.preemption",
    "PreemptionCallback": "lightning_bytescale.lightning.preemption",
    "PreemptionHandler": "lightning_bytescale.lightning.preemption",
    "RunTimer": "lightning_bytescale.lightning.run_timer",
    "StepProgressBar": "lightning_bytescale.lightning.progress",
    "TelemetryCallback": "lightning_bytescale.lightning.telemetry",
}

__all__ = sorted(_LAZY, key=str.lower)

__getattr__ = lazy_getattr(globals(), _LAZY)
__dir__ = public_dir(globals())
