"""What a run leaves on disk (issue 29, item 7): no run folder from a run that failed before its
first step, and one copy of each checkpoint (``last.ckpt`` is a link to the newest), which
resumes, the sharded folder of ``strategy.zero=1`` included."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest
from _recipe_helpers import run_train

from lightning_bytescale.lightning.checkpoint import is_sharded_checkpoint

pytestmark = pytest.mark.multiprocess


def _run_folders(tmp: Path) -> list[Path]:
    return sorted(p.parent for p in tmp.rglob(".hydra"))


@pytest.mark.parametrize(
    "args, code",
    [
        (["data=text"], 2),  # a one-line error before any process starts
        (["data=github", "data.tokens_per_step=100", "data.context_length=512"], 2),  # found in setup
        # a setting the strategy refuses in fit (one line too, since issue 37)
        (["experiment=cpu_smoke", "trainer.accumulate_grad_batches=2"], 2),
    ],
    ids=["before launch", "in setup", "in fit"],
)
def test_a_run_that_fails_before_its_first_step_leaves_no_run_folder(tmp_path, args, code):
    proc = run_train([*args, "trainer.devices=1", "trainer.max_steps=1"], tmp_path, check=False)
    assert proc.returncode == code, proc.stderr[-3000:]
    assert _run_folders(tmp_path) == [], proc.stderr[-3000:]
    assert list((tmp_path / "outputs").iterdir()) == []  # outputs/<name>/ went with its only run


def test_a_failed_run_keeps_a_folder_that_held_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"an earlier run's")
    proc = run_train(["data=text", f"hydra.run.dir={run}"], tmp_path, check=False)
    assert proc.returncode == 2
    assert (run / "checkpoints" / "last.ckpt").read_bytes() == b"an earlier run's"


@pytest.mark.timeout(300)
def test_one_copy_of_each_checkpoint_and_last_resumes_the_sharded_folder(tmp_path):
    first = run_train(
        ["experiment=cpu_smoke", "logger=csv", "trainer.enable_checkpointing=true", "strategy.zero=1",
         "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'a'}"],
        tmp_path,
    )  # fmt: skip
    folder = tmp_path / "a" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    last = folder / "last.ckpt"
    assert last.is_symlink() and os.readlink(last) == "epoch=0-step=2.ckpt"
    assert is_sharded_checkpoint(last)  # a folder every rank wrote its part of, reached through the link
    command = next(line for line in first.stdout.splitlines() if "resume with:" in line)
    args = shlex.split(command.split("resume with:", 1)[1], comments=True)[1:]
    assert f"ckpt_path={last}" in args
    second = run_train([*args, f"hydra.run.dir={tmp_path / 'b'}"], tmp_path)
    assert "cpu_smoke: 2 steps (resumed; step 4 now)" in second.stdout, second.stdout[-2000:]
    assert os.readlink(tmp_path / "b" / "checkpoints" / "last.ckpt") == "epoch=0-step=4.ckpt"
