"""The profiler's own processes on this host: a free loopback port and ``N`` started workers.

Both the point-to-point link probe (two gloo processes) and a tensor-parallel group's profile
(``N`` processes) start workers that meet on 127.0.0.1 and report through a queue; this is the
one way they are started: forked where that is safe (no CUDA initialised here), spawned
otherwise (then the worker and its arguments must pickle), as daemons so none outlives the caller.
"""

from __future__ import annotations

import multiprocessing
import socket
from collections.abc import Callable
from typing import Any

import torch

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def start_workers(target: Callable[..., None], world: int, *args: Any) -> tuple[list[Any], Any]:
    """``target(rank, port, *args, out)`` started in ``world`` processes; returns them and the queue ``out``."""
    methods = multiprocessing.get_all_start_methods()
    fork = "fork" in methods and not (torch.cuda.is_available() and torch.cuda.is_initialized())
    ctx = multiprocessing.get_context("fork" if fork else "spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(rank, port, *args, out), daemon=True) for rank in range(world)]
    for proc in procs:
        proc.start()
    return procs, out


def end_workers(procs: list[Any], wait_s: float) -> None:
    """Wait up to ``wait_s`` for each worker, then kill whichever still runs."""
    for proc in procs:
        proc.join(timeout=wait_s)
        if proc.is_alive():
            proc.kill()
            proc.join()


__all__ = ["LOOPBACK", "end_workers", "free_port", "start_workers"]
