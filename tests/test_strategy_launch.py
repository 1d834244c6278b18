"""Launch paths and failure behaviour with real, separately started processes.

* Two "nodes" on this machine: two popen-launcher invocations with ``num_nodes=2``,
  ``NODE_RANK``/``MASTER_ADDR``/``MASTER_PORT``, loopback only.
* A dead peer: one rank is SIGKILLed in the middle of a ring exchange or of the gradient
  all-reduce; the survivors must exit with a clear error within the configured timeout and
  leave no process behind.
* A stuck peer: the survivors give up after the process-group timeout, not later.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

TESTS = Path(__file__).resolve().parent

SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    sys.path.insert(0, {tests!r})
    import torch
    torch.set_num_threads(1)
    import lightning.pytorch as pl
    import test_strategy as t
    from lightning_bytescale import ByteScaleStrategy

    scenario, out = sys.argv[1], sys.argv[2]
    world, devices, nodes = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

    class Model(t.TinyLM):
        def training_step(self, mb, batch_idx):
            ring = mb.layout.ring
            if scenario == "kill_ring" and batch_idx == 1 and ring is not None and self.global_rank == ring[-1]:
                # the other ring members are about to wait for this rank's first ring transfer
                os.kill(os.getpid(), signal.SIGKILL)
            return super().training_step(mb, batch_idx)

        def on_after_backward(self):
            # runs after this rank's micro-batches, right before the gradient all-reduce
            if self.global_rank == world - 1 and self.trainer.global_step == 1:
                if scenario == "kill_allreduce":
                    os.kill(os.getpid(), signal.SIGKILL)
                if scenario == "stuck_allreduce":
                    time.sleep(3600)

    class Report(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            rows = {{"rank": trainer.global_rank, "world": trainer.world_size,
                     "node": trainer.node_rank, "loss": float(trainer.callback_metrics["train/loss"])}}
            with open(os.path.join(out, f"done_{{trainer.global_rank}}.json"), "w") as fh:
                json.dump(rows, fh)

    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, num_nodes=nodes,
        strategy=ByteScaleStrategy(capacity=t.CAPACITY, timeout=float(os.environ.get("BS_TIMEOUT", "60"))),
        precision="64-true", max_steps=3, gradient_clip_val=t.CLIP, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        callbacks=[Report()],
    )
    trainer.fit(Model(), datamodule=t.StepDataModule("balance"))
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "LOCAL_RANK", "NODE_RANK"))}
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", **extra)
    return env


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
    script, port = _script(tmp_path), str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), "ok", str(tmp_path), "2", "1", "2"],
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
    _, losses = __import__("test_strategy").reference(3)
    assert done[0]["loss"] == pytest.approx(losses[-1], abs=1e-12)


@pytest.mark.parametrize(
    ("scenario", "timeout"), [("kill_ring", 20), ("kill_allreduce", 20), ("stuck_allreduce", 8)]
)
def test_dead_or_stuck_peer_gives_clear_error_within_timeout(tmp_path, scenario, timeout):
    """torchrun-style: one process per rank (LOCAL_RANK set); in step 1 one rank dies or hangs."""
    script, port, world = _script(tmp_path), str(_free_port()), 3
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), scenario, str(tmp_path), str(world), str(world), "1"],
            env=_env(
                MASTER_PORT=port,
                NODE_RANK="0",
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(world),
                BS_TIMEOUT=str(timeout),
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    start = time.monotonic()
    # start-up (imports on a busy 2-core machine) + the timeout + tear-down
    waited = procs if scenario.startswith("kill") else procs[:-1]  # the stuck rank never returns
    results = _finish(waited, start + 90 + timeout)
    elapsed = time.monotonic() - start
    if scenario.startswith("kill"):
        killed = [r for r, p in enumerate(procs) if p.poll() == -signal.SIGKILL]
        assert len(killed) == 1, [p.poll() for p in procs]
    else:
        killed = [world - 1]
    survivors = [(r, res) for r, res in enumerate(results) if r not in killed]
    assert len(survivors) == world - 1
    for r in killed:
        procs[r].kill()
        procs[r].wait()
    for rank, (code, err) in survivors:
        assert code is not None, f"rank {rank} still running after {elapsed:.0f} s (hang): {err[-2000:]}"
        assert code != 0, f"rank {rank} exited cleanly although its peer died"
        assert "[ByteScale]" in err and "Another rank has most likely died or is stuck" in err, err[-3000:]
    assert not list(tmp_path.glob("done_*.json"))
