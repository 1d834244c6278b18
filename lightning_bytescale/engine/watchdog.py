"""A per-rank step watchdog: a rank stuck inside a step ends itself, naming where it was.

When one rank stops making progress (an endless loop in ``training_step``, a deadlocked data
worker, a debugger breakpoint), the other ranks fail at the process-group timeout with an error
that blames a peer, but the stuck rank itself never returns from the call it is stuck in and,
re-parented to init, lives on with its data-loader workers.  Nothing from outside can make
a stuck main thread raise, so the rank watches itself: :class:`StepWatchdog` runs a daemon
thread that, when no :meth:`~StepWatchdog.beat` came for ``timeout_s`` while a step runs,
writes one message to stderr (rank, phase, seconds, the stuck thread's stack, the fix), kills
this process's descendants, and leaves with ``os._exit(EXIT_STEP_TIMEOUT)``.

``beat`` only stores a tuple (about 0.3 microseconds; the first beat of a step also arms the
backstop below, about 40), so it can be called at every phase of a step.  If the stuck thread holds the interpreter lock the whole time (a C extension that
never releases it), the watchdog thread cannot run either; as a backstop the interpreter's own
C-level timer (:func:`faulthandler.dump_traceback_later`) then prints every thread's stack and
exits with code 1, ``grace_s`` later.
"""

from __future__ import annotations

import faulthandler
import math
import os
import sys
import threading
import time
import traceback
from types import TracebackType

from lightning_bytescale import proc
from lightning_bytescale.errors import ConfigError

EXIT_STEP_TIMEOUT = 124
"""Exit code of a rank the watchdog ended: 124, what ``timeout(1)`` returns for a command that ran too long."""

_monotonic = time.monotonic
_thread_id = threading.get_ident
_STACK_FRAMES = 12


