"""Resuming the recipe from its checkpoint trains on, even after a run that used up its time limit.

Lightning's ``max_time`` restores the elapsed time from the checkpoint, so a quickstart that
stopped on its time limit used to run one step when resumed (and reported the total step
count).  The recipe's ``trainer.max_time`` now bounds each run's own training time.  The printed
command itself resumes: as the run was started, in its folder and its W&B run (issue 37, item 6).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch
from _recipe_helpers import run_train

from lightning_bytescale.lightning.run_timer import RunTimer

pytestmark = pytest.mark.multiprocess


def test_run_timer_does_not_restore_elapsed_time():
    timer = RunTimer(duration="00:00:01:00")
    timer.load_state_dict({"time_elapsed": {"train": 1e9, "validate": 0.0, "test": 0.0, "predict": 0.0}})
    assert timer.time_elapsed("train") < 1.0


def _offline_runs(run: Path) -> list[Path]:
    return sorted((run / "wandb").glob("offline-run-*"))


def test_the_printed_command_continues_the_run_in_its_folder_and_w_and_b_run_after_its_time_limit(tmp_path):
    """The first run used up its time limit (Lightning's ``max_time`` would restore the elapsed time
    and stop at once); its printed command resumes it for 2 more steps.

    Issue 37, item 6: started as ``python -m lightning_bytescale.cli.train`` (not an activated
    venv's ``bytescale-train``), the printed command starts the same way; the resumed run writes
    beside the first, logs into the same W&B run (its id kept in the checkpoint), and its bar counts
    on from the checkpoint's step (one process each, W&B offline)."""
    run = tmp_path / "run"
    module = [sys.executable, "-m", "lightning_bytescale.cli.train"]
    first = run_train(
        ["experiment=cpu_smoke", "trainer.devices=1", "trainer.enable_checkpointing=true", "trainer.max_steps=2",
         "trainer.max_time=00:00:10:00", f"hydra.run.dir={run}"],
        tmp_path, command=module,
    )  # fmt: skip
    assert "cpu_smoke: 2 steps" in first.stdout
    assert "The anonymous setting has no effect" not in first.stderr, first.stderr[-3000:]
    last = run / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=False)
    timers = [s for s in ckpt["callbacks"].values() if isinstance(s, dict) and "time_elapsed" in s]
    assert timers, "the checkpoint carries the timer's state"
    for state in timers:  # as if the first run had used up its 10 minutes
        state["time_elapsed"] = {k: 1e6 for k in state["time_elapsed"]}
    torch.save(ckpt, last)
    resume = [
        line.split("resume with:", 1)[1] for line in first.stdout.splitlines() if "resume with:" in line
    ]
    assert len(resume) == 1, first.stdout[-3000:]
    args = shlex.split(resume[0], comments=True)
    typed = shutil.which(args[0]) or args[0]
    assert os.path.realpath(typed) == os.path.realpath(sys.executable), args  # python, as typed
    assert args[1:3] == ["-m", "lightning_bytescale.cli.train"], args
    assert f"hydra.run.dir={run}" in args and "trainer.max_steps=4" in args and f"ckpt_path={last}" in args, (
        args
    )
    (first_run,) = _offline_runs(run)
    second = run_train(args[3:], tmp_path, command=args[:3])
    assert "cpu_smoke: 2 steps (resumed; step 4 now)" in second.stdout, second.stdout[-3000:]
    runs = _offline_runs(run)  # the same folder: both W&B runs, one id
    assert len(runs) == 2 and first_run in runs, runs
    assert {p.name.rsplit("-", 1)[1] for p in runs} == {first_run.name.rsplit("-", 1)[1]}
    upload = [line for line in second.stdout.splitlines() if "upload it with:" in line]
    assert upload and all(str(p) in upload[0] for p in runs), second.stdout[-2000:]
    bar = [line for line in second.stdout.splitlines() if "(to step 4)" in line]
    assert bar and "4/4" in bar[-1], second.stdout[-2000:]  # not 4/1 (the batches of an epoch)
