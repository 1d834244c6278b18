"""Run a Python script in its own session for the process-lifetime tests, never leaving it behind.

Every script starts in a new session (its own process group), with an environment cleaned of
what pytest and earlier launchers left (``MASTER_PORT``, ``LOCAL_RANK``, ...), and the whole
group is SIGKILLed in ``finally`` whatever the test saw.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
# what pytest and launchers (Lightning, torchrun, SLURM) leave in the environment
_INHERITED = (
    "PYTEST_", "MASTER_", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "RANK", "PL_", "SLURM_", "TORCHELASTIC"
)  # fmt: skip


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_INHERITED)}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    pgid: int

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


@contextlib.contextmanager
def started(args: list[str], *, stdin: int | None = None, **env: str) -> Iterator[subprocess.Popen]:
    """``python *args`` in its own session; its whole process group is SIGKILLed on the way out."""
    process = subprocess.Popen(
        [sys.executable, *args],
        env=clean_env(**env),
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=str(REPO),
    )
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()


def finish(process: subprocess.Popen, timeout: float) -> Finished:
    """Wait for ``process`` (up to ``timeout``, then SIGKILL its group) and collect its output."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(
            f"the script did not end within {timeout} s; output:\n{stdout}\n{stderr}"
        ) from None
    return Finished(process.returncode, stdout, stderr, process.pid)


def run_python(code: str, *args: str, timeout: float = 60, **env: str) -> Finished:
    """Run ``python -c code *args`` to its end (its group is SIGKILLed after, whatever happened)."""
    with started(["-c", code, *args], **env) as process:
        return finish(process, timeout)


def wait_for_json(path: Path, timeout: float, ready=lambda data: True) -> dict:
    """Poll ``path`` until it holds JSON for which ``ready`` is true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            if ready(data):
                return data
        time.sleep(0.05)
    raise AssertionError(f"{path} did not become ready within {timeout} s")


def assert_sigterm_saves_once_and_exits_143(
    script: Path, out: Path, target: str, *, ready_s: float, end_s: float
) -> None:
    """Start the 2-rank ``script`` (mode ``train``), SIGTERM ``target`` once both ranks train, and
    check: exit 143, the preemption message naming the cause, exactly one checkpoint, no survivor.

    ``target`` is ``"group"`` (the whole process group, as SLURM does), ``"rank 1"`` or
    ``"launcher"`` (rank 0 alone).  The script writes ``out/rank<r>.json`` (pid, step, descendants).
    """
    import torch
    from _proc import group_alive

    from lightning_bytescale import proc
    from lightning_bytescale.lightning.preemption import EXIT_PREEMPTED

    with started([str(script), str(out), "train"]) as process:
        ready = lambda data: data["step"] >= 3  # noqa: E731 (training, handler installed)
        ranks = [wait_for_json(out / f"rank{r}.json", ready_s, ready) for r in (0, 1)]
        workers = {pid for report in ranks for pid in report["descendants"]} - {ranks[1]["pid"]}
        assert len(workers) == 2, ranks  # one loader worker per rank
        if target == "group":
            os.killpg(process.pid, signal.SIGTERM)
        elif target == "rank 1":
            os.kill(ranks[1]["pid"], signal.SIGTERM)
        else:
            os.kill(process.pid, signal.SIGTERM)
        run = finish(process, end_s)
        left = group_alive(process.pid, wait_s=5.0)
    assert run.returncode == EXIT_PREEMPTED, run.output[-4000:]
    assert "TRAINING ENDED NORMALLY" not in run.stdout
    cause = "on rank 0" if target in ("group", "launcher") else "a stop signal on another rank"
    assert "[ByteScale] preempted by" in run.stderr and cause in run.stderr, run.stderr[-3000:]
    assert [p.name for p in out.glob("hpc_ckpt_*")] == ["hpc_ckpt_1.ckpt"]
    assert torch.load(out / "hpc_ckpt_1.ckpt", weights_only=False)["global_step"] >= 3
    assert not left and not any(proc.is_alive(pid) for pid in workers)


def run_as_torchrun_rank(rank: int, world: int, port: str, out: Path, fit: Callable[[], None]) -> NoReturn:
    """Run ``fit()`` in this forked process as rank ``rank`` of ``world``, started as torchrun starts one.

    ``LOCAL_RANK`` and the rest are set (so Lightning launches nothing); stderr goes to
    ``out/stderr_<rank>.txt``; a finished ``fit`` writes ``out/done_<rank>`` and exits 0, an error
    prints its traceback there and exits 1 (``os._exit``: nothing waits on a dead peer).
    """
    import traceback

    import torch

    err = open(out / f"stderr_{rank}.txt", "w")  # noqa: SIM115 - kept open until os._exit
    os.dup2(err.fileno(), 2)
    sys.stderr = err
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK="0", LOCAL_RANK=str(rank))
    os.environ.update(env, WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    code = 0
    try:
        fit()
        (out / f"done_{rank}").write_text("finished")
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stderr.flush()
    os._exit(code)
