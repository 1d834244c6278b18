"""A 2-rank ``ByteScaleStrategy`` training script for the stop, preemption and stuck-rank tests.

Run as ``python tests/_bytescale_script.py OUT MODE``.  What an operator runs: a plain script,
``strategy="bytescale"`` (the default popen launcher re-runs it for rank 1), the reference Llama
on ``ByteScaleDataModule`` (synthetic long-tail data, one loader worker per rank), no callback
of ours: the strategy brings its watchdog and preemption handling itself.  Every rank writes
``OUT/rank<r>.json`` (pid, step, its descendants) at every step.  Modes:

* ``train``: many short steps, for a test to signal;
* ``stuck``: rank 1 hangs in ``training_step`` in its first micro-batch of step 2; its watchdog
  (``watchdog=4``) ends it.  Samples are at most one rank's capacity long in this mode, so no
  micro-batch has a ring and no peer waits on the stuck rank: its own watchdog is the one that
  fires, at step 2 whatever the data (with rings, the first micro-batch without one came at a
  step that depended on the data: step 255 in one run).

The process-group timeout is 60 s: long enough for rank 1 to import Lightning on a busy machine.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_bytescale import ByteScaleDataModule, ByteScaleStrategy, proc
from lightning_bytescale.models import LlamaConfig, LlamaModel


class LM(pl.LightningModule):
    def __init__(self, out: Path, mode: str) -> None:
        super().__init__()
        self.out, self.mode = out, mode
        self.model = LlamaModel(LlamaConfig.preset("tiny", vocab=257))

    def training_step(self, mb, batch_idx):
        rank, step = self.global_rank, self.global_step
        if mb.index == 0:
            report = {"pid": os.getpid(), "step": step, "descendants": proc.descendants()}
            (self.out / f"rank{rank}.json").write_text(json.dumps(report))
        if self.mode == "stuck" and rank == 1 and step >= 2 and mb.layout.ring is None:
            time.sleep(3600)  # stuck in user code (no ring: no peer waits on it)
        time.sleep(0.05)
        return mb.loss(self.model(mb.input_ids, mb.position_ids))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    data = ByteScaleDataModule(
        source="github",
        cache_dir=out / "cache",
        tokens_per_step=512,
        context_length=128 if mode == "stuck" else 256,
        num_workers=1,
        seed=3,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ByteScaleStrategy(capacity=128, timeout=60, watchdog=4.0 if mode == "stuck" else True),
        max_steps=10_000,
        default_root_dir=out,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(LM(out, mode), datamodule=data)
    print("TRAINING ENDED NORMALLY", flush=True)


if __name__ == "__main__":
    main()
