"""docs/multi-node.md's launch paths on this machine: torchrun, and srun's environment on two "nodes".

Under ``torchrun`` Lightning picks ``TorchElasticEnvironment``; under ``srun`` (``SLURM_NTASKS``
set, job name not ``bash``/``interactive``) ``SLURMEnvironment``.  Both create the processes
themselves, so the strategy's launcher starts no process (it only checks devices x num_nodes) and takes ranks, world size and node rank from
the environment.  Each run trains a few steps in float64 on CPU ranks (gloo, loopback) and must log
the loss of one process on the whole batch.  ``srun`` is not installed here: the test sets the
variables srun sets for each task (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ...).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _lifecycle import TESTS, clean_env  # clean_env: no launcher variables of this run
from _ranks import free_port
from _strategy_helpers import reference
from test_strategy_launch import SCRIPT as TWO_NODE_SCRIPT

pytestmark = pytest.mark.multiprocess

STEPS = int(re.search(r"max_steps=(\d+)", TWO_NODE_SCRIPT).group(1))  # what the script trains
# The two-node script of test_strategy_launch (float64, writes done_<rank>.json with
# rank, world, node and the logged loss), plus what the environment and the strategy made of it.
SCRIPT = TWO_NODE_SCRIPT + textwrap.dedent(
    """
    with open(os.path.join(out, f"env_{{trainer.global_rank}}.json"), "w") as fh:
        json.dump({{"local": trainer.local_rank, "launcher": len(getattr(trainer.strategy.launcher, "procs", [])),
                   "environment": type(trainer.strategy.cluster_environment).__name__}}, fh)
    """
)


def _run(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    errors = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        if p.returncode != 0:
            errors.append(f"exit {p.returncode}: {err[-3000:]}")
    assert not errors, "\n".join(errors)


def _results(out: Path, world: int) -> list[dict]:
    return [
        {
            **json.loads((out / f"done_{r}.json").read_text()),
            **json.loads((out / f"env_{r}.json").read_text()),
        }
        for r in range(world)
    ]


def _assert_single_process_loss(done: list[dict]) -> None:
    _, losses = reference(STEPS)
    for row in done:
        assert row["loss"] == pytest.approx(losses[-1], abs=1e-12)


def test_torchrun_one_node_two_processes(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=str(TESTS)))
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    command = [
        torchrun,
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        str(script),
        str(tmp_path),
        "2",
        "1",
    ]
    proc = subprocess.Popen(
        command, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    _run([proc], timeout=240)
    done = _results(tmp_path, 2)
    assert [(d["rank"], d["local"], d["node"], d["world"]) for d in done] == [(0, 0, 0, 2), (1, 1, 0, 2)]
    assert {d["environment"] for d in done} == {"TorchElasticEnvironment"}
    assert not any(d["launcher"] for d in done)  # torchrun made the processes: the launcher started none
    _assert_single_process_loss(done)


def test_srun_two_nodes_one_task_each(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=str(TESTS)))
    port = free_port()
    job = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "2", "SLURM_NNODES": "2",
           "SLURM_NTASKS_PER_NODE": "1", "SLURM_NODELIST": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path), "1", "2"],
            env=clean_env(**job, SLURM_PROCID=str(node), SLURM_LOCALID="0", SLURM_NODEID=str(node)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    _run(procs, timeout=240)
    done = _results(tmp_path, 2)
    assert [(d["rank"], d["local"], d["node"], d["world"]) for d in done] == [(0, 0, 0, 2), (1, 0, 1, 2)]
    assert {d["environment"] for d in done} == {"SLURMEnvironment"}
    assert not any(d["launcher"] for d in done)
    _assert_single_process_loss(done)


def test_devices_that_disagree_with_the_environment_are_refused_before_anything_starts(tmp_path):
    """torchrun started 2 processes per node but the Trainer says devices=1: a clear error, at once."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=str(TESTS)))
    elastic = {"LOCAL_RANK": "0", "RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "TORCHELASTIC_RUN_ID": "test", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "1", "1"],
        env=clean_env(**elastic),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "does not match the world size (2)" in done.stderr, done.stderr[-3000:]
