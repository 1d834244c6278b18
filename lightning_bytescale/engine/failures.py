"""Turn a dead or stuck peer into one clear message instead of a backend's socket text.

When a rank dies (out of memory, killed, a crash) or stops answering, the survivors' next ring
transfer or all-reduce fails inside the communication backend, with text such as gloo's
``Connection closed by peer`` or ``Timed out waiting 5000ms for recv operation``.  That text
names neither the cause nor the fix.  :func:`is_peer_failure` recognises such errors and
:func:`peer_failure_message` is the one wording of the condition: which rank noticed, in which
phase, the process-group timeout that bounds the wait, and what to do.
``ByteScaleStrategy.on_exception`` appends it to the backend's error (:func:`add_peer_failure_hint`:
Lightning re-raises the original exception object); an engine loop of one's own raises
:class:`~lightning_bytescale.errors.PeerFailureError` with it, the backend's error attached as
``__cause__`` (docs/troubleshooting.md shows the five lines).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

from lightning_bytescale.errors import PeerFailureError

# Fragments of the errors gloo, NCCL and the TCP store raise when a peer is gone or too slow.
PEER_FAILURE_MARKERS: tuple[str, ...] = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Connection refused",
    "Broken pipe",
    "Timed out",
    "timed out",
    "Socket Timeout",
    "NCCL communicator was aborted",
    "ProcessGroupNCCL",
    "Watchdog caught collective operation timeout",
)


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is a backend's lost-peer error."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, PeerFailureError):
            return True
        if isinstance(seen, (RuntimeError, ConnectionError, TimeoutError)):
            text = str(seen)
            if any(m in text for m in PEER_FAILURE_MARKERS):
                return True
        seen = seen.__cause__ or seen.__context__
    return False


def _seconds(timeout: float | timedelta | None) -> float | None:
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return None if timeout is None else float(timeout)


def peer_failure_message(*, rank: int, timeout: float | timedelta | None, phase: str = "a step") -> str:
    """The message of the dead-peer condition, seen on ``rank`` during ``phase``.

    The backend's error is not repeated in the text: the strategy appends this message to it,
    and :class:`PeerFailureError` carries it as ``__cause__``.
    """
    seconds = _seconds(timeout)
    bound = f"{seconds:g} s" if seconds is not None else "the backend's default"
    return (
        f"rank {rank}: another rank died or stopped answering during {phase} (process-group timeout "
        f"{bound}). The first error is in the logs of the rank that failed; fix that one (often out of "
        "memory, a kill by the scheduler, or a crash in the data loader), then resume from the last "
        "checkpoint. To give up sooner or later, set the process-group timeout "
        "(ByteScaleStrategy(timeout=...), or init_process_group(timeout=...))."
    )


def add_peer_failure_hint(
    error: BaseException, *, rank: int, timeout: float | timedelta | None, phase: str
) -> None:
    """Append :func:`peer_failure_message` to a backend's lost-peer ``error`` in place (other errors are left alone).

    A strategy's ``on_exception`` calls it: Lightning re-raises the original exception object,
    so the hint must be in that object's message, after the backend's own text.
    """
    if not (isinstance(error, RuntimeError) and is_peer_failure(error)):
        return
    text = str(error)
    hint = f"\n[ByteScale] {peer_failure_message(rank=rank, timeout=timeout, phase=phase)}"
    with contextlib.suppress(Exception):
        error.args = (f"{error.args[0] if error.args else text}{hint}", *error.args[1:])


__all__ = [
    "PEER_FAILURE_MARKERS",
    "PeerFailureError",
    "add_peer_failure_hint",
    "is_peer_failure",
    "peer_failure_message",
]
