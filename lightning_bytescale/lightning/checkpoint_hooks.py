"""`LayoutCheckpointHooks`: Lightning's checkpoint hooks of a strategy whose layout chooses how it saves.

Lightning saves and restores through eight strategy methods (the module's and the optimizers'
state, their loads, the file's save and load).  ``ByteScaleStrategy``'s answer to each depends on
its layout and its ``checkpoint_format`` only, chosen once
(:class:`~lightning_bytescale.lightning.checkpoint.LayoutCheckpoints`): a consolidated file from
rank 0, or a sharded folder every rank writes its part of and reads in place.  This mixin holds
those overrides, so the strategy file does not; it comes first among the strategy's bases, and
the next base's methods (Lightning's own) are the step where the layout needs nothing else.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy
from torch.optim import Optimizer
from typing_extensions import override

from lightning_bytescale.lightning.checkpoint import (
    LayoutCheckpoints,
    is_sharded_checkpoint,
    layout_checkpoints,
    save_sharded,
)
from lightning_bytescale.parallel.layout import Layout


class LayoutCheckpointHooks(ParallelStrategy):
    """The checkpoint overrides of a ``ParallelStrategy`` with a :class:`Layout` (a base placed before the others).

    The strategy calls :meth:`init_checkpoints` in its ``__init__`` and provides ``layout`` (this
    rank's), ``fsdp`` (the FSDP2 driver or ``None``) and ``phase`` (what a peer-failure message
    says this rank was doing).
    """

    layout: Layout
    fsdp: Any
    phase: str
    checkpoint_format: str
    """``"auto"``, ``"sharded"`` or ``"consolidated"`` (the strategy's argument, checked)."""

    def init_checkpoints(self, layout: type[Layout], *, pipelines: int, checkpoint_format: Any) -> None:
        """Choose how a run of ``layout`` saves and loads, once, and check ``checkpoint_format`` for it."""
        self._checkpoints: LayoutCheckpoints = layout_checkpoints(layout, pipelines)
        self.checkpoint_format = self._checkpoints.check_format(checkpoint_format)
        self._loaded_folder = False  # the checkpoint being restored is a sharded folder (read in place)

    @property
    def sharded_checkpoints(self) -> bool:
        """Whether a save now writes a sharded folder (``checkpoint_format``, ``"auto"`` resolved for the layout)."""
        return self._checkpoints.sharded(self.checkpoint_format, self.optimizers, self.fsdp)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Sharded: this rank's own state by parameter name (no gather); else the layout's whole state on rank 0."""
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return self._checkpoints.optimizer_state(
            inner, self.lightning_module, sharded=self.sharded_checkpoints, layout=self.layout,
            default=super().optimizer_state,
        )  # fmt: skip

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Sharded or without a mesh: the module's state as it is (a DTensor's local shard); else the DTensors whole."""
        return self._checkpoints.model_state(
            self.lightning_module,
            sharded=self.sharded_checkpoints,
            default=super().lightning_module_state_dict,
        )

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        self._checkpoints.load_model_state(
            self.lightning_module, checkpoint, strict, from_folder=self._loaded_folder,
            default=super().load_model_state_dict,
        )  # fmt: skip

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        self._checkpoints.load_optimizer_states(
            self.lightning_module, self.optimizers, checkpoint, from_folder=self._loaded_folder,
            default=super().load_optimizer_state_dict,
        )  # fmt: skip

    def whole_module_state(self) -> dict[str, Any]:
        """The module's state as one process would hold it, every DTensor gathered whole (a collective on a mesh).

        What a spawned or forked run hands back to the main process.
        """
        module = self.lightning_module
        assert module is not None
        return self._checkpoints.whole_state(module)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        """Sharded: every rank writes its part of the folder ``filepath``; else rank 0 writes one file."""
        sharded, rank = self.sharded_checkpoints, self.global_rank
        self._checkpoints.before_save(filepath, sharded=sharded, rank=rank, storage_options=storage_options)
        if not sharded:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        path = self.broadcast(filepath)  # every rank writes into rank 0's folder
        self.phase = f"saving the sharded checkpoint {path}"
        save_sharded(checkpoint, path, rank=rank, barrier=self.barrier)

    @override
    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """A sharded folder: each rank reads the model and its own optimizer entries; a file: Lightning's load."""
        self._loaded_folder = is_sharded_checkpoint(checkpoint_path)
        if not self._loaded_folder:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        module = self.lightning_module
        assert module is not None
        self.phase = f"loading the sharded checkpoint {checkpoint_path}"
        return self._checkpoints.load_folder(
            checkpoint_path, module, self.optimizers, weights_only=weights_only
        )


__all__ = ["LayoutCheckpointHooks"]
