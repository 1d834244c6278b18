"""One way for tests to start N gloo ranks on loopback: a free port, a start method, a bounded join.

Every multi-process test that runs a function in each rank goes through :func:`run_ranks`:
it starts ``world`` processes with :func:`torch.multiprocessing.start_processes` (``fork``
when this process is safe to fork: one thread and no process group; else ``spawn``), waits
for them with a deadline, kills whatever is still alive when the deadline passes or a rank
fails, and re-raises the first rank's error; with ``check=False`` (a rank is meant to die or
hang) it raises nothing and returns each rank's exit code instead.  Ranks find each other through
``MASTER_ADDR=127.0.0.1`` and the port :func:`free_port` picked.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
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
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if threads:  # a slower launch (each rank imports torch), and a thread someone left running
        warnings.warn(
            f"ranks start with spawn, not fork: this process runs the threads {threads}; "
            "stop them (or keep the library from starting them: tests/conftest.py)",
            stacklevel=3,
        )
    safe = not threads and not (dist.is_available() and dist.is_initialized())
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


@dataclass(frozen=True)
class RankExits:
    """How ``run_ranks(..., check=False)`` ended: each rank's exit code and who was still running."""

    exitcodes: list[int | None]  # per rank; ``-SIGKILL`` for a rank killed when the wait ended
    alive: list[int]  # ranks still running when the wait ended (killed then)
    seconds: float  # from the start of the ranks to the end of the wait


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_s: float = 200.0,
    method: str | None = None,
    check: bool = True,
    wait_for: Iterable[int] | None = None,
) -> RankExits:
    """Run ``fn(rank, *args)`` in ``world`` processes and wait for them until ``timeout_s`` passes.

    ``check=True``: raise the first failed rank's error, or :class:`TimeoutError` at the deadline.
    ``check=False`` (tests where a rank is meant to die or hang): raise nothing, wait for the
    ranks in ``wait_for`` (default: all) until the deadline, and report the exit codes and the
    ranks still running then.  Either way no rank outlives the call.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method=method or start_method())
    start = time.monotonic()
    deadline = start + timeout_s
    try:
        if check:
            while not ctx.join(timeout=2):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{world} ranks of {fn.__name__} did not finish within {timeout_s:.0f} s"
                    )
        else:
            for rank in range(world) if wait_for is None else wait_for:
                ctx.processes[rank].join(max(0.1, deadline - time.monotonic()))
        seconds = time.monotonic() - start
        alive = [rank for rank, p in enumerate(ctx.processes) if p.is_alive()]
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    return RankExits([p.exitcode for p in ctx.processes], alive, seconds)


class DistCalls:
    """Counts this rank's calls of the named ``torch.distributed`` functions (wrapped on ``dist``).

    Use it inside a rank: the wrappers stay for the process's life.  Only code that looks the
    functions up on ``dist`` when it calls them is counted; leave ``isend``/``irecv`` unwrapped
    (``P2POp`` checks their identity).
    """

    def __init__(self, names: Iterable[str]) -> None:
        self.calls = dict.fromkeys(names, 0)
        for name in self.calls:
            original = getattr(dist, name)

            def wrapped(
                *args: Any, __name: str = name, __orig: Callable[..., Any] = original, **kwargs: Any
            ) -> Any:
                self.calls[__name] += 1
                return __orig(*args, **kwargs)

            setattr(dist, name, wrapped)

    def snapshot(self) -> dict[str, int]:
        return dict(self.calls)


class IssueOrder:
    """Records, in this rank, the order in which a step's communication is *issued*, by kind.

    Wraps ``dist.all_gather`` (``"plan"``: the plan-digest check), ``dist.batch_isend_irecv``
    (``"p2p"``: ring transfers), and ``dist.all_reduce`` / ``dist.reduce`` (``"bucket"`` on
    ``bucket_group``, the gradient sync's own group; ``"scalars"`` on any other group).  Start
    a step's record with :meth:`start` (until :meth:`stop`); :attr:`log` lists the kinds in
    issue order.
    """

    PHASES = ("plan", "p2p", "bucket", "scalars")

    def __init__(self, bucket_group: Any) -> None:
        self.bucket_group = bucket_group
        self.log: list[str] = []
        self.recording = False
        for name in ("all_gather", "batch_isend_irecv", "all_reduce", "reduce"):
            original = getattr(dist, name)

            def wrapped(
                *args: Any, __name: str = name, __orig: Callable[..., Any] = original, **kwargs: Any
            ) -> Any:
                if self.recording:
                    self.log.append(self._kind(__name, kwargs.get("group")))
                return __orig(*args, **kwargs)

            setattr(dist, name, wrapped)

    def _kind(self, name: str, group: Any) -> str:
        if name == "all_gather":
            return "plan"
        if name == "batch_isend_irecv":
            return "p2p"
        return "bucket" if group is not None and group is self.bucket_group else "scalars"

    def start(self) -> None:
        """Record from here on, into a fresh :attr:`log`."""
        self.log, self.recording = [], True

    def stop(self) -> None:
        self.recording = False

    @classmethod
    def follows_the_rule(cls, log: list[str]) -> bool:
        """Every kind is issued after every kind before it in :data:`PHASES` (plan, p2p, bucket, scalars)."""
        ranks = [cls.PHASES.index(kind) for kind in log]
        return all(a <= b for a, b in zip(ranks, ranks[1:]))


# ------------------------------------------------------- per-rank JSON reports of a worker
def save_report(outdir: str | Path, rank: int, report: dict) -> None:
    """Write rank ``rank``'s report as ``outdir/rank{rank}.json`` (read back by :func:`gather_reports`)."""
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(report))


def gather_reports(
    outdir: str | Path, fn: Callable[..., Any], world: int, *args: Any, **run: Any
) -> list[dict]:
    """``run_ranks(fn, world, free_port(), str(outdir), *args, **run)``, then every rank's saved report."""
    run_ranks(fn, world, free_port(), str(outdir), *args, **run)
    return [json.loads(Path(outdir, f"rank{r}.json").read_text()) for r in range(world)]
