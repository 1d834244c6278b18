"""What one fit did, in a few numbers that outlive the worker processes: steps, tokens, tokens/s.

The recipe's closing line and a sweep's table are printed by the process that called
``trainer.fit``.  Under the spawn and fork launchers (``strategy=bytescale_spawn``, every
sweep) the fitted state stays in the workers and ``trainer.global_step`` reads 0 in the caller;
Lightning carries ``trainer.callback_metrics`` back.  :class:`RunSummary` therefore writes its
figures there at the end of training (``run/steps``, ``run/global_step``, ``run/tokens``,
``run/train_s``, ``run/tokens_per_s``, ``run/first_loss``) and logs them once to the loggers.

It also keeps what says *why* one planner's run is faster than another's (a sweep's table
prints them): ``run/micro_batches_per_rank`` (the mean over steps of the mean number of
micro-batches an HDP rank ran), ``run/ring_token_share`` (the share of the run's tokens in
sequences sharded over a ring), ``run/busy_max_over_mean`` (the mean over steps of the slowest
HDP rank's measured busy time over the mean: 1.0 is perfect balance) and, with pipelines,
``run/pipeline_bubble`` (the mean measured bubble of the pipelines).

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

RUN_KEYS = (
    "run/steps",
    "run/global_step",
    "run/tokens",
    "run/train_s",
    "run/tokens_per_s",
    "run/first_loss",
    "run/micro_batches_per_rank",
    "run/ring_token_share",
    "run/busy_max_over_mean",
    "run/pipeline_bubble",
)


def _mean(values: Any) -> float | None:
    values = [float(v) for v in values or []]
    return sum(values) / len(values) if values else None


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
        self.first_loss: float | None = None
        self._per_step: dict[str, list[float]] = {}
        self._ring_tokens = [0.0, 0.0]

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.steps, self.tokens, self._first_tokens = 0, 0, 0
        self._start, self._first_end, self._last_end = time.perf_counter(), None, None
        self._seen_step = int(trainer.global_step)
        self.first_loss, self._per_step = None, {}
        self._ring_tokens = [0.0, 0.0]  # tokens on rings, all tokens

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
            self.first_loss = _step_loss(trainer, outputs)
        self._last_end = now
        self._keep(stats)

    def _keep(self, stats: dict[str, Any]) -> None:
        """This step's figures of why a planner is fast: micro-batches, ring tokens, balance, bubble."""
        found = {
            "run/micro_batches_per_rank": _mean(stats.get("num_micro_batches")),
            "run/busy_max_over_mean": stats.get("max_over_mean_measured"),
            "run/pipeline_bubble": _mean(stats.get("pipeline_bubble")),
        }
        lengths, degrees = stats.get("lengths") or [], stats.get("cp_degrees") or []
        if lengths and len(degrees) == len(lengths):
            self._ring_tokens[0] += sum(float(n) for n, d in zip(lengths, degrees) if int(d) > 1)
            self._ring_tokens[1] += sum(float(n) for n in lengths)
        for key, value in found.items():
            if isinstance(value, (int, float)) and value == value:  # not NaN
                self._per_step.setdefault(key, []).append(float(value))

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
        figures = {
            "run/steps": float(self.steps),
            "run/global_step": float(self._seen_step or 0),
            "run/tokens": float(self.tokens),
            "run/train_s": float(train_s),
            "run/tokens_per_s": float(rate),
        }
        if self.first_loss is not None:
            figures["run/first_loss"] = self.first_loss
        for key, values in self._per_step.items():
            figures[key] = sum(values) / len(values)
        if self._ring_tokens[1] > 0:
            figures["run/ring_token_share"] = self._ring_tokens[0] / self._ring_tokens[1]
        return figures

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        figures = self.figures()
        if not figures:
            return
        # callback_metrics is what Lightning's spawn/fork launchers send back to the caller
        trainer.callback_metrics.update({k: torch.tensor(v, dtype=torch.float64) for k, v in figures.items()})
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(figures, step=int(trainer.global_step))


def _step_loss(trainer: Trainer, outputs: Any) -> float | None:
    """The step's global loss: the strategy's logged loss, else what ``training_step`` returned."""
    name = getattr(getattr(trainer.strategy, "loop_options", None), "loss_name", "train/loss")
    value = trainer.callback_metrics.get(name)
    if value is None and isinstance(outputs, dict):
        value = outputs.get("loss")
    if value is None and isinstance(outputs, torch.Tensor):
        value = outputs
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError, RuntimeError):
        return None


def run_figures(trainer: Trainer) -> dict[str, float]:
    """The :class:`RunSummary` figures in ``trainer.callback_metrics`` (also after a spawned fit)."""
    metrics = trainer.callback_metrics
    return {k: float(metrics[k]) for k in RUN_KEYS if k in metrics}


__all__ = ["RUN_KEYS", "RunSummary", "run_figures"]
