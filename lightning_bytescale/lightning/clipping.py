"""The one install of clipping by norm: the precision plugin's ``clip_grad_by_norm``, where the layout needs another.

``LightningModule.clip_gradients`` calls the precision plugin, whose norm is the norm of the
gradients this rank holds.  Where a rank holds only part of them (ZeRO-2's shard, a DTensor's
shard, a pipeline stage's parameters) the norm must combine the parts
(:func:`~lightning_bytescale.parallel.zero.shard_optimizers` says how, for the run's layout):
:func:`install_clip_by_norm` replaces the method of the run's plugin instance by one that does,
once, at set-up (clipping by value works on each part as it is).  Replacing the method of the
instance keeps whatever precision plugin the user gave (bf16, 16-mixed, 64-true, their own).
"""

from __future__ import annotations

from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer

from lightning_bytescale.errors import ConfigError
from lightning_bytescale.parallel.zero import ClipFn


def install_clip_by_norm(plugin: Precision, clip: ClipFn | None, *, zero: int) -> None:
    """Make ``plugin``'s clipping by norm use ``clip`` (``None``: its own norm is the right one).

    A float16 ``GradScaler`` with ZeRO-2 (``zero=2``) is refused: each rank would decide on its
    own gradient shard whether to skip a step.
    """
    if zero == 2 and getattr(plugin, "scaler", None) is not None:
        raise ConfigError(
            "ByteScaleStrategy(zero=2) cannot run with a float16 GradScaler (precision='16-mixed'): each rank "
            "would decide on its own gradient shard whether to skip a step. Use precision='bf16-mixed' or "
            "'32-true', or zero=1."
        )
    if clip is None:
        return

    def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        clip(inner, plugin.main_params(optimizer), clip_val)

    plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]


__all__ = ["install_clip_by_norm"]
