"""Forked ranks do not inherit an earlier run's garbage: the launcher collects it before forking.

In one interpreter (a notebook, a test session) a run that failed can leave its process group
and an async work alive only through a reference cycle (an exception's traceback).  A rank
forked from there inherits that garbage but not the TCPStore's server thread; when the rank's
next full garbage collection destroys the store, its destructor joins that thread and the rank
hangs with the interpreter lock held.  The script below leaves exactly such garbage, then fits
two forked ranks that each run a full collection at set-up.
"""

from __future__ import annotations

import pytest
from _lifecycle import run_python

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

SCRIPT = r"""
import gc, sys
sys.path.insert(0, "tests")
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from _ranks import free_port
from _strategy_helpers import CAPACITY, StepDataModule, TinyLM
from lightning_bytescale import ByteScaleStrategy


class Leftover:
    pass


def leave_garbage():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    left = Leftover()
    left.cycle = left  # only a full collection frees it
    left.work = dist.all_reduce(torch.ones(4), async_op=True)
    left.group = dist.new_group()
    dist.destroy_process_group()


class CollectAtSetup(pl.Callback):
    def setup(self, trainer, pl_module, stage):
        gc.collect()  # what a rank's next full collection does, at whatever moment it comes


gc.disable()  # keep the garbage until something collects it
leave_garbage()
trainer = pl.Trainer(
    accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    strategy=ByteScaleStrategy(capacity=CAPACITY, start_method="fork", timeout=30),
    callbacks=[CollectAtSetup()],
)
module = TinyLM()
before = [p.detach().clone() for p in module.parameters()]
trainer.fit(module, datamodule=StepDataModule("balance"))
trained = any(not torch.equal(a, p) for a, p in zip(before, module.parameters()))  # rank 0's weights came back
print("FIT-DONE", "trained" if trained else "untouched")
"""


def test_forked_ranks_do_not_collect_an_earlier_runs_process_group():
    done = run_python(SCRIPT, timeout=120)
    assert done.returncode == 0, done.output
    assert "FIT-DONE trained" in done.stdout, done.output
