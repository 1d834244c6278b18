"""The launchers: popen ranks that never outlive rank 0 and name why a rank died; forks that start clean.

Lightning's default launcher (``start_method="popen"``) has rank 0 re-run the script for ranks
1.. with :class:`subprocess.Popen`.  Two things go wrong with it:

* when rank 0 dies, its children are re-parented to init and live on; a rank stuck in user
  code (or stopped) then holds its memory and accelerator forever;
* when a child is killed (SIGKILL from the out-of-memory killer, a scheduler), the launcher
  only logs ``Child process ... terminated with code -9`` and SIGKILLs itself (exit 137).

:class:`ByteScaleScriptLauncher` starts each rank with ``prctl(PR_SET_PDEATHSIG, SIGKILL)``
(:class:`~lightning_bytescale.proc.DieWithParent`), so the kernel ends it when rank 0 dies in
any way.  Its observer thread prints one line naming the rank, the pid, the signal and the
likely cause, ends the others and exits with a documented code (:func:`exit_code_for`).  When
rank 0's interpreter exits on its own, it waits ``exit_grace_s`` for the other ranks (a
preempted or finished run), then ends the rest.

:class:`ForkCollectingLauncher` is Lightning's fork/spawn launcher that collects the parent's
garbage before it forks.  Garbage left by an earlier run in the same interpreter (a notebook, a
test session) can hold a process group or a store whose C++ destructor joins a thread that
only the parent has (the TCPStore's server loop); collected in a forked rank, that destructor
waits forever for a thread that was never copied, with the interpreter lock held.

Lightning's private launcher names (``_SubprocessScriptLauncher``, ``_MultiProcessingLauncher``,
``_ChildProcessObserver`` and the names their ``launch`` uses) come from
:mod:`~lightning_bytescale.lightning.compat`; ``tests/lightning/test_lightning_compat.py`` and
``tests/lightning/test_launcher.py`` fail when they change.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins import ClusterEnvironment
from typing_extensions import override

from lightning_bytescale import proc
from lightning_bytescale.engine.watchdog import EXIT_STEP_TIMEOUT
from lightning_bytescale.lightning.compat import (
    _ChildProcessObserver,
    _MultiProcessingLauncher,
    _set_num_threads_if_needed,
    _SubprocessScriptLauncher,
)
from lightning_bytescale.lightning.compat import subprocess_script_module as _pl_script
from lightning_bytescale.lightning.preemption import EXIT_PREEMPTED

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

#: The exit code of a rank that raised the same error (type and message) as a lower rank: the lower
#: rank printed it with its traceback; this one ends without printing it a second time.
EXIT_SAME_ERROR = 3

# Exit codes a child may end with that are not a failure of its own to report: success, a preempted
# rank that saved its share of the checkpoint (rank 0 exits with the same code itself), and a rank
# whose error a lower rank printed.
_CLEAN_EXITS = (0, EXIT_PREEMPTED)
_NOT_REPORTED = (*_CLEAN_EXITS, EXIT_SAME_ERROR)

_FAILURE_KEY = "bytescale/failure/{rank}"
_PRINTED_BELOW = "_bytescale_printed_by_a_lower_rank"

_SIGNAL_CAUSES: dict[int, str] = {
    signal.SIGKILL: (
        "the kernel's out-of-memory killer (run `dmesg | grep -i -E 'killed process|out of memory'` on this "
        "node, or check the job's memory limit) or a kill -9 by the scheduler or an operator"
    ),
    signal.SIGTERM: "the scheduler or an operator stopped it before its stop handler was installed (during set-up)",
    signal.SIGINT: "an interrupt (Ctrl-C) sent to that process only",
    signal.SIGSEGV: "a crash in native code (an extension, a kernel, a driver); run it again with faulthandler on",
    signal.SIGBUS: (
        "a bus error, most often a full shared-memory file system (/dev/shm) that data-loader workers use; "
        "raise the container's shm size or use fewer workers"
    ),
    signal.SIGABRT: "an abort in native code (a failed assertion in C++/CUDA/NCCL); its stderr shows the reason",
    signal.SIGFPE: "an arithmetic fault in native code",
    signal.SIGILL: "an illegal instruction: a binary built for another CPU",
    signal.SIGHUP: "its terminal closed (start long runs under nohup, tmux or the scheduler)",
    signal.SIGPIPE: "its output pipe closed (the process reading its output exited)",
}


def exit_code_for(returncode: int) -> int:
    """The code rank 0 exits with when a rank ended with ``returncode`` (as :class:`subprocess.Popen` reports it).

    A rank killed by signal N gives ``128 + N`` (137 for SIGKILL: what a shell reports for a
    killed process); a rank that exited with a code passes it on (124: its step watchdog fired).
    """
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(rank: int, pid: int, returncode: int) -> str:
    """One line saying how rank ``rank`` (pid ``pid``) ended and what most likely caused it."""
    if returncode < 0:
        sig = -returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        cause = _SIGNAL_CAUSES.get(sig, "a signal sent by another process (the scheduler, an operator)")
        what = f"was killed by {name} (signal {sig}); likely cause: {cause}"
    elif returncode == EXIT_STEP_TIMEOUT:
        what = (
            f"exited with code {returncode}: its step watchdog ended it because it was stuck "
            "(its own message above names the phase and the code it was stuck in)"
        )
    else:
        what = f"exited with code {returncode}; its own error is above in the output"
    return f"[ByteScale] rank {rank} (pid {pid}) {what}."


@dataclass
class _PopenDyingWithParent:
    """Stands in for the ``subprocess`` module inside Lightning's launcher while it starts ranks."""

    preexec: Callable[[], None]

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    def Popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen:  # noqa: N802 (mirrors the module)
        if kwargs.get("preexec_fn") is None:
            kwargs["preexec_fn"] = self.preexec
        return subprocess.Popen(*args, **kwargs)


