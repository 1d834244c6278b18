"""A context the run cannot hold is an error before any rank starts (issue 37, item 4).

``context_length=1024`` with capacity 128 on 2 HDP ranks used to train on 256-token pieces with a
warning attributed to Lightning's ``trainer/call.py``.  Now ``ByteScaleDataModule.validate`` (and
``setup``) raise :class:`~lightning_bytescale.data.ContextLengthError` naming the three fixes,
``Trainer.fit`` raises it in the calling process before the launcher starts a rank (the
strategy's ``check_before_launch``), and ``bytescale-train`` prints it as one line before launch
(``tests/recipes/test_first_hour_recipe.py``).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch.distributed as dist

from lightning_bytescale import ByteScaleStrategy
from lightning_bytescale.data import ContextLengthError
from lightning_bytescale.lightning.datamodule import ByteScaleDataModule
from lightning_bytescale.recipes.module import PretrainModule


def _dm(tmp_path, **kw) -> ByteScaleDataModule:
    return ByteScaleDataModule(
        source="github", cache_dir=str(tmp_path / "cache"), tokens_per_step=4096, num_workers=0, **kw
    )


def test_a_context_longer_than_the_ranks_hold_names_the_three_fixes(tmp_path):
    dm = _dm(tmp_path, capacity=128, context_length=1024)
    with pytest.raises(ContextLengthError) as err:
        dm.validate(world_size=2)
    text = str(err.value)
    assert (
        "context_length=1,024 is more than the planner can place on 2 HDP rank(s) with capacity 128" in text
    )
    assert "every longer document would be cut to 256 tokens" in text
    assert "Lower context_length to 256" in text  # 1: the context
    assert "raise capacity to 512" in text and "the HDP ranks to 8" in text  # 2: capacity or ranks
    assert "offload=True" in text  # 3: activation offload
    _dm(tmp_path, capacity=128, context_length=256).validate(world_size=2)  # what the ranks hold: fine
    _dm(tmp_path, capacity=128, context_length=None).validate(world_size=2)  # the pool itself: fine


def test_offload_that_holds_the_context_is_not_an_error(tmp_path):
    dm = _dm(tmp_path, capacity=16384, context_length=524288, offload=True)
    dm.validate(world_size=2)  # 2 x 16K without offload; the default cost model's offload holds 512K
    with pytest.raises(ContextLengthError, match="offload=True .*enough\\)"):
        _dm(tmp_path, capacity=16384, context_length=524288, offload=False).validate(world_size=2)


class _NoLaunch:
    """Stands in for the fork launcher's start of the ranks: the test fails if it is reached."""

    def __init__(self) -> None:
        self.started = False

    def __call__(self, *args, **kwargs):
        self.started = True
        raise AssertionError("the launcher started the ranks")


def test_trainer_fit_refuses_it_before_the_launcher_starts_a_rank(tmp_path, monkeypatch):
    from lightning_bytescale.lightning import launcher

    never = _NoLaunch()
    monkeypatch.setattr(launcher._MultiProcessingLauncher, "launch", never)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=ByteScaleStrategy(capacity=128, start_method="fork"),
        max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(ContextLengthError, match="on 2 HDP rank"):
        trainer.fit(PretrainModule(preset="tiny", vocab=257), datamodule=_dm(tmp_path, context_length=1024))
    assert not never.started and not dist.is_initialized()
    # with tensor parallelism an HDP rank is 2 devices: 4 devices hold 2 x 128 tokens
    tp = pl.Trainer(
        accelerator="cpu", devices=4, strategy=ByteScaleStrategy(capacity=128, tensor_parallel_size=2,
        start_method="fork"), max_steps=1, logger=False, enable_progress_bar=False, default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(ContextLengthError, match="on 2 HDP rank"):
        tp.fit(PretrainModule(preset="tiny", vocab=257), datamodule=_dm(tmp_path, context_length=1024))
    assert not never.started
