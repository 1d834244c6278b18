"""A time limit for *this* run, so that resuming from a checkpoint trains again.

Lightning's ``Trainer(max_time=...)`` saves the elapsed time in every checkpoint and restores
it on resume: a recipe whose quickstart stopped on its 4-minute limit would, resumed with more
steps, run one step and stop again.  :class:`RunTimer` is Lightning's ``Timer`` with one
change: it does not restore the elapsed time, so ``max_time`` bounds each run's own training
time.  It also remembers the step it started at, so a run can report how many steps *it* took.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Timer


class RunTimer(Timer):
    """Stop after ``duration`` of this run's training time (not restored from checkpoints)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.start_step: int | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_start(trainer, pl_module)
        self.start_step = int(trainer.global_step)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep this run's own clock: the elapsed time of earlier runs does not count."""

    def steps_this_run(self, trainer: Any) -> int:
        return int(trainer.global_step) - (self.start_step or 0)


__all__ = ["RunTimer"]
