"""``ByteScaleStrategy`` under a scheduler: SIGTERM, a stuck rank, a killed rank (issue cases 5-7).

Each test runs ``tests/_bytescale_script.py`` (a plain script, ``strategy="bytescale"``, the
default popen launcher, ``ByteScaleDataModule`` with a loader worker per rank) in its own
session and checks the exit code, the message, the checkpoint, and ``/proc`` for survivors.
"""

from __future__ import annotations

import os
import re
import signal

import pytest
from _lifecycle import TESTS, assert_sigterm_saves_once_and_exits_143, finish, started, wait_for_json
from _proc import group_alive

from lightning_bytescale import proc
from lightning_bytescale.engine.watchdog import EXIT_STEP_TIMEOUT

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
SCRIPT = str(TESTS / "_bytescale_script.py")


@pytest.mark.parametrize("target", ["group", "rank 1", "launcher"])
def test_sigterm_saves_one_checkpoint_on_every_rank_and_exits_143(tmp_path, target):
    assert_sigterm_saves_once_and_exits_143(
        TESTS / "_bytescale_script.py", tmp_path, target, ready_s=150, end_s=90
    )


def test_a_rank_stuck_in_user_code_ends_itself_naming_where_and_leaves_nothing(tmp_path):
    with started([SCRIPT, str(tmp_path), "stuck"]) as process:
        ranks = [wait_for_json(tmp_path / f"rank{r}.json", 150, lambda d: d["step"] >= 2) for r in (0, 1)]
        run = finish(process, 120)
        left = group_alive(process.pid, wait_s=5.0)
    everyone = {pid for report in ranks for pid in report["descendants"]} | {ranks[1]["pid"]}
    assert run.returncode == EXIT_STEP_TIMEOUT, run.output[-4000:]
    assert "rank 1: step watchdog: no progress for" in run.stderr, run.stderr[-3000:]
    assert re.search(r"in micro-batch \d+ of step \d+", run.stderr), run.stderr[
        -3000:
    ]  # the strategy's phase
    assert "ByteScaleStrategy(watchdog=...)" in run.stderr  # the option to raise
    assert not left and not any(proc.is_alive(pid) for pid in everyone)


def test_a_rank_killed_by_sigkill_is_named_and_nothing_is_left(tmp_path):
    with started([SCRIPT, str(tmp_path), "train"]) as process:
        ranks = [wait_for_json(tmp_path / f"rank{r}.json", 150, lambda d: d["step"] >= 3) for r in (0, 1)]
        os.kill(ranks[1]["pid"], signal.SIGKILL)
        run = finish(process, 90)
        left = group_alive(process.pid, wait_s=5.0)
    everyone = {pid for report in ranks for pid in report["descendants"]}
    assert run.returncode == 128 + signal.SIGKILL, run.output[-4000:]
    assert f"rank 1 (pid {ranks[1]['pid']})" in run.stderr and "SIGKILL" in run.stderr, run.stderr[-3000:]
    assert not left and not any(proc.is_alive(pid) for pid in everyone)
