"""Process lifetime on Linux: who descends from whom, ending a tree, dying with a parent.

A training rank owns other processes (the ranks a launcher started, data-loader workers) and
none of them may outlive it: a rank re-parented to init after its run failed holds its
accelerator and its memory forever.  This module reads the process tree from ``/proc`` (every
``/proc/<pid>/stat`` names its parent; the ``task/*/children`` files need a kernel option that
is often off), ends a tree with a signal, and ties a process's life to its parent's with
``prctl(PR_SET_PDEATHSIG)`` so that the kernel kills it when the parent dies, whatever way the
parent died (an uncaught error, ``os._exit``, SIGKILL, the out-of-memory killer).

Off Linux the tree functions see no processes and :func:`die_with_parent` does nothing.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_PROC = Path("/proc")
PR_SET_PDEATHSIG = 1
_libc: Any = None


def _load_libc() -> Any:
    """The C library (loaded once; ``None`` off Linux)."""
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _prctl(option: int, value: int) -> bool:
    """``prctl(option, value)``; False where it is not available or refused."""
    libc = _load_libc()
    return libc is not None and libc.prctl(option, value, 0, 0, 0) == 0


@dataclass(frozen=True)
class ProcessInfo:
    """One row of the process table: a process's parent and its state letter (``Z``: zombie)."""

    pid: int
    ppid: int
    state: str

    @property
    def alive(self) -> bool:
        return self.state not in ("Z", "X", "x")


def _read_stat(pid: int) -> ProcessInfo | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:  # the process exited while we looked (or there is no /proc)
        return None
    fields = text[text.rfind(b")") + 2 :].split()  # the name may hold spaces and parentheses
    return ProcessInfo(pid, int(fields[1]), fields[0].decode())


def pids() -> set[int]:
    """The pids of every process this one can see (one directory listing: cheap)."""
    try:
        return {int(name) for name in os.listdir(_PROC) if name.isdigit()}
    except OSError:
        return set()


def process_table() -> dict[int, ProcessInfo]:
    """Every process this one can see, by pid."""
    table = {}
    for pid in pids():
        row = _read_stat(pid)
        if row is not None:
            table[pid] = row
    return table


def info(pid: int) -> ProcessInfo | None:
    """The process table row of ``pid``, ``None`` when it does not exist."""
    return _read_stat(pid)


def is_alive(pid: int) -> bool:
    """Whether ``pid`` exists and has not exited (a zombie has exited)."""
    row = info(pid)
    return row is not None and row.alive


def descendants(pid: int | None = None) -> list[int]:
    """Live (non-zombie) descendants of ``pid`` (default: this process), parents before children."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[ProcessInfo]] = {}
    for row in process_table().values():
        children.setdefault(row.ppid, []).append(row)
    found: list[int] = []
    queue = [root]
    while queue:
        for child in children.get(queue.pop(0), ()):
            queue.append(child.pid)  # a zombie's children are re-parented already, but walk it anyway
            if child.alive:
                found.append(child.pid)
    return found


def signal_all(pids: Iterable[int], sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` to each of ``pids``; returns those that still existed."""
    hit = []
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            continue
        hit.append(pid)
    return hit


def kill_descendants(pid: int | None = None, sig: int = signal.SIGKILL, rounds: int = 3) -> list[int]:
    """Signal every live descendant of ``pid`` (default: this process); returns the pids signalled.

    The tree is read again after each round, so processes forked while the first round was
    being sent are caught too (with SIGKILL a round leaves nothing that can fork again).
    """
    signalled: list[int] = []
    for _ in range(max(1, rounds)):
        batch = [p for p in descendants(pid) if p not in signalled]
        if not batch:
            break
        signalled += signal_all(batch, sig)
    return signalled


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies.

    ``parent`` is the pid the caller expects as its parent (the process that started it).  If
    that process is already gone when the request is in place (it died between starting us
    and this call), this process exits at once with ``128 + sig``, as the kernel would have
    ended it.  Returns whether the request is in place (False off Linux).

    The kernel ties the request to the *thread* that created this process: start children
    from a thread that lives as long as the parent (the main thread).
    """
    if not _prctl(PR_SET_PDEATHSIG, int(sig)):
        return False
    if parent is not None and os.getppid() != parent and not is_alive(parent):
        os._exit(128 + int(sig))
    return True


@dataclass(frozen=True)
class DieWithParent:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: the child dies with the process starting it.

    Built in the parent (``DieWithParent(os.getpid())``) so the child, between ``fork`` and
    ``exec``, only makes one prepared system call.  The request survives ``exec``.
    """

    parent: int
    sig: int = signal.SIGKILL

    def __post_init__(self) -> None:
        _load_libc()  # now, in the parent: the forked child should not have to load a library

    def __call__(self) -> None:
        die_with_parent(self.sig, self.parent)


def ignore_sigterm_except_from(sender: int) -> threading.Thread:
    """Ignore SIGTERM unless process ``sender`` sent it; from ``sender`` it ends this process.

    SIGTERM is blocked in every thread and taken by a daemon thread with ``sigwaitinfo``,
    which sees who sent it.  Call it from the main thread before starting other threads.
    Exits with ``128 + SIGTERM``, what the default action would report to a shell.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def take() -> None:
        while True:
            info = signal.sigwaitinfo({signal.SIGTERM})
            if info.si_pid == sender:
                os._exit(128 + signal.SIGTERM)

    thread = threading.Thread(target=take, name="sigterm-from-parent-only", daemon=True)
    thread.start()
    return thread


@dataclass(frozen=True)
class LoaderWorkerInit:
    """``worker_init_fn`` for data-loader workers: SIGTERM from outside is ignored; they die with their rank.

    A scheduler stopping a job sends SIGTERM to every process of it (SLURM, systemd) or to its
    process group; the rank turns it into a checkpoint at the next step boundary
    (:mod:`lightning_bytescale.lightning.preemption`) and still needs its workers until then.  So a
    worker ignores SIGTERM from anyone but its rank (the rank's own ``terminate()`` at shut-down
    still ends it), and gets SIGKILL from the kernel when its rank dies.  Ctrl-C (SIGINT to the
    terminal's process group) is ignored too: the rank decides what it means (``bytescale-train``
    checkpoints at the next step, as for SIGTERM).  ``user_fn`` (the
    caller's own ``worker_init_fn``) runs afterwards.  Picklable, so it also works with the
    ``spawn`` and ``forkserver`` worker start methods.
    """

    user_fn: Callable[[int], Any] | None = None

    @classmethod
    def wrap(cls, user_fn: Callable[[int], Any] | None) -> LoaderWorkerInit:
        """``user_fn`` wrapped once (wrapping a :class:`LoaderWorkerInit` again returns it)."""
        return user_fn if isinstance(user_fn, LoaderWorkerInit) else cls(user_fn)

    def __call__(self, worker_id: int) -> None:
        creator = multiprocessing.parent_process()
        rank = creator.pid if creator is not None else os.getppid()
        # With "forkserver" the kernel parent is the fork server, not the rank that asked for
        # the worker; die_with_parent then only exits when the rank itself is gone.
        die_with_parent(signal.SIGKILL, rank)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if sys.platform.startswith("linux"):
            ignore_sigterm_except_from(rank)
        if self.user_fn is not None:
            self.user_fn(worker_id)
