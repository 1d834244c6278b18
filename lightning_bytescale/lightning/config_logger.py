"""Log the recipe's composed config as the run's hyperparameters once fitting starts.

Logging them when the recipe is built would start a logger run (an offline W&B folder) for a
run that then fails in ``prepare_data``/``setup``; logging at ``on_fit_start`` on rank 0
leaves no logger run behind for those.  A module-level class, so the spawn launcher can pickle
the trainer's callbacks.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback


class ConfigLogger(Callback):
    """``trainer.logger.log_hyperparams(config)`` on rank 0 when fitting starts."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.logger is not None and trainer.is_global_zero:
            trainer.logger.log_hyperparams(self.config)


__all__ = ["ConfigLogger"]
