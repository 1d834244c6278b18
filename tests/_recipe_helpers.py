"""Run ``bytescale-train`` as users start it: a subprocess with a clean, offline environment.

Shared by the recipe tests and the sharded-checkpoint test (``tests/`` is on ``sys.path``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def train_command() -> list[str]:
    """The installed ``bytescale-train`` next to this Python, else its module."""
    exe = Path(sys.executable).with_name("bytescale-train")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "lightning_bytescale.cli.train"]


# what a launcher (Lightning, torchrun) left in pytest's environment: never passed on
LAUNCHER_VARS = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_train(
    args: list[str],
    tmp: Path,
    timeout: float = 300,
    *,
    check: bool = True,
    command: list[str] | None = None,
    **env: str,
) -> subprocess.CompletedProcess:
    """``bytescale-train *args`` (or ``command *args``) in ``tmp`` without launcher variables or W&B
    credentials, W&B offline, plus ``env``; with ``check`` it must exit 0."""
    clean = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY" and k not in LAUNCHER_VARS}
    clean.update(
        OMP_NUM_THREADS="1",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        HYDRA_FULL_ERROR="1",
        BYTESCALE_DATA_CACHE=str(tmp / "cache"),
        NETRC=str(tmp / "no-netrc"),
        **env,
    )
    proc = subprocess.run(
        [*(command or train_command()), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean,
        cwd=tmp,
    )
    if check:
        assert proc.returncode == 0, (
            f"exit {proc.returncode}\nSTDOUT\n{proc.stdout[-4000:]}\nSTDERR\n{proc.stderr[-6000:]}"
        )
    return proc


def run_doc_script(code: str, tmp: Path, timeout: float) -> subprocess.CompletedProcess:
    """A documented example ``code`` run as a script in ``tmp`` (no launcher variables, its own data
    cache); it must exit 0."""
    script = tmp / "example.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(OMP_NUM_THREADS="1", BYTESCALE_DATA_CACHE=str(tmp / "cache"))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc
