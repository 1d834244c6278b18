"""Preemption: SIGTERM becomes a checkpoint at the next step boundary and a non-zero exit.

Schedulers stop a job by sending SIGTERM (SLURM, Kubernetes, systemd: to every process of the
job, or only to the first one), then SIGKILL after a grace period.  Lightning's own SIGTERM
handler runs a broadcast *inside the signal handler*: if the signal lands while ranks are in a
ring exchange, that broadcast pairs with the wrong messages and the job hangs until the
process-group timeout.  And a job stopped that way exits with code 0, as if it had finished.

Here a signal only sets a flag (:class:`PreemptionHandler`).  The flag rides in the step's
existing all-reduce (the strategy calls :meth:`PreemptionHandler.record_agreement` with the
reduced value), so every rank learns at the same step that some rank was signalled, whichever
ranks got the signal.  Right after that step, where Lightning's own checkpoint callbacks save
(``on_train_batch_end``), :class:`PreemptionCallback` has every rank save one checkpoint
together and raise :class:`PreemptedError`, a :class:`SystemExit` with code
:data:`EXIT_PREEMPTED`.  The checkpoint is named the way Lightning's ``ckpt_path="hpc"``
resume looks for (``<default_root_dir>/hpc_ckpt_<n>.ckpt``), so on SLURM a requeued job
resumes from it by itself, and elsewhere ``trainer.fit(..., ckpt_path="hpc")`` (or
:func:`latest_checkpoint`) does.

The handler must be installed *after* Lightning installs its own, which happens in
``Trainer._run`` after ``strategy.setup`` and the ``on_fit_start`` hooks and before the
sanity check: the callback installs it in ``on_sanity_check_start`` and ``on_train_start``.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import fsspec
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback

from lightning_bytescale.errors import ConfigError

if TYPE_CHECKING:
    import lightning.pytorch as pl

EXIT_PREEMPTED = 143
"""Exit code of a run stopped by a preemption signal after saving its checkpoint.

