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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
_INHERITED = ("PYTEST_", "MASTER_", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "RANK", "PL_")


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
