"""The popen launcher: ranks die with rank 0, and a rank's death is named with its cause.

Each scenario runs a small script the way Lightning's launcher runs a training script: rank 0
(the script itself) re-runs it for rank 1 with ``LOCAL_RANK=1``.  Rank 1 does not import
Lightning, so a scenario takes about the time of one Lightning import.  Survivors are checked
in ``/proc``; every script's process group is SIGKILLed afterwards whatever happened.
"""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import textwrap

import pytest
from _lifecycle import TESTS, finish, started, wait_for_json
from _proc import group_alive
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.pytorch.strategies.launchers import subprocess_script as pl_script
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from lightning_bytescale import proc
from lightning_bytescale.engine.watchdog import EXIT_STEP_TIMEOUT
from lightning_bytescale.lightning.launcher import ByteScaleScriptLauncher, describe_exit, exit_code_for
from lightning_bytescale.lightning.preemption import EXIT_PREEMPTED

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path

    mode, out = sys.argv[1], Path(sys.argv[2])
    if os.environ.get("LOCAL_RANK", "0") != "0":  # rank 1: the behaviour under test, no Lightning import
        (out / "rank1.json").write_text(json.dumps({"pid": os.getpid(), "ppid": os.getppid()}))
        time.sleep(0.3)
        if mode in ("killed", "rank0_error"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif mode == "watchdog":
            sys.exit(124)
        elif mode == "preempted":
            sys.exit(143)
        time.sleep(120)  # stuck (orphan, straggler)
        sys.exit(0)

    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning_bytescale import proc
    from lightning_bytescale.lightning.launcher import ByteScaleScriptLauncher

    launcher = ByteScaleScriptLauncher(
        LightningEnvironment(), num_processes=2, num_nodes=1, poll_s=0.1, settle_s=0.5, exit_grace_s=1.0
    )


    def main():
        while not (out / "rank1.json").exists():
            time.sleep(0.02)
        (out / "rank0.json").write_text(json.dumps({"pid": os.getpid()}))
        if mode == "rank0_error":
            rank1 = launcher.procs[0]
            while rank1.poll() is None:
                time.sleep(0.01)
            raise RuntimeError("rank 0's own error, raised after rank 1 died")
        if mode == "straggler":
            return "rank 0 done"
        time.sleep(2.0 if mode == "preempted" else 60)
        return "rank 0 done"


    print(launcher.launch(main), flush=True)
    """
)


def _run(tmp_path, mode: str, *, kill_rank0: bool = False):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    with started([str(script), mode, str(tmp_path)]) as process:
        rank1 = wait_for_json(tmp_path / "rank1.json", 60)
        rank0 = wait_for_json(tmp_path / "rank0.json", 60)
        assert rank0["pid"] == process.pid and rank1["ppid"] == process.pid
        if kill_rank0:
            os.kill(process.pid, signal.SIGKILL)
        run = finish(process, 60)
        left = group_alive(process.pid, wait_s=5.0)
    return run, rank1["pid"], left


def test_a_rank_dies_with_rank_0_even_when_rank_0_is_sigkilled(tmp_path):
    run, rank1, left = _run(tmp_path, "orphan", kill_rank0=True)
    assert run.returncode == -signal.SIGKILL
    assert not proc.is_alive(rank1), "rank 1 outlived rank 0 (re-parented instead of killed)"
    assert not left


def test_a_rank_killed_by_sigkill_is_named_with_its_likely_cause(tmp_path):
    run, rank1, left = _run(tmp_path, "killed")
    assert run.returncode == 128 + signal.SIGKILL, run.output
    line = next(x for x in run.stderr.splitlines() if x.startswith("[ByteScale] rank 1"))
    assert f"rank 1 (pid {rank1}) was killed by SIGKILL (signal 9)" in line
    assert "out-of-memory killer" in line and "dmesg" in line
    assert "rank 0 exits with code 137" in run.stderr
    assert "rank 0 done" not in run.stdout and not left


def test_a_rank_ended_by_its_watchdog_passes_its_code_on(tmp_path):
    run, rank1, left = _run(tmp_path, "watchdog")
    assert run.returncode == EXIT_STEP_TIMEOUT, run.output
    assert f"rank 1 (pid {rank1}) exited with code 124: its step watchdog ended it" in run.stderr
    assert not left


def test_when_rank_0_fails_itself_the_earlier_death_of_a_rank_is_still_named(tmp_path):
    run, rank1, left = _run(tmp_path, "rank0_error")
    assert "rank 0's own error" in run.stderr  # rank 0's traceback is not cut short
    assert f"rank 1 (pid {rank1}) was killed by SIGKILL" in run.stderr
    assert run.returncode == 137, run.output
    assert not left


def test_a_preempted_rank_does_not_bring_rank_0_down(tmp_path):
    run, _, left = _run(tmp_path, "preempted")
    assert run.returncode == 0, run.output
    assert "rank 0 done" in run.stdout
    assert "[ByteScale] rank 1" not in run.stderr
    assert not left


def test_ranks_still_running_when_rank_0_exits_are_ended_after_the_grace_period(tmp_path):
    run, rank1, left = _run(tmp_path, "straggler")
    assert run.returncode == 0, run.output
    assert f"ranks [1] (pids [{rank1}]) are still running after 1 s; killing them" in run.stderr
    assert not proc.is_alive(rank1) and not left


@pytest.mark.parametrize(
    ("returncode", "code", "words"),
    [
        (-signal.SIGKILL, 137, ["SIGKILL (signal 9)", "out-of-memory killer", "dmesg"]),
        (-signal.SIGBUS, 128 + signal.SIGBUS, ["SIGBUS", "/dev/shm"]),
        (-signal.SIGSEGV, 128 + signal.SIGSEGV, ["SIGSEGV", "native code"]),
        (-signal.SIGTERM, 143, ["SIGTERM", "during set-up"]),
        (-(signal.SIGRTMIN + 3), 128 + signal.SIGRTMIN + 3, ["sent by another process"]),
        (EXIT_STEP_TIMEOUT, EXIT_STEP_TIMEOUT, ["step watchdog", "stuck"]),
        (3, 3, ["exited with code 3", "its own error is above"]),
    ],
)
def test_exit_lines_and_codes(returncode, code, words):
    assert exit_code_for(returncode) == code
    line = describe_exit(4, 1234, returncode)
    assert line.startswith("[ByteScale] rank 4 (pid 1234) ") and "\n" not in line
    for word in words:
        assert word in line


def test_the_lightning_internals_the_launcher_relies_on_are_unchanged():
    """Fails loudly when Lightning changes what ``ByteScaleScriptLauncher`` overrides or wraps."""
    # launch(): re-done in ByteScaleScriptLauncher.launch with this module's observer
    assert sorted(_SubprocessScriptLauncher.launch.__code__.co_names) == [
        "_call_children_scripts",
        "_launch_process_observer",
        "_set_num_threads_if_needed",
        "cluster_environment",
        "creates_processes_externally",
        "num_nodes",
        "num_processes",
        "procs",
        "validate_settings",
    ]
    params = list(inspect.signature(_SubprocessScriptLauncher.launch).parameters)
    assert params == ["self", "function", "args", "trainer", "kwargs"]
    assert list(inspect.signature(_SubprocessScriptLauncher.__init__).parameters) == [
        "self",
        "cluster_environment",
        "num_processes",
        "num_nodes",
    ]
    # _call_children_scripts(): starts ranks with the module-level name `subprocess.Popen`
    assert pl_script.subprocess is subprocess
    assert {"subprocess", "Popen", "procs"} <= set(
        _SubprocessScriptLauncher._call_children_scripts.__code__.co_names
    )
    # the observer thread: run() loops over _run() until it returns True
    assert list(inspect.signature(_ChildProcessObserver.__init__).parameters) == [
        "self",
        "main_pid",
        "child_processes",
        "sleep_period",
    ]
    assert {"_finished", "_run", "_sleep_period"} <= set(_ChildProcessObserver.run.__code__.co_names)
    assert issubclass(ByteScaleScriptLauncher, _SubprocessScriptLauncher)


def test_the_module_patch_is_undone_even_when_starting_a_rank_fails(monkeypatch):
    from lightning.fabric.plugins.environments import LightningEnvironment

    monkeypatch.setenv("LOCAL_RANK", "1")  # Lightning refuses to start ranks from a rank > 0
    launcher = ByteScaleScriptLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)
    with pytest.raises(RuntimeError, match="local_rank > 0"):
        launcher._call_children_scripts()
    assert pl_script.subprocess is subprocess


def test_preempted_and_successful_ranks_are_clean_exits():
    assert EXIT_PREEMPTED == 143
    launcher = ByteScaleScriptLauncher.__new__(ByteScaleScriptLauncher)
    done = [
        subprocess.Popen(["true"]),
        subprocess.Popen(["sh", "-c", "exit 143"]),
        subprocess.Popen(["false"]),
    ]
    for p in done:
        p.wait()
    launcher.procs = done
    launcher.num_processes = 4

    class Env:
        @staticmethod
        def node_rank() -> int:
            return 1

    launcher.cluster_environment = Env()  # type: ignore[assignment]
    assert [(rank, p.returncode) for rank, p in launcher.failed_ranks()] == [(7, 1)]  # node 1: ranks 5, 6, 7


def test_a_rank_stuck_in_user_code_ends_itself_and_the_run_leaves_nothing(tmp_path):
    """Case 5 under Lightning: rank 1 hangs in ``training_step``; its watchdog names where, and
    rank 0, its loader worker and rank 1's are all gone when the run ends."""
    with started([str(TESTS / "_ddp_script.py"), str(tmp_path), "stuck"]) as process:
        ranks = [wait_for_json(tmp_path / f"rank{r}.json", 120, lambda d: d["step"] >= 2) for r in (0, 1)]
        run = finish(process, 90)
        left = group_alive(process.pid, wait_s=5.0)
    everyone = {pid for report in ranks for pid in report["descendants"]} | {ranks[1]["pid"]}
    assert run.returncode == EXIT_STEP_TIMEOUT, run.output[-4000:]
    assert "rank 1: step watchdog: no progress for" in run.stderr
    assert "in training_step of step 2." in run.stderr and "in training_step" in run.stderr
    assert f"rank 1 (pid {ranks[1]['pid']}) exited with code 124: its step watchdog ended it" in run.stderr
    assert "TRAINING ENDED NORMALLY" not in run.stdout
    assert not left and not any(proc.is_alive(pid) for pid in everyone)