128 + 15: what a shell reports for a process ended by SIGTERM, so schedulers, wrappers and
people read it as "terminated by the scheduler", never as success; the rank-0 message and the
checkpoint file tell a saved stop from a lost one.
"""

HPC_PREFIX = "hpc_ckpt_"
_DIGITS = re.compile(r"[^0-9]")
_NEVER_CATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


class PreemptedError(SystemExit):
    """Raised on every rank once the preemption checkpoint is saved; exits with :data:`EXIT_PREEMPTED`.

    A :class:`SystemExit`, so ``except Exception`` in user code does not swallow it and an
    uncaught one ends the process with the code and no traceback.
    """

    def __init__(
        self, message: str, checkpoint: Path | str | None = None, signal_name: str | None = None
    ) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.message = message
        self.checkpoint = checkpoint
        self.signal_name = signal_name

    def __str__(self) -> str:
        return self.message


def _as_signal(value: int | str | signal.Signals) -> signal.Signals:
    try:
        if isinstance(value, str):
            name = value.upper()
            sig = signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        else:
            sig = signal.Signals(value)
    except (KeyError, ValueError):
        raise ConfigError(
            f"PreemptionHandler: {value!r} is not a signal on this platform; use a name such as 'SIGTERM' or 'SIGUSR1'"
        ) from None
    if sig in _NEVER_CATCHABLE:
        raise ConfigError(
            f"PreemptionHandler: {sig.name} cannot be caught; preemption uses SIGTERM (or SIGUSR1)"
        )
    return sig


class PreemptionHandler:
    """Turns stop signals into a flag; the step boundary acts on it, never the signal handler.

    Args:
        signals: the signals that request a checkpointed stop.  ``("SIGTERM",)`` by default;
            add ``"SIGUSR1"`` for SLURM's ``#SBATCH --signal=USR1@120`` (a warning some
            seconds before the time limit) or Kubernetes set-ups that send another signal.

    With ``"SIGINT"`` among them (what ``bytescale-train`` uses), the first Ctrl-C saves a
    checkpoint at the next step boundary like SIGTERM, and a second one raises
    :class:`KeyboardInterrupt` at once, as Ctrl-C does without this handler.

    ``install()`` replaces the handlers of these signals (from the main thread),
    ``uninstall()`` puts back the ones it replaced.  ``requested`` becomes True on the first
    signal and ``signal_name`` names it; nothing else runs inside the handler.
    """

    def __init__(self, signals: Iterable[int | str | signal.Signals] = ("SIGTERM",)) -> None:
        self.signals: tuple[signal.Signals, ...] = tuple(dict.fromkeys(_as_signal(s) for s in signals))
        if not self.signals:
            raise ConfigError("PreemptionHandler needs at least one signal, e.g. signals=('SIGTERM',)")
        self.requested = False
        self.signal_name: str | None = None
        self._callback = self._on_signal  # one bound method, so getsignal() can be compared with it
        self._previous: dict[signal.Signals, Any] = {}
        self._agreed: bool | None = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only assignments: no I/O, no lock, no collective (the main thread may be inside one).
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the checkpoint (Python's default)
        if not self.requested:
            self.signal_name = signal.Signals(signum).name
        self.requested = True

    @property
    def installed(self) -> bool:
        """Whether this handler is installed (for at least one of its signals)."""
        return bool(self._previous)

    def install(self) -> None:
        """Handle :attr:`signals` here from now on (idempotent; main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "PreemptionHandler.install() must run in the main thread (Python delivers signals only "
                "there); install it from a Trainer hook, which runs in the main thread"
            )
        for sig in self.signals:
            current = signal.getsignal(sig)
            if current is self._callback:
                continue
            signal.signal(sig, self._callback)
            self._previous[sig] = current

    def uninstall(self) -> None:
        """Restore the handlers :meth:`install` replaced, where ours is still the one installed.

        A handler someone installed after ours (Lightning restores its originals when the
        trainer tears down) is left in place.  Idempotent; main thread only (else a no-op).
        """
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) is self._callback:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def request(self, signal_name: str = "a request") -> None:
        """Ask for a checkpointed stop without a signal (what the signal handler does)."""
        if not self.requested:
            self.signal_name = signal_name
        self.requested = True

    def record_agreement(self, any_rank_requested: bool) -> None:
        """The strategy's step all-reduce says whether any rank has :attr:`requested` set.

        Call it on every rank with the reduced value, every training step.
        """
        self._agreed = bool(any_rank_requested)

    def take_agreement(self) -> bool | None:
        """The value recorded for this step (then forgotten); ``None`` when none was recorded."""
        agreed, self._agreed = self._agreed, None
        return agreed

    def __getstate__(self) -> dict[str, Any]:  # a strategy holding one may be pickled (spawn)
        state = self.__dict__.copy()
        state.pop("_callback")
        state["_previous"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._callback = self._on_signal


def _hpc_version(name: str) -> int | None:
    """The number Lightning's ``hpc`` resume reads from a file name (None: it has none)."""
    if HPC_PREFIX not in name:
        return None
    digits = _DIGITS.sub("", name.split(HPC_PREFIX)[-1])
    return int(digits) if digits else None


def _hpc_versions(root: str | os.PathLike[str]) -> list[int]:
    fs, path = fsspec.core.url_to_fs(str(root))
    if not fs.isdir(path):
        return []
    names = [os.path.basename(str(entry).rstrip("/")) for entry in fs.ls(path, detail=False)]
    return [v for v in (_hpc_version(n) for n in names) if v is not None]


def _join(root: str | os.PathLike[str], name: str) -> Path | str:
    text = str(root)
    if "://" in text:
        return text.rstrip("/") + "/" + name
    return Path(text) / name


def next_checkpoint_path(root: str | os.PathLike[str]) -> Path | str:
    """``<root>/hpc_ckpt_<n>.ckpt`` with ``n`` one more than the highest there: the newest for ``hpc`` resume.

    A local ``root`` gives a :class:`~pathlib.Path`, a URL (``s3://...``) a string.
    """
    versions = _hpc_versions(root)
    return _join(root, f"{HPC_PREFIX}{max(versions, default=0) + 1}.ckpt")


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | str | None:
    """The checkpoint Lightning's ``ckpt_path="hpc"`` would resume from in ``root``, or ``None``.

    Use it to resume where the scheduler is not SLURM (where Lightning does this by itself):
    ``trainer.fit(model, datamodule=dm, ckpt_path=latest_checkpoint(trainer.default_root_dir))``.
    """
    versions = _hpc_versions(root)
    return _join(root, f"{HPC_PREFIX}{max(versions)}.ckpt") if versions else None


def checkpoint_path(trainer: pl.Trainer) -> Path | str:
    """Where this run's preemption checkpoint goes: :func:`next_checkpoint_path` of ``default_root_dir``.

    Rank 0 picks the name and broadcasts it, so every rank saves to the same file although
    rank 0 may already be writing it while another rank looks.  A collective: call it on
    every rank at the same point (the step boundary, right before ``trainer.save_checkpoint``).
    """
    mine = next_checkpoint_path(trainer.default_root_dir) if trainer.is_global_zero else None
    chosen = trainer.strategy.broadcast(mine, src=0)
    return chosen if isinstance(chosen, Path) or "://" in str(chosen) else Path(chosen)


def _resume_hint() -> str:
    if SLURMEnvironment.detect():
        return "On SLURM, Lightning resumes from it by itself when the job restarts (ckpt_path=None)."
    return (
        'Resume with trainer.fit(..., ckpt_path="hpc"), or ckpt_path='
        "lightning_bytescale.lightning.preemption.latest_checkpoint(default_root_dir)."
    )


class PreemptionCallback(Callback):
    """Installs a :class:`PreemptionHandler` during training; on an agreed request, saves and exits.

    ``resume_hint`` (optional) turns the saved checkpoint's path into the sentence that ends
    rank 0's message (by default: ``trainer.fit(..., ckpt_path="hpc")``; ``bytescale-train``
    gives the command line that resumes the run).

    After every training step (``on_train_batch_end``, where checkpoints are consistent: the
    optimizer step and the loop counters are done, the data position is the next step), it
    asks whether any rank was signalled: the value the strategy recorded from its step
    all-reduce, or else one small all-reduce of its own
    (``strategy.reduce_boolean_decision``).  If so, every rank saves the checkpoint together
    (:func:`checkpoint_path`, ``trainer.save_checkpoint``) and raises :class:`PreemptedError`.
    """

    def __init__(
        self,
        handler: PreemptionHandler | None = None,
        resume_hint: Callable[[Path | str], str] | None = None,
    ) -> None:
        self.handler = handler if handler is not None else PreemptionHandler()
        self.resume_hint = resume_hint

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.handler.install()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.handler.install()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        agreed = self.handler.take_agreement()
        if agreed is None:
            agreed = trainer.strategy.reduce_boolean_decision(self.handler.requested, all=False)
        if agreed:
            self.stop(trainer)

    def stop(self, trainer: pl.Trainer) -> NoReturn:
        """Save the preemption checkpoint on every rank together, then raise :class:`PreemptedError`."""
        path = checkpoint_path(trainer)
        trainer.save_checkpoint(path, weights_only=False)
        name = self.handler.signal_name
        cause = (
            f"{'Ctrl-C (SIGINT)' if name == 'SIGINT' else name} on rank {trainer.global_rank}"
            if self.handler.requested
            else "a stop signal on another rank"
        )
        hint = self.resume_hint(path) if self.resume_hint is not None else _resume_hint()
        what = "stopped" if name == "SIGINT" else "preempted"
        message = (
            f"[ByteScale] {what} by {cause}: saved a checkpoint after step {trainer.global_step} to {path}; "
            f"exiting with code {EXIT_PREEMPTED}. {hint}"
        )
        self.handler.uninstall()
        if trainer.is_global_zero:
            print(message, file=sys.stderr, flush=True)
        raise PreemptedError(message, path, self.handler.signal_name)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.handler.uninstall()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.handler.uninstall()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.handler.uninstall()