class StepWatchdog:
    """Ends this process when a running step makes no progress for ``timeout_s`` seconds.

    Args:
        timeout_s: longest time allowed between two :meth:`beat` calls while a step runs.
        rank: the global rank, named in the message.
        exit_code: the process's exit status when the watchdog fires (default
            :data:`EXIT_STEP_TIMEOUT`, 124).
        kill_children: SIGKILL this process's descendants (data-loader workers, ranks a
            launcher started here) before exiting, so nothing is left behind.
        timeout_option: how the user raises the timeout, quoted in the message.
        backstop: arm :func:`faulthandler.dump_traceback_later` for a thread that never
            releases the interpreter lock (it replaces any timer armed there by others).
        grace_s: how much later than ``timeout_s`` the backstop fires (default
            ``max(10, timeout_s / 4)`` seconds).

    Use it as ``with StepWatchdog(...) as dog:`` or ``start()``/``stop()``; call
    ``beat("micro-batch 3 of step 12 (ring [0, 2], sequences [5])")`` as the step advances and
    ``idle()`` when no step runs (validation, checkpointing, the end of training).  It starts idle.
    """

    def __init__(
        self,
        timeout_s: float,
        rank: int,
        *,
        exit_code: int = EXIT_STEP_TIMEOUT,
        kill_children: bool = True,
        timeout_option: str = "ByteScaleStrategy(timeout=...)",
        backstop: bool = True,
        grace_s: float | None = None,
    ) -> None:
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not math.isfinite(timeout_s)
        ):
            raise ConfigError(f"StepWatchdog timeout_s must be a finite number of seconds, got {timeout_s!r}")
        if timeout_s <= 0:
            raise ConfigError(f"StepWatchdog timeout_s must be positive, got {timeout_s!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ConfigError(f"StepWatchdog rank must be a non-negative integer, got {rank!r}")
        if isinstance(exit_code, bool) or not isinstance(exit_code, int) or not 1 <= exit_code <= 255:
            raise ConfigError(
                f"StepWatchdog exit_code must be 1..255 (0 would report a stuck rank as a success), got {exit_code!r}"
            )
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self.exit_code = exit_code
        self.kill_children = kill_children
        self.timeout_option = timeout_option
        self.backstop = backstop
        self.grace_s = max(10.0, self.timeout_s / 4) if grace_s is None else float(grace_s)
        self.poll_s = min(1.0, max(0.01, self.timeout_s / 20))
        # (time of the last beat, phase, thread, seconds allowed for this phase)
        self._mark: tuple[float, str, int, float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._backstop_for: float | None = None  # the beat time the backstop timer is armed for
        self._backstop_at: float | None = None  # when the armed backstop fires (monotonic seconds)
        self._armable = False  # the backstop may be armed: running, with backstop=True

    # -- the step's side: cheap --------------------------------------------------------------

    def beat(self, phase: str, timeout_s: float | None = None) -> None:
        """Record progress: the step is alive and now in ``phase``.

        ``timeout_s`` allows this phase another limit than the watchdog's (e.g. a blocking
        collective, which the process-group timeout already bounds: give it that timeout plus a
        margin, so that ranks waiting for a stuck peer fail with the peer error, and the stuck
        rank's own watchdog names where it is stuck).

        The first beat after :meth:`idle` (or :meth:`start`) also makes sure the backstop timer
        is armed (the thread may take the interpreter lock for good before the watchdog thread
        runs again); a timer armed for a recent step is kept (see :meth:`_arm_backstop`).
        """
        now = _monotonic()
        if timeout_s is None:
            timeout_s = self.timeout_s
        elif not timeout_s > 0:
            raise ConfigError(f"StepWatchdog.beat timeout_s must be positive seconds, got {timeout_s!r}")
        if self._mark is None and self._armable:
            self._arm_backstop(now, timeout_s)
        self._mark = (now, phase, _thread_id(), timeout_s)

    def idle(self) -> None:
        """No step is running: nothing is timed until the next :meth:`beat`."""
        self._mark = None

    @property
    def running(self) -> bool:
        """Whether the watchdog thread is running."""
        return self._thread is not None and self._thread.is_alive()

    # -- lifetime ------------------------------------------------------------------------------

    def start(self) -> StepWatchdog:
        """Start the watchdog thread (idle until the first :meth:`beat`); no-op when running."""
        if self.running:
            return self
        self._mark = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name=f"bytescale-step-watchdog-rank{self.rank}", daemon=True
        )
        self._thread.start()
        self._armable = self.backstop
        return self

    def stop(self) -> None:
        """Stop the watchdog thread and its backstop timer; no-op when stopped."""
        self._armable = False
        self._mark = None
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._disarm_backstop()

    def __enter__(self) -> StepWatchdog:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- the watchdog thread -------------------------------------------------------------------

    def _watch(self) -> None:
        stop = self._stop
        while not stop.wait(self.poll_s):
            mark = self._mark
            if mark is None:
                self._disarm_backstop()
                continue
            since, phase, thread, limit = mark
            waited = _monotonic() - since
            if waited >= limit:
                self._fire(waited, phase, thread, limit)
            self._arm_backstop(since, limit)

    def _arm_backstop(self, since: float, limit: float) -> None:
        """Let the backstop fire about ``grace_s`` after this phase's limit.

        Re-arming costs a thread (``faulthandler`` starts one per call), so a timer already
        armed within half a grace of the wanted moment is kept: it still fires at least half a
        grace after the limit (never before the watchdog itself) and at most half a grace late.
        With steps shorter than that, the timer is re-armed about once per half grace, not once
        per step.
        """
        if not self.backstop or since == self._backstop_for:
            return
        stream = sys.__stderr__
        try:
            stream.fileno()  # type: ignore[union-attr]
        except (AttributeError, OSError, ValueError):
            return
        at = since + limit + self.grace_s
        if self._backstop_at is not None and abs(at - self._backstop_at) <= self.grace_s / 2:
            self._backstop_for = since
            return
        now = _monotonic()
        remaining = max(at - now, self.poll_s)
        faulthandler.dump_traceback_later(remaining, exit=True, file=stream)
        self._backstop_for, self._backstop_at = since, now + remaining

    def _disarm_backstop(self) -> None:
        if self._backstop_for is not None:
            faulthandler.cancel_dump_traceback_later()
            self._backstop_for = self._backstop_at = None

    def message(
        self,
        waited_s: float,
        phase: str,
        stack: str = "",
        children: list[int] | None = None,
        limit_s: float | None = None,
    ) -> str:
        """The text written when the watchdog fires (also used by the tests)."""
        kids = children or []
        limit = self.timeout_s if limit_s is None else limit_s
        lines = [
            f"[ByteScale] rank {self.rank}: step watchdog: no progress for {waited_s:.1f} s "
            f"(timeout {limit:g} s) in {phase}.",
            "This rank is stuck: most likely in its own code on this rank (training_step, a callback, a "
            "data-loader worker, a custom collective) or stopped (a debugger, SIGSTOP).",
        ]
        if stack:
            lines += ["Its thread was here (most recent call last):", stack.rstrip("\n")]
        ended = f" and its {len(kids)} child process(es) {kids}" if kids else ""
        lines += [
            f"Ending this process (pid {os.getpid()}){ended} with exit code {self.exit_code} so that "
            "nothing is left behind; the other ranks stop at their process-group timeout.",
            f"Fix: look at that code on rank {self.rank}; if a step is legitimately slower than "
            f"{limit:g} s, raise the timeout ({self.timeout_option}).",
        ]
        return "\n".join(lines) + "\n"

    def _stacks(self, thread: int) -> str:
        frames = sys._current_frames()
        main = threading.main_thread().ident
        parts = []
        for ident in dict.fromkeys((thread, main)):
            frame = frames.get(ident) if ident is not None else None
            if frame is None:
                continue
            title = "" if ident == thread else "  (main thread)\n"
            parts.append(title + "".join(traceback.format_stack(frame)[-_STACK_FRAMES:]))
        return "".join(parts)

    def _fire(self, waited: float, phase: str, thread: int, limit: float) -> None:
        children = proc.descendants() if self.kill_children else []
        text = self.message(waited, phase, self._stacks(thread), children, limit)
        data = text.encode(errors="replace")
        try:  # straight to the file descriptor: the stuck thread may hold sys.stderr's lock
            while data:
                data = data[os.write(2, data) :]
        except OSError:
            pass
        if self.kill_children:
            proc.kill_descendants()
        os._exit(self.exit_code)
