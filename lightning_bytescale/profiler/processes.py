"""The profiler's own processes on this host: a free loopback port and ``N`` started workers.

Both the point-to-point link probe (two gloo processes) and a tensor-parallel group's profile
(``N`` processes) start workers that meet on 127.0.0.1 and report through a queue; this is the
one way they are started, as daemons so none outlives the caller, by one rule
(:func:`start_method`): workers that use CUDA are *spawned*, CPU workers are *forked* where the
platform can fork.  A forked child cannot use CUDA once its parent has touched the driver, and
``torch.cuda.is_available()`` (which every CUDA run asks first) already initialises it, so a
forked NCCL worker fails at its first CUDA call, whatever ``torch.cuda.is_initialized()`` says.
A CPU worker (gloo on host tensors) never touches CUDA, and forking it saves each worker the
seconds of importing torch again and asks nothing to pickle.  A spawned worker gets its target
and arguments pickled: they are checked before any process starts, so a model factory that
cannot pickle (a lambda, a function defined inside another) is a :class:`ProfileError` naming
the fix.
"""

from __future__ import annotations

import multiprocessing
import socket
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

from lightning_bytescale.profiler.errors import ProfileError

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def start_method(device_type: str) -> str:
    """``"spawn"`` for workers that use CUDA (and where the platform cannot fork), else ``"fork"``."""
    if device_type == "cuda" or "fork" not in multiprocessing.get_all_start_methods():
        return "spawn"
    return "fork"


def check_pickles(target: Callable[..., None], args: tuple) -> None:
    """Refuse, before any process starts, a spawned worker whose target or arguments cannot pickle."""
    try:
        ForkingPickler.dumps((target, args))
    except Exception as err:  # pickle raises PicklingError, AttributeError or TypeError by object
        raise ProfileError(
            f"the profiler's CUDA workers are spawned processes, which get the model (or its factory) "
            f"pickled, and it does not pickle ({type(err).__name__}: {err}). Pass an nn.Module or a "
            "factory defined at the top level of an importable module (not a lambda or a function "
            "defined inside another; functools.partial of such a function works)"
        ) from err


def start_workers(
    target: Callable[..., None], world: int, *args: Any, device_type: str = "cpu"
) -> tuple[list[Any], Any]:
    """``target(rank, port, *args, out)`` started in ``world`` processes; returns them and the queue ``out``.

    ``device_type`` is the device the workers use (``"cuda"``: spawned, :func:`start_method`).
    """
    method = start_method(device_type)
    if method == "spawn":
        check_pickles(target, args)
    ctx = multiprocessing.get_context(method)
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


__all__ = ["LOOPBACK", "check_pickles", "end_workers", "free_port", "start_method", "start_workers"]
