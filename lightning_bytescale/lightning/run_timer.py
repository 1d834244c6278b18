"""A time limit for *this* run, so that resuming from a checkpoint trains again.

Lightning's ``Trainer(max_time=...)`` saves the elapsed time in every checkpoint and restores
it on resume: a recipe whose quickstart stopped on its 4-minute limit would, resumed with more
steps, run one step and stop again.  :class:`RunTimer` is Lightning's ``Timer`` with one
change: it does not restore the elapsed time, so ``max_time`` bounds each run's own training
time (what a run did is counted by :mod:`~lightning_bytescale.lightning.run_summary`).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Timer


class RunTimer(Timer):
    """Stop after ``duration`` of this run's training time (not restored from checkpoints)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep this run's own clock: the elapsed time of earlier runs does not count."""


__all__ = ["RunTimer"]
