"""Preemption: a stop signal only sets a flag; the step boundary saves a checkpoint and exits 143.

In-process: the handler sets its flag and runs nothing else (not Lightning's handler, not the
one it replaced), the checkpoint name is the one Lightning's ``hpc`` resume picks, and a run
stopped by SIGTERM resumes to exactly the parameters of a run that never stopped (float64).
Multi-process (2 CPU ranks, gloo, Lightning's popen launching): SIGTERM to the whole process
group, to rank 1 only and to the launcher (rank 0) only each end the run with one checkpoint,
exit code 143, and no process left.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from _lifecycle import TESTS, assert_sigterm_saves_once_and_exits_143
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_bytescale.lightning.preemption import (
    EXIT_PREEMPTED,
    PreemptedError,
    PreemptionCallback,
    PreemptionHandler,
    latest_checkpoint,
    next_checkpoint_path,
)


@pytest.fixture
def sentinel():
    """A Python-level SIGTERM handler that records calls, so a stray SIGTERM never kills pytest."""
    calls: list[int] = []

    def record(signum, frame):
        calls.append(signum)

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    for s in saved:
        signal.signal(s, record)
    try:
        yield record, calls
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def _deliver(sig: int) -> None:
    os.kill(os.getpid(), sig)  # Python runs the handler at the next bytecode boundary


# ------------------------------------------------------------------------------ the handler
def test_a_signal_sets_the_flag_and_runs_nothing_else(sentinel):
    record, calls = sentinel
    handler = PreemptionHandler()
    before = dict(vars(handler))
    handler.install()
    assert signal.getsignal(signal.SIGTERM) is handler._callback and handler.installed
    _deliver(signal.SIGTERM)
    assert handler.requested and handler.signal_name == "SIGTERM"
    assert calls == [], "the replaced handler ran: the handler must not chain to it"
    changed = {k for k, v in vars(handler).items() if before.get(k) is not v and k not in ("_previous",)}
    assert changed == {"requested", "signal_name"}
    _deliver(signal.SIGTERM)  # a second signal changes nothing
    assert handler.signal_name == "SIGTERM"
    handler.uninstall()
    assert signal.getsignal(signal.SIGTERM) is record and not handler.installed
    _deliver(signal.SIGTERM)
    assert calls == [signal.SIGTERM]


def test_sigusr1_is_handled_only_when_asked_for(sentinel):
    record, calls = sentinel
    plain = PreemptionHandler()
    plain.install()
    try:
        assert signal.getsignal(signal.SIGUSR1) is record
    finally:
        plain.uninstall()
    slurm = PreemptionHandler(signals=("SIGTERM", "USR1"))
    assert slurm.signals == (signal.SIGTERM, signal.SIGUSR1)
    slurm.install()
    try:
        _deliver(signal.SIGUSR1)
        assert slurm.requested and slurm.signal_name == "SIGUSR1" and calls == []
    finally:
        slurm.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is record


@pytest.mark.parametrize(
    ("signals", "needle"),
    [
        (("SIGKILL",), "cannot be caught"),
        (("SIGSTOP",), "cannot be caught"),
        (("SIGNOPE",), "not a signal"),
        ((), "at least one"),
    ],
)
def test_bad_signals_are_refused_with_the_fix(signals, needle):
    with pytest.raises(ValueError, match=needle):
        PreemptionHandler(signals=signals)


def test_install_outside_the_main_thread_says_where_to_install(sentinel):
    handler = PreemptionHandler()
    errors: list[BaseException] = []

    def install():
        try:
            handler.install()
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError) and "main thread" in str(errors[0])


def test_install_is_idempotent_and_uninstall_leaves_a_later_handler_alone(sentinel):
    record, _ = sentinel
    handler = PreemptionHandler()
    handler.install()
    handler.install()  # the second install must not record our own handler as "previous"
    assert handler._previous[signal.SIGTERM] is record

    def later(signum, frame):
        pass

    signal.signal(signal.SIGTERM, later)  # e.g. Lightning restoring its originals at teardown
    handler.uninstall()
    assert signal.getsignal(signal.SIGTERM) is later


def test_the_agreement_is_per_step_and_the_handler_pickles():
    handler = PreemptionHandler()
    assert handler.take_agreement() is None
    handler.record_agreement(True)
    assert handler.take_agreement() is True and handler.take_agreement() is None
    handler.request("SIGTERM")
    copy = pickle.loads(pickle.dumps(handler))
    assert copy.requested and copy.signal_name == "SIGTERM" and copy._callback == copy._on_signal


class _FakeStrategy:
    def __init__(self) -> None:
        self.asked: list[tuple[bool, bool]] = []

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        self.asked.append((decision, all))
        return decision


class _FakeTrainer:
    def __init__(self) -> None:
        self.strategy = _FakeStrategy()


def test_the_callback_trusts_the_step_all_reduce_and_otherwise_reduces_itself(monkeypatch):
    callback = PreemptionCallback()
    stops: list[object] = []
    monkeypatch.setattr(callback, "stop", stops.append)
    trainer = _FakeTrainer()
    callback.handler.request("SIGTERM")  # the signal came after this step's all-reduce ...
    callback.handler.record_agreement(False)  # ... so the ranks agreed to go on: no rank may stop alone
    callback.on_train_batch_end(trainer, None, None, None, 0)
    assert stops == [] and trainer.strategy.asked == []
    callback.on_train_batch_end(trainer, None, None, None, 1)  # no value recorded: one all-reduce (any)
    assert trainer.strategy.asked == [(True, False)] and stops == [trainer]


# ------------------------------------------------------------------------ checkpoint naming
@pytest.mark.parametrize(
    "names",
    [
        None,
        [],
        ["other.ckpt", "last.ckpt"],
        ["hpc_ckpt_1.ckpt"],
        ["hpc_ckpt_3.ckpt", "hpc_ckpt_12.ckpt", "x.ckpt"],
    ],
)
def test_the_checkpoint_name_is_the_one_lightnings_hpc_resume_picks(tmp_path, names):
    root = tmp_path / "root"
    if names is not None:
        root.mkdir()
        for name in names:
            (root / name).write_bytes(b"")
    path = next_checkpoint_path(root)
    assert str(path) == _CheckpointConnector.hpc_save_path(str(root))
    root.mkdir(exist_ok=True)
    Path(path).write_bytes(b"")
    connector = _CheckpointConnector(
        pl.Trainer(default_root_dir=root, logger=False, accelerator="cpu", devices=1)
    )
    assert connector._hpc_resume_path == str(path) == str(latest_checkpoint(root))


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None


# ------------------------------------------------------------ in a Trainer: stop, then resume
STEPS, SIGNAL_AT = 7, 2


class Linear(pl.LightningModule):
    def __init__(self, signal_at: int | None = None, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layer = torch.nn.Linear(3, 1, dtype=torch.float64)
        self.signal_at = signal_at
        self.steps: list[int] = []

    def training_step(self, batch, batch_idx):
        self.steps.append(self.global_step)
        if self.global_step == self.signal_at:
            _deliver(signal.SIGTERM)  # mid-step: the step still finishes, then the run stops
        x, y = batch[:, :3], batch[:, 3:]
        return (self.layer(x) - y).pow(2).mean()

    def train_dataloader(self):
        data = torch.randn(40, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        return StatefulDataLoader(list(data), batch_size=4, shuffle=False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _trainer(root: Path, callbacks=()) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        default_root_dir=root,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_sigterm_in_a_step_saves_there_exits_143_and_resumes_exactly(tmp_path, sentinel, capfd):
    _, calls = sentinel
    reference = Linear()
    _trainer(tmp_path / "reference").fit(reference)

    trainer = _trainer(tmp_path / "run", [PreemptionCallback()])
    with pytest.raises(PreemptedError) as info:
        trainer.fit(Linear(signal_at=SIGNAL_AT))
    assert info.value.code == EXIT_PREEMPTED == 143
    assert isinstance(info.value, SystemExit) and not isinstance(info.value, Exception)
    saved = tmp_path / "run" / "hpc_ckpt_1.ckpt"
    assert Path(info.value.checkpoint) == saved and info.value.signal_name == "SIGTERM"
    assert calls == [] and not trainer._signal_connector.received_sigterm, "Lightning's own handler ran"
    assert signal.getsignal(signal.SIGTERM) is sentinel[0], "handlers not restored after the run"
    message = capfd.readouterr().err
    assert (
        f"preempted by SIGTERM on rank 0: saved a checkpoint after step {SIGNAL_AT + 1} to {saved}" in message
    )
    assert 'ckpt_path="hpc"' in message
    assert torch.load(saved, weights_only=False)["global_step"] == SIGNAL_AT + 1

    resumed = Linear(seed=1)  # other initial weights: only the checkpoint can make them equal
    _trainer(tmp_path / "run").fit(resumed, ckpt_path="hpc")
    assert resumed.steps == list(range(SIGNAL_AT + 1, STEPS))
    for got, want in zip(resumed.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


# ------------------------------------------------------- 2 ranks: whom the scheduler signals
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("target", ["group", "rank 1", "launcher"])
def test_sigterm_to_the_group_one_rank_or_the_launcher_saves_once_and_exits_143(tmp_path, target):
    assert_sigterm_saves_once_and_exits_143(TESTS / "_ddp_script.py", tmp_path, target, ready_s=120, end_s=60)
