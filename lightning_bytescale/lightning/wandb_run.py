"""One W&B run per training run, resumes included, without W&B's stale warnings.

Lightning's ``WandbLogger`` hands ``anonymous=None`` to ``wandb.init``, and under the spawn
launcher calls ``wandb.require("service")``; wandb 0.31 answers each with a warning that a
setting has no effect (``The anonymous setting has no effect ...``, ``wandb.require('service')
is a no-op ...``), once per run and once per job of a sweep.  :class:`WandbRunLogger` is that
logger without either call.

A resumed run should go on in the same W&B run: :class:`WandbRunId`, a callback, keeps the run's
id in every checkpoint (its state in ``checkpoint["callbacks"]``), and
:func:`checkpoint_wandb_run_id` reads it back without loading the weights, so ``bytescale-train
ckpt_path=...`` starts its logger with ``id=`` that run's (W&B appends; offline, both runs'
folders carry the id and ``wandb sync`` uploads them, oldest first, into the one run).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger

from lightning_bytescale.lightning.checkpoint import META_FILE, is_sharded_checkpoint
from lightning_bytescale.lightning.compat import wandb_init_options

__all__ = ["WandbRunId", "WandbRunLogger", "checkpoint_wandb_run_id"]


@contextmanager
def _without_require_service() -> Iterator[None]:
    """``wandb.require("service")`` does nothing but warn in wandb >= 0.18: skip that one call."""
    import wandb

    require = wandb.require

    def quiet(requirement: Any = None, **kwargs: Any) -> Any:
        if requirement == "service":
            return None
        return require(requirement, **kwargs)

    wandb.require = quiet
    try:
        yield
    finally:
        wandb.require = require


class WandbRunLogger(WandbLogger):
    """Lightning's ``WandbLogger``, minus the ``anonymous=None`` and ``wandb.require("service")`` it
    passes to wandb (each only makes wandb warn); every argument is ``WandbLogger``'s."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        options = wandb_init_options(self)
        if options.get("anonymous") is None:
            options.pop("anonymous", None)

    def __getstate__(self) -> dict[str, Any]:
        with _without_require_service():
            return super().__getstate__()


class WandbRunId(Callback):
    """Keeps the W&B run's id in every checkpoint, so the run that resumes it logs into the same W&B run."""

    def __init__(self) -> None:
        self.run_id: str | None = None

    def _find(self, trainer: Trainer) -> str | None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and trainer.is_global_zero:
                return str(logger.experiment.id)
        return self.run_id

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.run_id = self._find(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.run_id = state_dict.get("run_id") or self.run_id


def checkpoint_wandb_run_id(path: str | Path) -> str | None:
    """The W&B run id a :class:`WandbRunId` kept in the checkpoint ``path`` (a file or a sharded
    folder), read without loading its tensors; None when it holds none or cannot be read."""
    path = Path(path)
    try:
        if is_sharded_checkpoint(path):
            checkpoint = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
        elif path.is_file():
            checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        else:
            return None
    except Exception:  # noqa: BLE001 - not a checkpoint we can read: the resume itself will say why
        return None
    states = checkpoint.get("callbacks") if isinstance(checkpoint, dict) else None
    state = (states or {}).get(WandbRunId.__qualname__)
    run_id = state.get("run_id") if isinstance(state, dict) else None
    return str(run_id) if run_id else None
