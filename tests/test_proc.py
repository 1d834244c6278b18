"""Process-tree helpers and the data-loader worker set-up, checked against ``/proc``.

Loader workers must survive a SIGTERM sent to the whole job (the rank saves a checkpoint
first), still end when their own rank shuts them down, and die with their rank whatever
way it dies.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from _lifecycle import finish, started
from _proc import become_subreaper, command_line, wait_gone

from lightning_bytescale import proc
from lightning_bytescale.proc import LoaderWorkerInit


def _sleeper_tree() -> subprocess.Popen:
    """sh -> (sleep, sleep): a parent with two children."""
    return subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)


def test_descendants_are_found_and_killed_and_waited_for():
    shell = _sleeper_tree()
    try:
        deadline = time.monotonic() + 10
        while len(proc.descendants(shell.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        children = proc.descendants(shell.pid)
        assert len(children) == 2 and all(proc.info(c).ppid == shell.pid for c in children)
        assert shell.pid in proc.descendants() and set(children) <= set(proc.descendants())
        assert command_line(children[0]) == "sleep 60"
        killed = proc.kill_descendants(shell.pid)
        assert sorted(killed) == sorted(children)
        assert wait_gone(children, 5) == []
        assert proc.is_alive(shell.pid) or shell.poll() is not None  # the root itself is not killed
    finally:
        shell.kill()
        shell.wait()
    assert not proc.is_alive(shell.pid)


def test_a_process_name_with_spaces_and_parentheses_does_not_confuse_the_parser():
    code = "import ctypes, time; ctypes.CDLL(None).prctl(15, b'x) (y z', 0, 0, 0); print(1, flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()
        row = proc.info(child.pid)
        assert row is not None and row.ppid == os.getpid() and row.alive
    finally:
        child.kill()
        child.wait()
    assert not proc.is_alive(child.pid)


def test_a_child_whose_parent_died_before_the_request_exits_at_once():
    assert become_subreaper()  # the orphan is re-parented to this process: we can read its status
    code = textwrap.dedent(
        """
        import os, sys, time
        from lightning_bytescale import proc
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            time.sleep(0.5)  # the parent is gone by now
            proc.die_with_parent(parent=parent)
            os._exit(0)  # not reached
        print(pid, flush=True)
        os._exit(0)
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    orphan = int(run.stdout)
    _, status = os.waitpid(orphan, 0)
    assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGKILL


def test_the_worker_init_wraps_once_and_pickles():
    init = LoaderWorkerInit.wrap(print)
    assert LoaderWorkerInit.wrap(init) is init and init.user_fn is print
    assert pickle.loads(pickle.dumps(init)) == init
    assert LoaderWorkerInit.wrap(None).user_fn is None


RANK = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import torch
    from torch.utils.data import DataLoader
    from lightning_bytescale import proc
    from lightning_bytescale.proc import LoaderWorkerInit

    mode, out = sys.argv[1], Path(sys.argv[2])


    def user_init(worker_id):
        (out / f"user_init_{worker_id}").write_text(str(os.getpid()))


    if __name__ == "__main__":  # spawned workers import this file again
        loader = DataLoader(
            list(range(1000)), batch_size=2, num_workers=1, worker_init_fn=LoaderWorkerInit(user_init),
            multiprocessing_context=mode.split("-")[0],
        )
        batches = iter(loader)
        next(batches)
        workers = [w.pid for w in batches._workers]  # not a spawn start's resource tracker
        print(json.dumps({"rank": os.getpid(), "workers": workers, "tree": proc.descendants()}), flush=True)
        sys.stdin.readline()  # the test signals the worker meanwhile
        next(batches)
        print("next batch after the signal", flush=True)
        if mode.endswith("hang"):
            time.sleep(60)
    """
)


def _start_rank(tmp_path, mode: str):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    return started([str(script), mode, str(tmp_path)], stdin=subprocess.PIPE)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_worker_ignores_sigterm_from_outside_but_its_rank_still_shuts_it_down(tmp_path, start_method):
    with _start_rank(tmp_path, f"{start_method}-exit") as rank:
        started_rank = json.loads(rank.stdout.readline())
        (worker,) = started_rank["workers"]
        assert worker in started_rank["tree"]
        os.kill(worker, signal.SIGTERM)  # as SLURM or systemd would, to every process of the job
        time.sleep(0.5)
        assert proc.is_alive(worker), "the loader worker died of a SIGTERM from outside"
        rank.stdin.write("\n")
        rank.stdin.flush()
        run = finish(rank, 60)
    assert run.returncode == 0, run.output
    assert "next batch after the signal" in run.stdout  # the worker still serves batches
    assert (tmp_path / "user_init_0").read_text() == str(worker)  # the user's own init ran in it
    assert not proc.is_alive(worker)


@pytest.mark.timeout(120)
def test_a_worker_dies_with_its_rank(tmp_path):
    with _start_rank(tmp_path, "fork-hang") as rank:
        (worker,) = json.loads(rank.stdout.readline())["workers"]
        os.kill(rank.pid, signal.SIGKILL)
        rank.wait()
        assert wait_gone([worker], 5) == [], "the loader worker outlived its rank"