def _write_line(text: str) -> None:
    """Write to file descriptor 2 at once, bypassing Python's buffers (the process may end next)."""
    data = (text.rstrip("\n") + "\n").encode(errors="replace")
    try:
        while data:
            data = data[os.write(2, data) :]
    except OSError:
        pass


def _kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL a rank and what it started (its loader workers), and reap it."""
    if process.poll() is not None:
        return
    below = proc.descendants(process.pid)
    process.kill()
    proc.signal_all(below)
    process.wait()


class ByteScaleScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's popen launcher, with ranks that die with rank 0 and a launcher that names causes.

    Args:
        cluster_environment, num_processes, num_nodes: as for Lightning's launcher.
        poll_s: how often rank 0 checks the other ranks.
        settle_s: after a rank fails, how long rank 0 is given to stop by itself (and print its
            own error) before the observer ends it.
        exit_grace_s: when rank 0's interpreter exits, how long it waits for the other ranks
            to finish before it kills them (``settle_s`` at most after rank 0 failed with an
            exception: the others, waiting for it, cannot finish; they are ended without their
            own secondary timeout traceback).

    Exit codes of rank 0 when another rank failed first: ``128 + N`` for a rank killed by
    signal N, or the rank's own code (see :func:`exit_code_for`).
    """

    def __init__(
        self,
        cluster_environment: ClusterEnvironment,
        num_processes: int,
        num_nodes: int,
        *,
        poll_s: float = 0.5,
        settle_s: float = 3.0,
        exit_grace_s: float = 30.0,
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.poll_s = poll_s
        self.settle_s = settle_s
        self.exit_grace_s = exit_grace_s
        self._observer: RankObserver | None = None
        self._reported = False
        self._report_lock = threading.Lock()
        self._failed_here = False

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        # Lightning's launch() with this module's observer in place of Lightning's.
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        _check_before_launch(trainer, args, kwargs)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            self._observer = RankObserver(self)
            self._observer.start()
            atexit.register(self._end_ranks_at_exit)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        except Exception as err:
            self._failed_here = True  # the others wait for this rank in vain: see _end_ranks_at_exit
            print_once(err, wait_s=self.settle_s)
            raise

    @override
    def _call_children_scripts(self) -> None:
        original = _pl_script.subprocess
        _pl_script.subprocess = _PopenDyingWithParent(proc.DieWithParent(os.getpid()))  # type: ignore[assignment]
        try:
            super()._call_children_scripts()
        finally:
            _pl_script.subprocess = original

    def global_rank(self, index: int) -> int:
        """Global rank of ``self.procs[index]`` (rank 0 is this process, not in ``procs``)."""
        return self.cluster_environment.node_rank() * self.num_processes + index + 1

    def failed_ranks(self) -> list[tuple[int, subprocess.Popen]]:
        """(global rank, process) of the ranks that have ended with a failure, in rank order."""
        return [
            (self.global_rank(i), p)
            for i, p in enumerate(self.procs)
            if p.poll() is not None and p.returncode not in _NOT_REPORTED
        ]

    def report_and_exit(self, rank: int, process: subprocess.Popen) -> None:
        """Print the line for a failed rank, end every other process of this run, exit rank 0."""
        with self._report_lock:
            if self._reported:
                return
            self._reported = True
        code = exit_code_for(process.returncode)
        _write_line(describe_exit(rank, process.pid, process.returncode))
        _write_line(f"[ByteScale] ending the other ranks; rank 0 exits with code {code}.")
        for other in self.procs:
            _kill_tree(other)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed or broken stream must not stop the exit
                stream.flush()
        os._exit(code)

    def _end_ranks_at_exit(self) -> None:
        """atexit: report a rank that failed before rank 0 exited; wait for, then end, the rest."""
        if self._observer is not None:
            self._observer.stop()
        failed = self.failed_ranks()  # ended before rank 0 began to exit: a possible cause
        running = [p for p in self.procs if p.poll() is None]
        # After rank 0's own error the others cannot finish (they wait for it in a collective until
        # their timeout, then print a secondary traceback): give them settle_s to end by themselves
        # (a rank failing at the same time prints its own error), then end them quietly.
        grace = min(self.settle_s, self.exit_grace_s) if self._failed_here else self.exit_grace_s
        deadline = time.monotonic() + grace
        while running and time.monotonic() < deadline:
            time.sleep(0.05)
            running = [p for p in running if p.poll() is None]
        if running:
            ranks = [self.global_rank(self.procs.index(p)) for p in running]
            if self._failed_here:
                _write_line(
                    f"[ByteScale] rank 0 failed (its error is above); ending ranks {ranks}, which wait for it."
                )
            else:
                _write_line(
                    f"[ByteScale] rank 0 is exiting and ranks {ranks} (pids {[p.pid for p in running]}) are still "
                    f"running after {grace:g} s; killing them so that nothing is left behind."
                )
            for p in running:
                _kill_tree(p)
        if failed:
            rank, process = failed[0]
            logging.shutdown()
            self.report_and_exit(rank, process)


def error_signature(err: BaseException) -> str:
    """What makes two ranks' errors the same one: the class and the message."""
    return f"{type(err).__module__}.{type(err).__qualname__}: {err}"


def _default_store() -> Any:
    """The default process group's store (rank 0 serves it), or None before ``init_process_group``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if callable(get) else None
    except Exception:  # noqa: BLE001 - no store, no de-duplication: every rank prints its own error
        return None


def same_error_below(
    store: Any, rank: int, signature: str, wait_s: float, poll_s: float = 0.05
) -> int | None:
    """A rank below ``rank`` that reported the error ``signature`` to ``store`` (the first found,
    from rank 0 up), or None.

    Waits up to ``wait_s`` for the lower ranks that have reported nothing yet (ranks raising the
    same error raise it at about the same time); a lower rank with another error does not count.
    That rank prints the error or defers to a still lower one, so the lowest rank that raised it
    prints it.  When every rank raised it, each asks for rank 0's report first: one look-up each.
    """
    deadline = time.monotonic() + wait_s
    seen: dict[int, str] = {}
    while True:
        for r in range(rank):
            key = _FAILURE_KEY.format(rank=r)
            if r in seen or not store.check([key]):
                continue
            seen[r] = store.get(key).decode(errors="replace")
            if seen[r] == signature:
                return r
        if len(seen) == rank or time.monotonic() >= deadline:
            return None
        time.sleep(poll_s)


def print_once(err: BaseException, wait_s: float) -> bool:
    """Let one rank print an error that several ranks raise; True if this rank's copy stays silent.

    Each failing rank reports ``error_signature(err)`` to the process group's store.  Rank 0
    prints its own error (Python's traceback, as always).  Another rank whose error is the same
    as a lower rank's (waiting ``wait_s`` for them) does not print it again: if the error reaches
    the top of the script uncaught, the rank exits with :data:`EXIT_SAME_ERROR` and no traceback.
    A different error, or one no lower rank raised, is printed by its rank as before.
    """
    store = _default_store()
    if store is None:
        return False
    import torch.distributed as dist

    rank = dist.get_rank()
    signature = error_signature(err)
    try:
        store.set(_FAILURE_KEY.format(rank=rank), signature)
        if rank == 0 or same_error_below(store, rank, signature, wait_s) is None:
            return False
    except Exception:  # noqa: BLE001 - the store is gone (rank 0 ended): print this rank's error
        return False
    err.__dict__[_PRINTED_BELOW] = (
        True  # for a caller that reports errors itself (bytescale-train under Hydra)
    )
    previous = sys.excepthook

    def _silent_for_this_error(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if value is not err:
            previous(kind, value, tb)
            return
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        atexit._run_exitfuncs()  # what a normal exit runs (loggers, W&B), then the distinct code
        os._exit(EXIT_SAME_ERROR)

    sys.excepthook = _silent_for_this_error
    return True


def printed_by_a_lower_rank(err: BaseException) -> bool:
    """Whether :func:`print_once` found ``err`` raised alike by a lower rank, which prints it: this rank
    should end without printing it (exit code :data:`EXIT_SAME_ERROR`)."""
    return bool(getattr(err, "__dict__", {}).get(_PRINTED_BELOW))


class RankObserver(_ChildProcessObserver):
    """Rank 0's thread that watches the other ranks of this node (Lightning's observer, re-done).

    A rank that ended with a failure is reported (one line, :func:`describe_exit`) and the
    run ended, ``settle_s`` after it was seen, unless rank 0 exits by itself first (then its
    exit handler reports it).  Ranks that finish or are preempted are left alone.
    """

    def __init__(self, launcher: ByteScaleScriptLauncher) -> None:
        super().__init__(main_pid=os.getpid(), child_processes=launcher.procs, sleep_period=launcher.poll_s)  # type: ignore[arg-type]
        self.name = "bytescale-rank-observer"
        self.launcher = launcher
        self._stopped = False
        self._failure_seen_at: float | None = None

    def stop(self) -> None:
        self._stopped = True

    @override
    def _run(self) -> bool:
        if self._stopped:
            return True
        failed = self.launcher.failed_ranks()
        if failed:
            now = time.monotonic()
            if self._failure_seen_at is None:
                self._failure_seen_at = now
            if now - self._failure_seen_at >= self.launcher.settle_s and not self._stopped:
                self.launcher.report_and_exit(*failed[0])
                return True
            return False
        return all(p.returncode is not None for p in self.launcher.procs)


class ForkCollectingLauncher(_MultiProcessingLauncher):
    """Lightning's multiprocessing launcher that runs a full garbage collection before forking ranks.

    A forked rank inherits the parent's uncollected garbage but not its threads.  When the
    garbage holds a process group or a TCPStore from an earlier run in this interpreter (kept
    alive by a reference cycle, e.g. an exception's traceback), the rank's first garbage
    collection destroys it, and the store's destructor joins a server thread that exists only
    in the parent: the rank hangs with the interpreter lock held, out of its watchdog's reach.
    Collecting here, where those threads exist, ends them properly first.
    """

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        _check_before_launch(trainer, args, kwargs)
        if self._start_method == "fork":  # spawned ranks start from a fresh interpreter
            gc.collect()
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        """Rank 0's weights for the main process, as one process holds them (on a mesh gathered whole from the shards)."""
        module = trainer.lightning_module
        full = trainer.strategy.whole_module_state()  # on a mesh a collective: every rank gathers
        module.state_dict = lambda *a, **k: full  # what Lightning's launcher sends to the main process
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict


def _check_before_launch(trainer: pl.Trainer | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The strategy's checks of the run (``ByteScaleStrategy.check_before_launch``), once, before any rank starts."""
    check = getattr(getattr(trainer, "strategy", None), "check_before_launch", None)
    if callable(check):
        check(trainer, *args, **kwargs)
