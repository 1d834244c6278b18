"""Preemption with ``pipeline_parallel_size=2`` on ``(2, 2)``: SIGTERM to one rank saves one checkpoint that resumes exactly.

4 CPU ranks (gloo, fork launcher, float64), the module, data and reference of
``test_pipeline_strategy.py`` (PP-Balance plans with a ring item across both pipelines).  Global
rank 1 alone (stage 0 of pipeline 1) signals itself inside the step ``SIGNAL_AT``, in its
stage's first forward, inside torch's schedule.  The flag rides in the all-reduce over the world
after the step, so every rank saves the same sharded ``hpc_ckpt_1.ckpt`` after that step (each
stage its own parameters) and exits with 143; none trains on.  Resuming from it on ``(2, 2)``
ends where one process that never stopped ends (parameters of every stage and the losses logged
on every rank, to 1e-10).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from test_pipeline_strategy import PipelineLM, _assert_exact, _check, _fit
from torch.multiprocessing.spawn import ProcessExitedException

from lightning_bytescale.lightning.checkpoint import is_sharded_checkpoint
from lightning_bytescale.lightning.preemption import EXIT_PREEMPTED

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

SIGNAL_AT, TOTAL, SIGNALLED = 1, 4, 1


class SignalledInsideTheSchedule(PipelineLM):
    """Global rank ``SIGNALLED`` sends itself SIGTERM in its stage's first forward of step ``SIGNAL_AT``."""

    def configure_model(self) -> None:
        super().configure_model()
        if self.global_rank != SIGNALLED:
            return

        def signal_once(module, args, kwargs):
            if self.trainer.global_step == SIGNAL_AT and not getattr(self, "_sent", False):
                self._sent = True
                os.kill(os.getpid(), signal.SIGTERM)  # the strategy's handler only sets its flag

        self.model.register_forward_pre_hook(signal_once, with_kwargs=True)


class SaveRecorder(pl.Callback):
    """Every rank marks the steps it saved a checkpoint at (the preemption checkpoint comes before the exit).

    torch's process join ends the other ranks once the first exits with 143, so the exit code
    of each is not observable; the save after the agreed step is.
    """

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        (self.out / f"saved_{trainer.global_rank}_{trainer.global_step}").touch()


def test_sigterm_to_one_rank_of_a_2x2_pipeline_run_saves_one_checkpoint_and_resumes_exactly(tmp_path):
    first = tmp_path / "first"
    with pytest.raises(ProcessExitedException) as info:
        _fit(first, 4, TOTAL, module=SignalledInsideTheSchedule(), callbacks=[SaveRecorder(first)])
    assert info.value.exit_code == EXIT_PREEMPTED, info.value
    saves = sorted(p.name for p in first.glob("saved_*"))
    assert saves == [f"saved_{r}_{SIGNAL_AT + 1}" for r in range(4)], saves  # every rank, after the same step
    saved = sorted(p.name for p in first.glob("hpc_ckpt_*"))
    assert saved == ["hpc_ckpt_1.ckpt"], saved
    path = first / "hpc_ckpt_1.ckpt"
    assert is_sharded_checkpoint(path), "with pipelines the preemption checkpoint is a sharded folder"
    meta = torch.load(path / "meta.pt", weights_only=False)
    assert meta["global_step"] == SIGNAL_AT + 1, meta["global_step"]  # after the signalled step
    assert not any(first.glob("report_*.json")), "a rank trained on past the agreed step"

    resumed = tmp_path / "resumed"
    _fit(resumed, 4, TOTAL, resume=path)
    _assert_exact(_check(resumed, 4, TOTAL, first_step=SIGNAL_AT + 1), "preempted (2, 2) pipelines resumed")
