"""One way for tests to start N gloo ranks on loopback: a free port, a start method, a bounded join.

Every multi-process test that runs a function in each rank goes through :func:`run_ranks`:
it starts ``world`` processes with :func:`torch.multiprocessing.start_processes` (``fork``
when this process is safe to fork: one thread and no process group; else ``spawn``), waits
for them with a deadline, kills whatever is still alive when the deadline passes or a rank
fails, and re-raises the first rank's error.  Ranks find each other through
``MASTER_ADDR=127.0.0.1`` and the port :func:`free_port` picked.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it; a rank binds it a moment later)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def start_method() -> str:
    """``fork`` when this process holds one thread and no process group, else ``spawn``.

    ``BYTESCALE_TEST_START_METHOD`` overrides it (CI can force ``spawn`` everywhere).
    """
    forced = os.environ.get("BYTESCALE_TEST_START_METHOD")
    if forced:
        return forced
    safe = threading.active_count() == 1 and not (dist.is_available() and dist.is_initialized())
    return "fork" if safe and "fork" in mp.get_all_start_methods() else "spawn"


def init_gloo(rank: int, world: int, port: int, *, timeout_s: float = 60.0) -> None:
    """Join the loopback gloo group of ``world`` ranks on ``port`` (call inside a rank)."""
    from datetime import timedelta

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{LOOPBACK}:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_s: float = 200.0,
    method: str | None = None,
) -> None:
    """Run ``fn(rank, *args)`` in ``world`` processes; raise if one fails or the deadline passes."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method=method or start_method())
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks of {fn.__name__} did not finish within {timeout_s:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
