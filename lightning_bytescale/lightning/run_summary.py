"""What one fit did, in a few numbers that outlive the worker processes: steps, tokens, tokens/s.

The recipe's closing line and a sweep's table are printed by the process that called
``trainer.fit``.  Under the spawn and fork launchers (``strategy=bytescale_spawn``, every
sweep) the fitted state stays in the workers and ``trainer.global_step`` reads 0 in the caller;
Lightning carries ``trainer.callback_metrics`` back.  :class:`RunSummary` therefore writes its
figures there at the end of training (``run/steps``, ``run/tokens``, ``run/train_s``,
``run/tokens_per_s``) and logs them once to the loggers.

``run/tokens_per_s`` is the global tokens of the steps after the first, over the wall time from
the end of the first step to the end of the last: it leaves out start-up and the first step
(the token store's first read, allocations), and keeps everything else a user waits for (data,
checkpoints, logging).  With a single step it is that step's tokens over its wall time.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

RUN_KEYS = ("run/steps", "run/tokens", "run/train_s", "run/tokens_per_s")


class RunSummary(Callback):
    """Count this run's optimizer steps and global tokens; leave them in ``callback_metrics``."""

    def __init__(self) -> None:
        self.steps = 0
        self.tokens = 0
        self._start: float | None = None
        self._first_end: float | None = None
        self._last_end: float | None = None
        self._first_tokens = 0
        self._seen_step: int | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.steps, self.tokens, self._first_tokens = 0, 0, 0
        self._start, self._first_end, self._last_end = time.perf_counter(), None, None
        self._seen_step = int(trainer.global_step)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if int(trainer.global_step) == self._seen_step:
            return  # no optimizer step (a skipped batch)
        self._seen_step = int(trainer.global_step)
        stats = getattr(trainer.strategy, "step_stats", None) or {}
        tokens = int(stats.get("tokens") or getattr(batch, "num_tokens", 0) or 0)
        now = time.perf_counter()
        self.steps += 1
        self.tokens += tokens
        if self._first_end is None:
            self._first_end, self._first_tokens = now, tokens
        self._last_end = now

    def figures(self) -> dict[str, float]:
        """This run's figures (empty before the first step)."""
        if not self.steps or self._start is None or self._last_end is None:
            return {}
        assert self._first_end is not None
        train_s = self._last_end - self._start
        if self.steps > 1 and self._last_end > self._first_end:
            rate = (self.tokens - self._first_tokens) / (self._last_end - self._first_end)
        else:
            rate = self.tokens / max(train_s, 1e-9)
        return {
            "run/steps": float(self.steps),
            "run/tokens": float(self.tokens),
            "run/train_s": float(train_s),
            "run/tokens_per_s": float(rate),
        }

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        figures = self.figures()
        if not figures:
            return
        # callback_metrics is what Lightning's spawn/fork launchers send back to the caller
        trainer.callback_metrics.update({k: torch.tensor(v, dtype=torch.float64) for k, v in figures.items()})
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(figures, step=int(trainer.global_step))


def run_figures(trainer: Trainer) -> dict[str, float]:
    """The :class:`RunSummary` figures in ``trainer.callback_metrics`` (also after a spawned fit)."""
    metrics = trainer.callback_metrics
    return {k: float(metrics[k]) for k in RUN_KEYS if k in metrics}


__all__ = ["RUN_KEYS", "RunSummary", "run_figures"]
