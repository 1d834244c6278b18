"""A 2-rank Lightning training script (CPU, gloo) for the stop, preemption and stuck-rank tests.

Run as ``python tests/_ddp_script.py OUT MODE``; Lightning's popen launcher (here
:class:`~lightning_bytescale.lightning.launcher.ByteScaleScriptLauncher`) re-runs it for rank 1.  Each
rank trains a float64 linear model on a data loader with one worker process
(:class:`~lightning_bytescale.proc.LoaderWorkerInit`), a :class:`PreemptionCallback`, and a
:class:`StepWatchdog` that beats at every step, and writes ``OUT/rank<r>.json`` (pid, step,
its descendants) at every step.  Modes:

* ``train``: many short steps, for a test to signal;
* ``stuck``: rank 1 hangs in ``training_step`` at step 2; its watchdog (4 s) ends it.

The process-group timeout is 60 s: long enough for rank 1 to import Lightning on a busy machine.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset

from lightning_bytescale import proc
from lightning_bytescale.engine.watchdog import StepWatchdog
from lightning_bytescale.lightning.launcher import ByteScaleScriptLauncher
from lightning_bytescale.lightning.preemption import PreemptionCallback

PG_TIMEOUT_S = 60.0
WATCHDOG_S = {"train": 30.0, "stuck": 4.0}


class Strategy(DDPStrategy):
    def _configure_launcher(self) -> None:
        self._launcher = ByteScaleScriptLauncher(
            self.cluster_environment, self.num_processes, self.num_nodes, settle_s=1.0, exit_grace_s=20.0
        )


class Numbers(Dataset):
    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i % 7, i % 5, 1.0], dtype=torch.float64)


class Watch(pl.Callback):
    """Beats the watchdog at every step's phases (what the strategy does)."""

    def __init__(self, rank: int, timeout_s: float) -> None:
        self.dog = StepWatchdog(timeout_s, rank, timeout_option="the test's WATCHDOG_S")

    def on_train_start(self, trainer, pl_module) -> None:
        self.dog.start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.dog.beat(f"training_step of step {trainer.global_step}")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        # DDP's gradient all-reduce runs in the backward: a collective, bounded by the process-group
        # timeout; a rank waiting there for a stuck peer must not be the one to time out first
        self.dog.beat(f"backward and gradient all-reduce of step {trainer.global_step}", PG_TIMEOUT_S + 10)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.dog.idle()

    def teardown(self, trainer, pl_module, stage) -> None:
        self.dog.stop()


class Model(pl.LightningModule):
    def __init__(self, out: Path, mode: str) -> None:
        super().__init__()
        self.out, self.mode = out, mode
        self.layer = torch.nn.Linear(3, 1, dtype=torch.float64)

    def training_step(self, batch, batch_idx):
        rank, step = self.global_rank, self.global_step
        report = {"pid": os.getpid(), "step": step, "descendants": proc.descendants()}
        (self.out / f"rank{rank}.json").write_text(json.dumps(report))
        if self.mode == "stuck" and rank == 1 and step == 2:
            time.sleep(3600)  # stuck in user code
        time.sleep(0.05)
        return self.layer(batch).pow(2).mean()

    def train_dataloader(self):
        from lightning_bytescale.proc import LoaderWorkerInit

        return DataLoader(Numbers(), batch_size=4, num_workers=1, worker_init_fn=LoaderWorkerInit())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=Strategy(process_group_backend="gloo", timeout=timedelta(seconds=PG_TIMEOUT_S)),
        max_steps=10_000,
        callbacks=[PreemptionCallback(), Watch(rank, WATCHDOG_S[mode])],
        default_root_dir=out,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(Model(out, mode))
    print("TRAINING ENDED NORMALLY", flush=True)


if __name__ == "__main__":
    main()
