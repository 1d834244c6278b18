"""Every private Lightning name the strategy relies on, in one place.

``ByteScaleStrategy`` uses Lightning's public strategy API wherever one exists.  A few things
have no public hook: initialising the process group the way Lightning's own strategies do,
materialising a meta-device model, moving optimizer state, the launchers (and the module whose
``subprocess`` the popen launcher swaps while it starts ranks), calling hooks by name, reading
a module's trainer without an error, the options a ``WandbLogger`` gives ``wandb.init``, keeping a probe forward's ``self.log`` calls out of
the logged metrics, the running loop's logged metrics (which epoch-end reductions every rank
must agree on), the running evaluation loop, whether a fit will validate (the validation loop's data source), and the loader ``load_from_checkpoint`` reads
files with (so that a sharded checkpoint folder loads).  They are
imported or touched only here, and ``tests/lightning/test_lightning_compat.py`` checks each of them, so
a Lightning release that renames one fails that test loudly instead of breaking a run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import lightning.pytorch.core.saving as _saving
import lightning.pytorch.strategies.launchers.subprocess_script as subprocess_script_module
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _set_num_threads_if_needed,
)
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer import call as _call
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection
from lightning.pytorch.utilities.model_helpers import is_overridden

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


def wandb_init_options(logger: Any) -> dict[str, Any]:
    """The keyword arguments a Lightning ``WandbLogger`` will hand to ``wandb.init`` (a live dict)."""
    return logger._wandb_init


def module_trainer(module: Any) -> pl.Trainer | None:
    """The trainer a LightningModule is attached to, or ``None`` (no error when detached)."""
    return getattr(module, "_trainer", None)


def evaluation_loop(trainer: pl.Trainer) -> Any:
    """The evaluation loop running now (fit's validation, ``validate`` or ``test``)."""
    return trainer._evaluation_loop


@dataclass(frozen=True)
class LoggedMetric:
    """One ``self.log`` key of the running loop whose epoch value is reduced over the ranks.

    Picklable, so ranks can compare their keys: ``fx`` is the hook without the dataloader
    suffix, ``options`` the ``self.log`` arguments that recreate the same entry.
    """

    key: str
    fx: str
    name: str
    is_tensor: bool
    on_step: bool
    has_group: bool
    dtype: str  # of the accumulated value ("" for a torchmetrics.Metric)
    options: dict[str, Any] = field(default_factory=dict)


def epoch_reduced_metrics(trainer: pl.Trainer) -> list[LoggedMetric]:
    """The keys of the running loop (current dataloader) whose epoch value needs a collective.

    A tensor logged with ``sync_dist=True`` is reduced with ``strategy.reduce`` when the
    epoch's value is computed; a ``torchmetrics.Metric`` syncs itself then.  Every rank must
    hold the same keys at that moment, in the same order of computation, or the collectives pair up wrong.
    """
    results = trainer._results
    if results is None:
        return []
    found = []
    for key, metric in results.items():
        meta = metric.meta
        if metric.has_reset or meta.dataloader_idx != results.dataloader_idx or not meta.on_epoch:
            continue
        if metric.is_tensor and (not meta.sync.should or meta.sync.rank_zero_only):
            continue
        suffix = (
            f".{meta.dataloader_idx}" if meta.add_dataloader_idx and meta.dataloader_idx is not None else ""
        )
        fx = meta.fx[: -len(suffix)] if suffix else meta.fx
        options = {
            "prog_bar": meta.prog_bar,
            "logger": meta.logger,
            "on_step": meta.on_step,
            "on_epoch": meta.on_epoch,
            "reduce_fx": meta.reduce_fx.__name__,
            "enable_graph": meta.enable_graph,
            "add_dataloader_idx": meta.add_dataloader_idx,
            "metric_attribute": meta.metric_attribute,
            "rank_zero_only": meta.sync.rank_zero_only,
        }
        has_group = meta.sync.group is not None
        dtype = str(metric.value.dtype).removeprefix("torch.") if metric.is_tensor else ""
        found.append(
            LoggedMetric(key, fx, meta.name, metric.is_tensor, meta.on_step, has_group, dtype, options)
        )
    return found


def log_into_results(trainer: pl.Trainer, metric: LoggedMetric, value: Any, sync_fn: Callable) -> None:
    """Record ``value`` under ``metric``'s key with its options, counting for nothing (batch size 0).

    Inside ``metric.fx`` itself this is what ``LightningModule.log`` does: the hook's first log
    of an iteration clears its tensors of the last one, and later ones must not clear this.
    """
    connector, module = trainer._logger_connector, trainer.lightning_module
    in_hook = module is not None and module._current_fx_name == metric.fx
    if in_hook and connector.should_reset_tensors(metric.fx):
        trainer._results.reset(metrics=False, fx=metric.fx)
    trainer._results.log(
        metric.fx, metric.name, value, sync_dist=True, sync_dist_fn=sync_fn, batch_size=0, **metric.options
    )
    if in_hook:
        connector._current_fx = metric.fx


def load_checkpoint_folders_with(load_folder: Callable[..., dict[str, Any] | None]) -> None:
    """``LightningModule.load_from_checkpoint`` reads files through ``lightning.pytorch.core.saving.pl_load``:
    wrap it so that a path ``load_folder(path, map_location, weights_only)`` loads (returns a
    checkpoint dict; ``None`` for anything else) is read by it.  Idempotent."""
    original = _saving.pl_load
    if getattr(original, "loads_checkpoint_folders", False):
        return

    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        loaded = load_folder(path_or_url, map_location, weights_only)
        if loaded is not None:
            return loaded
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    pl_load.loads_checkpoint_folders = True  # type: ignore[attr-defined]
    _saving.pl_load = pl_load


def _load_sharded_folder(path: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
    from lightning_bytescale.lightning.checkpoint import load_for_module

    return load_for_module(path, map_location, weights_only)


# imported with the strategy: LightningModule.load_from_checkpoint reads sharded checkpoint folders
load_checkpoint_folders_with(_load_sharded_folder)

__all__ = [
    "fit_validates",
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
    "LoggedMetric",
    "call_callback_hooks",
    "call_module_hook",
    "discarded_logging",
    "epoch_reduced_metrics",
    "evaluation_loop",
    "load_checkpoint_folders_with",
    "log_into_results",
    "module_trainer",
    "wandb_init_options",
    "subprocess_script_module",
]


def fit_validates(trainer: Any) -> bool:
    """Whether this ``trainer.fit`` will run validation batches, as far as set-up can tell.

    The module has a ``validation_step``, ``limit_val_batches`` is not 0, and validation data is
    defined as Lightning's own configuration check sees it (its validation loop's private data
    source: ``val_dataloaders`` given to ``fit``, or a ``val_dataloader`` of the module or data
    module); a data module that holds nothing out (``ByteScaleDataModule``'s ``val_fraction=0``)
    has none.  Called after the data module's ``setup``, before the first step.
    """
    module = trainer.lightning_module
    if module is None or not is_overridden("validation_step", module) or trainer.limit_val_batches == 0:
        return False
    if not trainer.fit_loop.epoch_loop.val_loop._data_source.is_defined():
        return False
    held_out = getattr(trainer.datamodule, "val_fraction", None)
    return held_out is None or held_out > 0
