"""Every private Lightning name the strategy relies on, in one place.

``ByteScaleStrategy`` uses Lightning's public strategy API wherever one exists.  A few things
have no public hook: initialising the process group the way Lightning's own strategies do,
materialising a meta-device model, moving optimizer state, the launchers (and the module whose
``subprocess`` the popen launcher swaps while it starts ranks), calling hooks by name, reading
a module's trainer without an error, and keeping a probe forward's ``self.log`` calls out of
the logged metrics.  They are
imported or touched only here, and ``tests/lightning/test_lightning_compat.py`` checks each of them, so
a Lightning release that renames one fails that test loudly instead of breaking a run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import lightning.pytorch.strategies.launchers.subprocess_script as subprocess_script_module
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _set_num_threads_if_needed,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer import call as _call
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

if TYPE_CHECKING:
    import lightning.pytorch as pl

call_callback_hooks = _call._call_callback_hooks
call_module_hook = _call._call_lightning_module_hook


@contextmanager
def discarded_logging(trainer: pl.Trainer | None) -> Iterator[None]:
    """Inside the block, ``self.log`` in a training step writes to a throw-away collection.

    Used for the loss-normalisation probe, which runs ``training_step`` a second time on one
    micro-batch: its logged values must not count.
    """
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if loop is None or not hasattr(loop, "_results"):
        yield
        return
    saved = loop._results
    loop._results = _ResultCollection(training=True)
    try:
        yield
    finally:
        loop._results = saved


def module_trainer(module: Any) -> pl.Trainer | None:
    """The trainer a LightningModule is attached to, or ``None`` (no error when detached)."""
    return getattr(module, "_trainer", None)


__all__ = [
    "_ChildProcessObserver",
    "_MultiProcessingLauncher",
    "_StrategyRegistry",
    "_SubprocessScriptLauncher",
    "_distributed_is_initialized",
    "_get_default_process_group_backend_for_device",
    "_init_dist_connection",
    "_materialize_distributed_module",
    "_optimizers_to_device",
    "_set_num_threads_if_needed",
    "_sync_ddp_if_available",
    "call_callback_hooks",
    "call_module_hook",
    "discarded_logging",
    "module_trainer",
    "subprocess_script_module",
]
