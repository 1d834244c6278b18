"""Launch paths and failure behaviour with separately started processes.

* Two "nodes" on this machine: two popen-launcher invocations (fresh interpreters) with
  ``num_nodes=2``, ``NODE_RANK``/``MASTER_ADDR``/``MASTER_PORT``, loopback only.
* A dead peer: one process per rank, started like torchrun starts them (``LOCAL_RANK`` set,
  forked here to save interpreter start-up); one rank is SIGKILLed in the middle of a ring
  exchange or of the gradient all-reduce, and the survivors must exit with a clear error
  within the configured timeout, leaving no process behind.
* A stuck peer: the survivors give up after the process-group timeout, not later.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
from _lifecycle import (
    TESTS,
    clean_env,
    run_as_torchrun_rank,
)  # TESTS: on sys.path in the script, for _strategy_helpers
from _ranks import free_port, run_ranks
from _strategy_helpers import (
    CAPACITY,
    CLIP,
    Recorder,
    StepDataModule,
    TinyLM,
    quiet_trainer,
    read_rows,
    reference,
)

from lightning_bytescale import ByteScaleStrategy

pytestmark = pytest.mark.multiprocess

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, {tests!r})
    import torch
    torch.set_num_threads(1)
    import lightning.pytorch as pl
    import _strategy_helpers as t
    from lightning_bytescale import ByteScaleStrategy

    out, devices, nodes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

    class Report(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            rows = {{"rank": trainer.global_rank, "world": trainer.world_size,
                     "node": trainer.node_rank, "loss": float(trainer.callback_metrics["train/loss"])}}
            with open(os.path.join(out, f"done_{{trainer.global_rank}}.json"), "w") as fh:
                json.dump(rows, fh)

    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, num_nodes=nodes,
        strategy=ByteScaleStrategy(capacity=t.CAPACITY, timeout=60),
        precision="64-true", max_steps=3, gradient_clip_val=t.CLIP, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        callbacks=[Report()],
    )
    trainer.fit(t.TinyLM(), datamodule=t.StepDataModule("balance"))
    """
)


def _env(**extra: str) -> dict[str, str]:
    return clean_env(MASTER_ADDR="127.0.0.1", **extra)


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT.format(tests=str(TESTS)))
    return path


def _finish(procs: list[subprocess.Popen], deadline: float) -> list[tuple[int | None, str]]:
    """Wait for every process until ``deadline``; kill (and report) any still running."""
    results = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append((p.returncode, err))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            results.append((None, err))
    return results


def test_two_nodes_on_loopback(tmp_path):
    script, port = _script(tmp_path), str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path), "1", "2"],
            env=_env(MASTER_PORT=port, NODE_RANK=str(node)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    results = _finish(procs, time.monotonic() + 240)
    for code, err in results:
        assert code == 0, err[-3000:]
    done = [json.loads((tmp_path / f"done_{r}.json").read_text()) for r in range(2)]
    assert [(d["rank"], d["node"], d["world"]) for d in done] == [(0, 0, 2), (1, 1, 2)]
    assert len({d["loss"] for d in done}) == 1  # every rank logs the same global loss
    _, losses = reference(3)
    assert done[0]["loss"] == pytest.approx(losses[-1], abs=1e-12)


class _FailingLM(TinyLM):
    """Kills (SIGKILL) or hangs one rank in step 1, in a ring exchange or before the all-reduce."""

    scenario = ""

    def training_step(self, mb, batch_idx):
        ring = mb.layout.ring
        if (
            self.scenario == "kill_ring"
            and batch_idx == 1
            and ring is not None
            and self.global_rank == ring[-1]
        ):
            os.kill(os.getpid(), signal.SIGKILL)  # the other members wait for this rank's ring transfer
        return super().training_step(mb, batch_idx)

    def on_before_zero_grad(self, optimizer):
        # runs after this rank's micro-batches, right before the gradient all-reduce (which the
        # strategy's backward joins, before on_after_backward)
        if self.global_rank == self.trainer.world_size - 1 and self.trainer.global_step == 1:
            if self.scenario == "kill_allreduce":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.scenario == "stuck_allreduce":
                time.sleep(3600)


def _rank_main(rank: int, scenario: str, world: int, port: str, timeout: float, out: Path) -> None:
    """One rank, started like torchrun does (LOCAL_RANK set, so Lightning launches nothing)."""

    def fit() -> None:
        model = _FailingLM()
        model.scenario = scenario
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=ByteScaleStrategy(capacity=CAPACITY, timeout=timeout),
            precision="64-true",
            max_steps=3,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
        )
        trainer.fit(model, datamodule=StepDataModule("balance"))

    run_as_torchrun_rank(rank, world, port, out, fit)


@pytest.mark.parametrize(
    ("scenario", "timeout"), [("kill_ring", 20), ("kill_allreduce", 20), ("stuck_allreduce", 5)]
)
def test_dead_or_stuck_peer_gives_clear_error_within_timeout(tmp_path, scenario, timeout):
    """In step 1 one rank of 3 dies (SIGKILL) or hangs; the others must fail fast and clearly."""
    world = 3
    stuck = world - 1 if scenario.startswith("stuck") else None
    exits = run_ranks(  # no process outlives it: the stuck rank is killed at the end of the wait
        _rank_main,
        world,
        scenario,
        world,
        str(free_port()),
        timeout,
        tmp_path,
        method="fork",
        timeout_s=60 + timeout,
        check=False,
        wait_for=[r for r in range(world) if r != stuck],
    )
    elapsed = exits.seconds
    alive = [r for r in exits.alive if r != stuck]
    assert not alive, f"ranks {alive} still running {elapsed:.0f} s after start (hang)"
    # a killed peer is noticed at once (connection closed); a stuck one after the timeout
    assert elapsed < (timeout if stuck is None else timeout + 30), elapsed
    if stuck is None:
        killed = [r for r, code in enumerate(exits.exitcodes) if code == -signal.SIGKILL]
        assert len(killed) == 1, exits.exitcodes
    else:
        killed = [world - 1]
    phases = []
    for r in range(world):
        if r in killed:
            continue
        err = (tmp_path / f"stderr_{r}.txt").read_text()
        assert exits.exitcodes[r] == 1, f"rank {r} exited with {exits.exitcodes[r]}: {err[-2000:]}"
        assert f"[ByteScale] rank {r}: another rank died or stopped answering during" in err, err[-3000:]
        assert f"process-group timeout {timeout} s" in err and "resume from the last checkpoint" in err
        ring = "stopped answering during micro-batch" in err
        allreduce = "stopped answering during the gradient all-reduce of step 1" in err
        assert ring or allreduce, err[-3000:]
        phases.append("ring" if ring else "allreduce")
    # ring partners of the killed rank fail inside the ring; ranks outside it at the all-reduce
    assert ("ring" in phases) == (scenario == "kill_ring"), phases
    assert not list(tmp_path.glob("done_*"))


def test_spawn_launcher(tmp_path):
    """``bytescale_spawn``: fresh interpreters receive the pickled trainer, module and data."""
    strategy = ByteScaleStrategy(capacity=CAPACITY, start_method="spawn")
    trainer = quiet_trainer(
        tmp_path, 2, strategy, max_steps=2, gradient_clip_val=CLIP, callbacks=[Recorder(tmp_path)]
    )
    trainer.fit(TinyLM(), datamodule=StepDataModule("balance"))
    _, losses = reference(2)
    assert [row["logged"] for row in read_rows(tmp_path, 1)] == pytest.approx(losses, abs=1e-12)
