"""ByteScaleStrategy with the project's DataModule and the Lightning features users rely on.

One fit per precision covers: ByteScaleDataModule (synthetic long-tail data), validation
loops, ModelCheckpoint, CSVLogger, ``self.log`` in user code, gradient clipping, an LR
scheduler and the telemetry contract (``strategy.step_stats``).
"""

from __future__ import annotations

import csv
import json
import math
import os

import lightning.pytorch as pl
import pytest
import torch

from lightning_bytescale import ByteScaleDataModule, ByteScaleStrategy, token_loss
from lightning_bytescale.models.llama import LlamaConfig, LlamaModel

pytestmark = pytest.mark.multiprocess

STAT_KEYS = {
    "loss",
    "tokens",
    "loss_tokens",
    "step_time_s",
    "busy_s",
    "planned_s",
    "num_micro_batches",
    "max_over_mean_planned",
    "max_over_mean_measured",
    "bubble_fraction",
    "ring_bytes",
    "ring_wait_s",
    "exposed_ring_planned_s",
    "plan_ms",
    "lengths",
    "cp_degrees",
}


class ByteLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaModel(LlamaConfig.preset("tiny", vocab=257))

    def training_step(self, mb, batch_idx):
        loss = token_loss(self.model(mb.input_ids, mb.position_ids), mb.labels, mb.num_global_tokens)
        self.log("user/slots", float(mb.num_slots), on_step=True, reduce_fx="sum")
        return loss

    def validation_step(self, mb, batch_idx):
        return token_loss(self.model(mb.input_ids, mb.position_ids), mb.labels, mb.num_global_tokens)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class StatsProbe(pl.Callback):
    def __init__(self, out) -> None:
        self.out = out
        self.rows: list[dict] = []
        self.lrs: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append(dict(trainer.strategy.step_stats))
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
        # the logged loss is the global one (same on all ranks), not this rank's share
        assert float(trainer.callback_metrics["train/loss"]) == pytest.approx(
            outputs["loss"].item(), rel=1e-6
        )

    def on_train_end(self, trainer, pl_module):
        path = self.out / f"probe_{trainer.global_rank}.json"
        path.write_text(json.dumps({"rows": self.rows, "lrs": self.lrs}))


@pytest.mark.parametrize(
    ("precision", "world", "comm_aware"), [("bf16-mixed", 2, True), ("32-true", 3, False)]
)
def test_datamodule_validation_checkpoint_logging(tmp_path, precision, world, comm_aware):
    os.environ.pop("MASTER_PORT", None)
    dm = ByteScaleDataModule(
        source={"kind": "synthetic", "name": "github", "num_samples": 240, "scale": 1 / 256},
        cache_dir=tmp_path / "cache",
        tokens_per_step=1024,
        val_fraction=0.2,
        num_workers=0,
    )
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ByteScaleStrategy(capacity=96, start_method="fork", timeout=60, comm_aware=comm_aware),
        precision=precision,
        max_steps=4,
        gradient_clip_val=1.0,
        log_every_n_steps=1,
        val_check_interval=2,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=pl.loggers.CSVLogger(tmp_path, name="csv"),
        callbacks=[ckpt, StatsProbe(tmp_path)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(ByteLM(), datamodule=dm)

    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt")) == [
        "epoch=0-step=2.ckpt",
        "epoch=0-step=4.ckpt",
    ]
    with open(next(tmp_path.glob("csv/version_*/metrics.csv"))) as fh:
        rows = list(csv.DictReader(fh))
    train = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert len(train) == 4 and len(val) == 2
    assert all(math.isfinite(x) and 3.0 < x < 8.0 for x in train + val)  # near ln(257) = 5.55
    assert any(r.get("user/slots") for r in rows)

    for r in range(world):
        probe = json.loads((tmp_path / f"probe_{r}.json").read_text())
        assert probe["lrs"] == pytest.approx([1e-3 * 0.5**k for k in range(1, 5)])
        for stats in probe["rows"]:
            assert stats.keys() >= STAT_KEYS
            assert (
                len(stats["busy_s"]) == world == len(stats["num_micro_batches"]) == len(stats["ring_wait_s"])
            )
            assert all(w >= 0 for w in stats["ring_wait_s"]) and stats["exposed_ring_planned_s"] >= 0
            assert len(stats["planned_s"]) == world and stats["max_over_mean_planned"] >= 1.0
            assert stats["loss_tokens"] == stats["tokens"] - len(
                stats["cp_degrees"]
            )  # one cp degree per sequence
            if stats["lengths"]:  # filled once the loader reports the global batch's lengths
                assert sum(stats["lengths"]) == stats["tokens"]
        assert [s["loss"] for s in probe["rows"]] == pytest.approx(train, rel=1e-6)


def test_documented_example_module_trains(tmp_path):
    """The complete example in docs/strategy.md runs as written (smaller sizes)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "strategy.md").read_text()
    block = [b for b in text.split("```python")[1:] if "class PackedLM" in b][0].split("```")[0]
    namespace: dict = {}
    exec(compile(block.split('if __name__ == "__main__":')[0], "docs/strategy.md", "exec"), namespace)
    os.environ.pop("MASTER_PORT", None)
    dm = ByteScaleDataModule(
        source={"kind": "synthetic", "name": "github", "num_samples": 120, "scale": 1 / 256},
        cache_dir=tmp_path / "cache",
        tokens_per_step=512,
        num_workers=0,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ByteScaleStrategy(capacity=64, start_method="fork", timeout=60),
        max_steps=2,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(namespace["PackedLM"](dim=32, layers=1, heads=2, context=128), datamodule=dm)
    assert math.isfinite(float(trainer.callback_metrics["train/loss"]))


@pytest.mark.parametrize("name", ["capacity", "cp_size", "seed"])
def test_planner_options_have_one_door_the_constructor(name):
    """``strategy.capacity = ...`` after the strategy is made is refused, naming the constructor option."""
    from lightning_bytescale.errors import ConfigError

    strategy = ByteScaleStrategy(capacity=512)
    with pytest.raises(ConfigError, match=rf"strategy\.{name} cannot be set.*ByteScaleStrategy\({name}=4\)"):
        setattr(strategy, name, 4)
    assert strategy.capacity == 512 and strategy.planner_config.capacity == 512


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_the_data_module_plans_with_the_trainers_ranks_until_the_strategy_knows_its_world(
    tmp_path, tensor_parallel
):
    """A strategy not given its devices yet (a trainer made by hand, a tool) knows no world: plain HDP's data
    module reads the trainer's ranks, not a world of one; on a mesh set by hand the mesh's HDP ranks."""
    from types import SimpleNamespace

    from lightning_bytescale.parallel import ParallelDims

    strategy = ByteScaleStrategy(tensor_parallel_size=tensor_parallel)
    if tensor_parallel > 1:
        dims = ParallelDims(4, tensor_parallel=tensor_parallel)
        strategy.parallel_mesh = SimpleNamespace(dims=dims, hdp_rank=1, lane=0, ring_ranks=dims.lane_ranks(0))
    data = ByteScaleDataModule(
        source={"kind": "synthetic", "name": "github", "num_samples": 8, "scale": 1 / 512}, cache_dir=tmp_path
    )
    data.trainer = SimpleNamespace(global_rank=3, world_size=4, strategy=strategy, overfit_batches=0)
    assert data._trainer_ranks() == ((3, 4) if tensor_parallel == 1 else (1, 2))
