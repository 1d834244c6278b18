"""The guards a ``ByteScaleStrategy`` run keeps while it runs: the step watchdog and the preemption handler.

Both are made at set-up from the strategy's ``watchdog`` and ``preemption`` options and stopped
at teardown; the step loop beats the watchdog and carries the preemption flag in the step's
sync.  Here is how each is made from its option, so that the strategy only keeps the objects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.trainer.states import TrainerFn

from lightning_bytescale.engine.watchdog import StepWatchdog

# imported as a module: the first import of Lightning imports the strategy, and so this module,
# maybe while the preemption module is still being imported
from lightning_bytescale.lightning import preemption as preemption_

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_bytescale.lightning.preemption import PreemptionHandler


def start_watchdog(option: bool | float, *, pg_seconds: float | None, rank: int) -> StepWatchdog | None:
    """The started :class:`~lightning_bytescale.engine.watchdog.StepWatchdog` of ``watchdog=option``, or ``None``.

    ``True`` watches each step for the process-group timeout (``pg_seconds``; none without one),
    a number for that many seconds, ``False`` not at all.  The watchdog's message names the
    option that sets its time.
    """
    seconds = option if option is not True else pg_seconds
    if option is False or seconds is None:
        return None
    name = f"ByteScaleStrategy({'watchdog' if option is not True else 'timeout'}=...)"
    return StepWatchdog(float(seconds), rank, timeout_option=name).start()


def preemption_handler(trainer: pl.Trainer, option: bool | tuple[str, ...]) -> PreemptionHandler | None:
    """The preemption handler of a fit with ``preemption=option``: the trainer's ``PreemptionCallback``'s.

    A callback the user gave is kept (with its handler); else one is added for the signals named
    (``True``: SIGTERM).  Its callback installs the handler when training starts.  ``None`` when
    the option is ``False`` or the run does not fit.
    """
    if option is False or trainer.state.fn != TrainerFn.FITTING:
        return None
    callback = next((c for c in trainer.callbacks if isinstance(c, preemption_.PreemptionCallback)), None)
    if callback is None:
        signals = ("SIGTERM",) if option is True else tuple(option)
        callback = preemption_.PreemptionCallback(preemption_.PreemptionHandler(signals))
        trainer.callbacks.append(callback)
    return callback.handler


__all__ = ["preemption_handler", "start_watchdog"]
