"""Resuming the recipe from its checkpoint trains on, even after a run that used up its time limit.

Lightning's ``max_time`` restores the elapsed time from the checkpoint, so a quickstart that
stopped on its time limit used to run one step when resumed (and reported the total step
count).  The recipe's ``trainer.max_time`` now bounds each run's own training time.
"""

from __future__ import annotations

import pytest
import torch
from _recipe_helpers import run_train

from lightning_bytescale.lightning.run_timer import RunTimer

pytestmark = pytest.mark.multiprocess


def test_run_timer_does_not_restore_elapsed_time():
    timer = RunTimer(duration="00:00:01:00")
    timer.load_state_dict({"time_elapsed": {"train": 1e9, "validate": 0.0, "test": 0.0, "predict": 0.0}})
    assert timer.time_elapsed("train") < 1.0


def test_resume_after_the_time_limit_continues_and_counts_this_runs_steps(tmp_path):
    run = tmp_path / "run"
    common = [
        "experiment=cpu_smoke",
        "trainer.devices=1",
        "logger=csv",
        "trainer.enable_checkpointing=true",
        "trainer.max_time=00:00:10:00",
        f"run_dir={run}",
        f"hydra.run.dir={run}",
    ]
    first = run_train([*common, "trainer.max_steps=2"], tmp_path)
    assert "cpu_smoke: 2 steps" in first.stdout
    last = run / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=False)
    timers = [s for s in ckpt["callbacks"].values() if isinstance(s, dict) and "time_elapsed" in s]
    assert timers, "the checkpoint carries the timer's state"
    for state in timers:  # as if the first run had used up its 10 minutes
        state["time_elapsed"] = {k: 1e6 for k in state["time_elapsed"]}
    torch.save(ckpt, last)
    second = run_train([*common, "trainer.max_steps=4", f"ckpt_path={last}"], tmp_path)
    assert "cpu_smoke: 2 steps (resumed; step 4 now)" in second.stdout, second.stdout[-2000:]
