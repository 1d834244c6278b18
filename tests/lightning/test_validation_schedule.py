"""A fit that holds out validation data but ends before Lightning's first validation warns once (issue 37).

``first_validation_batch`` is checked against Lightning itself (a plain Trainer records the batch of
its first validation), then the strategy's warning on a ByteScale fit with a held-out split.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.demos.boring_classes import BoringModel
from test_first_hour_trainer import CAP, _corpus

from lightning_bytescale import ByteScaleStrategy
from lightning_bytescale.lightning.datamodule import ByteScaleDataModule
from lightning_bytescale.lightning.run_checks import first_validation_batch
from lightning_bytescale.recipes.module import PretrainModule


class FirstValidation(pl.Callback):
    """The schedule's prediction at the start of training, and the batch count at the first validation."""

    def __init__(self) -> None:
        self.predicted: float | None = None
        self.seen: int | None = None

    def on_train_start(self, trainer, pl_module):
        self.predicted = first_validation_batch(trainer)

    def on_validation_start(self, trainer, pl_module):
        if self.seen is None:
            self.seen = trainer.fit_loop.total_batch_idx + 1


@pytest.mark.parametrize(
    ("options", "batches"),
    [
        ({}, 8),  # the epoch's end
        ({"val_check_interval": 0.5}, 8),
        ({"val_check_interval": 3}, 8),
        ({"check_val_every_n_epoch": 2}, 8),
        ({"check_val_every_n_epoch": 3, "val_check_interval": 0.25}, 8),
        ({"check_val_every_n_epoch": None, "val_check_interval": 11}, 8),
        ({"limit_train_batches": 5, "check_val_every_n_epoch": 2}, 64),
    ],
)
def test_the_first_validation_batch_is_where_lightning_validates(tmp_path, options, batches):
    module = BoringModel()
    module.train_dataloader = lambda: torch.utils.data.DataLoader(torch.randn(batches, 32), batch_size=1)
    record = FirstValidation()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=40, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
        default_root_dir=tmp_path, callbacks=[record], **options,
    )  # fmt: skip
    trainer.fit(module)
    assert record.seen is not None and record.predicted == record.seen, (record.predicted, record.seen)


def _fit(tmp_path, **options) -> tuple[list[str], pl.Trainer]:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=ByteScaleStrategy(capacity=CAP), precision="64-true",
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        use_distributed_sampler=False, num_sanity_val_steps=0, default_root_dir=tmp_path, **options,
    )  # fmt: skip
    data = ByteScaleDataModule(
        source=str(_corpus(tmp_path)), cache_dir=str(tmp_path / "cache"), capacity=CAP, context_length=CAP,
        tokens_per_step=600, num_workers=0, val_fraction=0.1, seed=4,
    )  # fmt: skip
    had_group = dist.is_initialized()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(PretrainModule(preset="tiny", vocab=257), datamodule=data)
    finally:  # the one-rank fit's process group (kept, as under DDP) would reach the tests after this one
        if not had_group and dist.is_initialized():
            dist.destroy_process_group()
    return [str(w.message) for w in caught if "never validates" in str(w.message)], trainer


def test_a_fit_that_ends_before_its_first_validation_warns_once_naming_the_fix(tmp_path):
    said, trainer = _fit(tmp_path, max_steps=2)
    assert len(said) == 1, said
    assert "max_steps=2" in said[0] and "check_val_every_n_epoch=None" in said[0], said[0]
    assert "val/loss" not in trainer.callback_metrics


def test_a_fit_that_validates_within_max_steps_says_nothing(tmp_path):
    said, trainer = _fit(tmp_path, max_steps=2, val_check_interval=2, check_val_every_n_epoch=None)
    assert said == []
    assert "val/loss" in trainer.callback_metrics
