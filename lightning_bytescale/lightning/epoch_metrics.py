"""Epoch values of metrics logged inside the micro-batch loops, reduced once when every rank is there.

``self.log(..., sync_dist=True)`` in ``validation_step`` (Lightning's default there is
``on_epoch=True``) or with ``on_step=False, on_epoch=True`` in ``training_step`` accumulates on
each rank, once per micro-batch, and is reduced over the ranks when Lightning computes the
epoch's value: one collective per key, in the order of the rank's keys.  That moment is after
the loop, when every rank is there, so the reduction is safe -- provided every rank holds the
same keys.  A rank that ran no micro-batch in the whole epoch (a short validation set: one
sequence, two ranks) never logged them, and its collectives would pair with the wrong keys.

:func:`agree_on_epoch_metrics` is called by every rank at the end of an epoch, before
Lightning computes it (the last evaluation step of a dataloader; a training epoch's
``on_train_epoch_end``): one ``all_gather_object`` of each rank's keys, after which a rank
missing a key logs it with a value that counts for nothing (batch size 0; the reduction's own
neutral value for ``max``/``min``), so every rank reduces the same keys in the same order.  The
same collective carries the caller's ``extra`` (the strategy's token-loss sums for
``val/loss``).  :func:`exact_reduce` is the strategy's ``reduce``: a mean is the float64 sum
over the world size, so Lightning's token-weighted mean (sum of ``value x batch_size`` over the
sum of the batch sizes, an ``int64``) is not truncated by an integer division.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from torch import Tensor

from lightning_bytescale.engine.comm_device import comm_device
from lightning_bytescale.errors import ConfigError
from lightning_bytescale.lightning import compat as compat

if TYPE_CHECKING:
    import lightning.pytorch as pl

# what a rank without values adds to a reduction: nothing
NEUTRAL = {"mean": 0.0, "sum": 0.0, "max": -math.inf, "min": math.inf}


def exact_reduce(tensor: Tensor, group: Any = None, reduce_op: Any = "mean") -> Tensor:
    """``strategy.reduce``: one all-reduce; a mean divides the sum by the world size in floating point.

    ``reduce_op`` is ``"sum"``, ``"mean"``/``"avg"``, ``"max"``, ``"min"``, ``"product"`` or a
    ``torch.distributed.ReduceOp``.  A floating tensor is reduced in place and returned, as
    Lightning's DDP does; an integer tensor's mean is returned as a new float64 tensor (DDP's
    would truncate it: Lightning's epoch mean divides by the summed batch sizes, an integer).
    A tensor that lives elsewhere than the group's device (a host value on NCCL) travels through
    a copy there and back.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    name = reduce_op.lower() if isinstance(reduce_op, str) else None
    if name in ("mean", "avg") or reduce_op == dist.ReduceOp.AVG:
        out = tensor if torch.is_floating_point(tensor) else tensor.to(torch.float64)
        _all_reduce(out, dist.ReduceOp.SUM, group)
        return out.div_(dist.get_world_size(group))
    if reduce_op is None:
        op = dist.ReduceOp.SUM  # Lightning's _sync_ddp: None means a sum
    else:
        op = getattr(dist.ReduceOp, name.upper()) if name is not None else reduce_op
    _all_reduce(tensor, op, group)
    return tensor


def _all_reduce(tensor: Tensor, op: Any, group: Any) -> None:
    """``tensor`` all-reduced in place, on the group's device (through a copy when it lives elsewhere)."""
    device = comm_device(group)
    if tensor.device == device:
        dist.all_reduce(tensor, op=op, group=group)
        return
    moved = tensor.to(device)
    dist.all_reduce(moved, op=op, group=group)
    tensor.copy_(moved)


def agree_on_epoch_metrics(
    trainer: pl.Trainer, module: pl.LightningModule, sync_fn: Callable, extra: Any = None
) -> list[Any]:
    """Make every rank hold the same epoch-reduced keys; returns every rank's ``extra`` (by rank).

    Call it on every rank at the same point, after the epoch's last micro-batch loop and before
    Lightning computes the epoch's values.  One collective.
    """
    mine = compat.epoch_reduced_metrics(trainer)
    if not (dist.is_available() and dist.is_initialized()):
        return [extra]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"metrics": mine, "extra": extra})
    have = {m.key for m in mine}
    wanted: dict[str, compat.LoggedMetric] = {}
    for payload in gathered:
        for metric in payload["metrics"]:
            wanted.setdefault(metric.key, metric)
    for key, metric in wanted.items():
        if key in have:
            continue
        if metric.on_step or metric.has_group:
            raise ConfigError(
                f"self.log({metric.name!r}, ..., sync_dist=True) in {metric.fx} was logged on some ranks only "
                f"{'with on_step=True' if metric.on_step else 'with sync_dist_group='}, so its reduction cannot be "
                "made on every rank. Log it on every rank (in a hook every rank runs once per step), or with "
                "on_step=False, on_epoch=True and without sync_dist_group inside the micro-batch loop."
            )
        compat.log_into_results(trainer, metric, _neutral(module, metric), sync_fn)
    return [payload["extra"] for payload in gathered]


def _neutral(module: pl.LightningModule, metric: compat.LoggedMetric) -> Any:
    if not metric.is_tensor:  # a torchmetrics.Metric: the module's own instance (it syncs its states)
        return getattr(module, str(metric.options["metric_attribute"]))
    dtype = getattr(torch, metric.dtype)
    return torch.tensor(NEUTRAL[metric.options["reduce_fx"]], dtype=dtype, device=module.device)


class TrainEpochMetrics(Callback):
    """At the end of every training epoch, before Lightning reduces it: :func:`agree_on_epoch_metrics`.

    ``ByteScaleStrategy`` adds it to the trainer's callbacks when fitting; users need not.
    """

    def __init__(self, sync_fn: Callable) -> None:
        self.sync_fn = sync_fn

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        agree_on_epoch_metrics(trainer, pl_module, self.sync_fn)


__all__ = ["NEUTRAL", "TrainEpochMetrics", "agree_on_epoch_metrics", "exact_reduce"]
