"""SIGTERM to one rank of a ``(2, 2)`` layout under a real Trainer: one checkpoint on every rank, resumed exactly.

One table of layouts, as an integration table (plain HDP's preemption is ``test_preemption.py``'s).
4 CPU ranks (gloo, fork launcher, float64); global rank 1 alone signals itself inside the step
``SIGNAL_AT``:

* ``tensor-parallel`` (``tensor_parallel_size=2``, the module and reference of
  ``test_tensor_parallel_strategy.py``): rank 1 is lane 1 of HDP rank 0 and signals itself in its
  first micro-batch.  Its lane's data-parallel all-reduce tells rank 3 (lane 1 of HDP rank 1);
  the lanes' all-reduce tells ranks 0 and 2.  The checkpoint is one file (the DTensors gathered
  together).  ``tensor-parallel-zero2`` is the same with ``zero=2``: the flag rides in the
  scalars' all-reduce after the reduces to the gradients' owners, and ``"auto"`` writes a sharded
  folder (the state is split over the HDP ranks).
* ``pipeline`` (``pipeline_parallel_size=2``, the module, data and reference of
  ``test_pipeline_strategy.py``, PP-Balance plans with a ring item across both pipelines): rank 1
  is stage 0 of pipeline 1 and signals itself in its stage's first forward, inside torch's
  schedule.  The flag rides in the all-reduce over the world after the step; the checkpoint is
  a sharded folder (each stage its own parameters).

In every layout every rank saves the same ``hpc_ckpt_1.ckpt`` after that step and exits with 143
(torch's process join ends the other ranks once the first exits, so each rank's exit code is not
observable; its save after the agreed step is); none trains on.  Resuming from it on ``(2, 2)``
ends where one process that never stopped ends (parameters and the losses logged on every rank,
to 1e-10).
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import pytest
import test_pipeline_strategy as pipeline
import test_tensor_parallel_strategy as tensor_parallel
import torch
from torch.multiprocessing.spawn import ProcessExitedException

from lightning_bytescale.lightning.checkpoint import META_FILE, is_sharded_checkpoint
from lightning_bytescale.lightning.preemption import EXIT_PREEMPTED

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

SIGNAL_AT, TOTAL, SIGNALLED = 1, 4, 1


def _signal_once(module: pl.LightningModule) -> None:
    if module.trainer.global_step == SIGNAL_AT and not getattr(module, "_sent", False):
        module._sent = True
        os.kill(os.getpid(), signal.SIGTERM)  # the strategy's handler only sets its flag


class SignalledInTheFirstMicroBatch(tensor_parallel.TPLM):
    """Global rank ``SIGNALLED`` sends itself SIGTERM in the first micro-batch of step ``SIGNAL_AT``."""

    def training_step(self, mb, batch_idx):
        if self.global_rank == SIGNALLED:
            _signal_once(self)
        return super().training_step(mb, batch_idx)


class SignalledInsideTheSchedule(pipeline.PipelineLM):
    """Global rank ``SIGNALLED`` sends itself SIGTERM in its stage's first forward of step ``SIGNAL_AT``."""

    def configure_model(self) -> None:
        super().configure_model()
        if self.global_rank == SIGNALLED:
            self.model.register_forward_pre_hook(lambda *_, **__: _signal_once(self), with_kwargs=True)


class SaveRecorder(pl.Callback):
    """Every rank marks the steps it saved a checkpoint at (the preemption checkpoint comes before the exit)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        (self.out / f"saved_{trainer.global_rank}_{trainer.global_step}").touch()


@dataclass(frozen=True)
class TensorParallel:
    """``tensor_parallel_size=2`` on ``(2, 2)``, ZeRO at ``zero``."""

    zero: int = 0

    @property
    def sharded(self) -> bool:
        return self.zero == 2  # zero=2 splits the state over the HDP ranks: "auto" writes a folder

    def fit(self, out: Path, *, preempted: bool = False, resume: Path | None = None) -> None:
        module = SignalledInTheFirstMicroBatch if preempted else tensor_parallel.TPLM
        extra = (SaveRecorder(out),) if preempted else ()
        tensor_parallel._fit(
            out, 4, steps=TOTAL, tied=False, module=module, data_steps=TOTAL, resume=resume, zero=self.zero,
            extra_callbacks=extra,
        )  # fmt: skip

    def check_resumed(self, out: Path) -> None:
        expected, losses, _ = tensor_parallel._reference(TOTAL, tied=False)
        worst_param = worst_loss = 0.0
        for r in range(4):
            got = torch.load(out / f"params_{r}.pt")
            worst_param = max(worst_param, max((got[k] - v).abs().max().item() for k, v in expected.items()))
            rows = json.loads((out / f"report_{r}.json").read_text())["rows"]
            assert [row["step"] for row in rows] == list(range(SIGNAL_AT + 1, TOTAL))
            worst_loss = max(worst_loss, max(abs(row["logged"] - losses[row["step"]]) for row in rows))
        print(
            f"preempted (2, 2) zero={self.zero} resumed: max parameter difference {worst_param:.3e}, "
            f"loss {worst_loss:.3e}"
        )
        assert worst_param <= tensor_parallel.TOLERANCE and worst_loss <= tensor_parallel.TOLERANCE, (
            worst_param,
            worst_loss,
        )


@dataclass(frozen=True)
class Pipeline:
    """``pipeline_parallel_size=2`` on ``(2, 2)``."""

    sharded: bool = True  # with pipelines the preemption checkpoint is a sharded folder

    def fit(self, out: Path, *, preempted: bool = False, resume: Path | None = None) -> None:
        if preempted:
            pipeline._fit(out, 4, TOTAL, module=SignalledInsideTheSchedule(), callbacks=[SaveRecorder(out)])
        else:
            pipeline._fit(out, 4, TOTAL, resume=resume)

    def check_resumed(self, out: Path) -> None:
        result = pipeline._check(out, 4, TOTAL, first_step=SIGNAL_AT + 1)
        pipeline._assert_exact(result, "preempted (2, 2) pipelines resumed")


LAYOUTS = {
    "tensor-parallel": TensorParallel(zero=0),
    "tensor-parallel-zero2": TensorParallel(zero=2),
    "pipeline": Pipeline(),
}


def _saved_step(path: Path) -> int:
    """The ``global_step`` a checkpoint (a file, or a sharded folder's metadata) was saved at."""
    meta = path / META_FILE if is_sharded_checkpoint(path) else path
    return torch.load(meta, weights_only=False)["global_step"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sigterm_to_one_rank_of_the_layout_saves_one_checkpoint_on_every_rank_and_resumes_exactly(
    tmp_path, layout
):
    case = LAYOUTS[layout]
    first = tmp_path / "first"
    with pytest.raises(ProcessExitedException) as info:
        case.fit(first, preempted=True)
    assert info.value.exit_code == EXIT_PREEMPTED, info.value
    saves = sorted(p.name for p in first.glob("saved_*"))
    assert saves == [f"saved_{r}_{SIGNAL_AT + 1}" for r in range(4)], saves  # every rank, after the same step
    saved = sorted(p.name for p in first.glob("hpc_ckpt_*"))
    assert saved == ["hpc_ckpt_1.ckpt"], saved
    path = first / "hpc_ckpt_1.ckpt"
    assert is_sharded_checkpoint(path) == case.sharded
    assert _saved_step(path) == SIGNAL_AT + 1  # after the step in which rank 1 was signalled
    assert not any(first.glob("report_*.json")), "a rank trained on past the agreed step"

    resumed = tmp_path / "resumed"
    case.fit(resumed, resume=path)
    case.check_resumed(resumed)
