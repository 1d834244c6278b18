"""Kill a run mid-epoch (SIGKILL, in the middle of a step) and resume it from its last checkpoint.

``tests/lightning/test_strategy.py`` resumes runs that *stopped* cleanly at ``max_steps``; here the run
dies: every process of a 3-rank run (its own session, Lightning's fork launcher) is SIGKILLed
during the forward pass of step 3 of an 8-step epoch, after the checkpoint of step 2.  Step 2
was trained but never saved, so the resumed runs must redo it.  Resumed on the same world (2)
and on a smaller one (2; the batches' longest sequence needs 2 ranks), the logged steps and final parameters must equal the independent
single-process float64 reference of ``tests/_strategy_helpers.py`` (``reference``), which never
stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import _strategy_helpers as ts  # the strategy tests' fixtures and reference
import pytest
from _lifecycle import TESTS, clean_env  # TESTS: on sys.path in the script, for _strategy_helpers
from _proc import group_alive

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

KILL_STEP = 3
CKPT_EVERY = 2
TOTAL_STEPS = 5

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import torch
    torch.set_num_threads(1)
    import _strategy_helpers as t

    class Killed(t.TinyLM):
        def training_step(self, mb, batch_idx):
            if self.trainer.global_step == {kill}:  # whichever rank runs a micro-batch of the step
                os.killpg(os.getpgrp(), signal.SIGKILL)  # the whole run dies at once, mid-step
            return super().training_step(mb, batch_idx)

    t.TinyLM = Killed
    t.fit(__import__("pathlib").Path(sys.argv[1]), 3, max_steps={total}, ckpt_every={every})
    print("NOT KILLED")
    """
)


def _killed_run(out: Path) -> Path:
    script = out / "killed.py"
    script.write_text(SCRIPT.format(tests=str(TESTS), kill=KILL_STEP, total=TOTAL_STEPS, every=CKPT_EVERY))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(out / "killed")],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    orphans = True
    try:
        output, _ = proc.communicate(timeout=150)
        orphans = group_alive(proc.pid)
    finally:
        if proc.poll() is None or orphans:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not orphans, "processes of the killed run outlived it"
    assert proc.returncode == -signal.SIGKILL, output[-3000:]
    ckpts = sorted((out / "killed" / "ckpt").glob("*.ckpt"))
    assert [p.name for p in ckpts] == [f"epoch=0-step={CKPT_EVERY}.ckpt"], ckpts
    return ckpts[-1]


RESUME_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import torch
    torch.set_num_threads(1)
    import _strategy_helpers as t
    from pathlib import Path
    t.fit(Path(sys.argv[1]), int(sys.argv[2]), max_steps={total}, resume=Path(sys.argv[3]))
    """
)


def _resumed_run(out: Path, world: int, ckpt: Path) -> None:
    """The resumed run in a fresh interpreter, as a user restarts a job (not forked from pytest)."""
    script = out.parent / f"resume_{world}.py"
    script.write_text(RESUME_SCRIPT.format(tests=str(TESTS), total=TOTAL_STEPS))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(out), str(world), str(ckpt)],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None or group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-3000:]


def test_killed_mid_epoch_resumes_exactly_on_the_same_and_a_smaller_world(tmp_path):
    ckpt = _killed_run(tmp_path)
    expected, losses = ts.reference(TOTAL_STEPS)
    for world in (3, 2):
        out = tmp_path / f"resumed_{world}"
        _resumed_run(out, world, ckpt)
        for r in range(world):
            rows = ts.read_rows(out, r)
            assert [row["step"] for row in rows] == list(range(CKPT_EVERY, TOTAL_STEPS)), rows
            assert [row["logged"] for row in rows] == pytest.approx(losses[CKPT_EVERY:], abs=1e-12)
        ts.assert_params_equal(out, world, expected)
