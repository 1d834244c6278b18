"""What a first run prints besides its results (issue 29, item 6): each data warning once over the
splits and stages, no Lightning warning from the docs' own ``test_step`` recipe or from a data
module without a validation split, and a progress bar that never reads ``Epoch 0/-2``."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar
from test_first_hour_trainer import EvalModule

from lightning_bytescale import ByteScaleStrategy
from lightning_bytescale.lightning.datamodule import ByteScaleDataModule
from lightning_bytescale.lightning.progress import StepProgressBar
from lightning_bytescale.recipes.module import PretrainModule

CAP = 64


def _corpus(tmp_path: Path) -> Path:
    path = tmp_path / "docs.jsonl"
    with open(path, "w") as fh:
        for i in range(40):
            fh.write(json.dumps({"text": f"{i} " + "ab c" * (5 + 9 * (i % 7))}) + "\n")  # some > 2 * CAP
    return path


def _dm(tmp_path: Path, **kw) -> ByteScaleDataModule:
    return ByteScaleDataModule(
        source=str(_corpus(tmp_path)), cache_dir=str(tmp_path / "cache"), capacity=CAP, context_length=2 * CAP,
        tokens_per_step=2000, num_workers=0, seed=4, **kw,
    )  # fmt: skip


def test_each_data_warning_is_logged_once_over_the_splits_and_stages(tmp_path, caplog):
    dm = _dm(tmp_path, val_fraction=0.2, test_fraction=0.2, rank=0, world_size=2)
    dm.prepare_data()
    with caplog.at_level(logging.WARNING, logger="lightning_bytescale.lightning.datamodule"):
        for stage in ("fit", "validate", "test", "predict"):
            dm.setup(stage)
    long = [r.getMessage() for r in caplog.records if "longer than the context length" in r.getMessage()]
    assert len(long) == 3, long  # the training data, the validation split, the test split: once each
    assert len(set(long)) == 3


def test_a_fit_without_a_validation_split_skips_validation_and_gives_the_trainer_back(tmp_path):
    """setup("fit") sets limit_val_batches=0 for the fit only: teardown puts the user's value back."""
    dm = _dm(tmp_path)
    dm.prepare_data()
    dm.trainer = SimpleNamespace(
        global_rank=0, world_size=2, strategy=None, overfit_batches=0, limit_val_batches=0.5
    )  # 2 ranks hold the context of 2 x CAP
    dm.setup("fit")
    assert dm.trainer.limit_val_batches == 0
    dm.teardown("fit")
    assert dm.trainer.limit_val_batches == 0.5
    with_split = _dm(tmp_path, val_fraction=0.2)
    with_split.prepare_data()
    with_split.trainer = dm.trainer
    with_split.setup("fit")
    assert dm.trainer.limit_val_batches == 0.5


def test_the_progress_bar_names_the_step_limit_instead_of_epoch_minus_two():
    steps_only = SimpleNamespace(max_epochs=-1, max_steps=200)  # what Lightning sets for max_steps alone
    lightning_bar = RichProgressBar()
    lightning_bar._trainer = steps_only
    assert lightning_bar._get_train_description(0).strip() == "Epoch 0/-2"  # what it fixes
    bar = StepProgressBar()
    bar._trainer = steps_only
    assert bar._get_train_description(0).strip() == "Epoch 0 (to step 200)"
    bar._trainer = SimpleNamespace(max_epochs=3, max_steps=-1)
    assert bar._get_train_description(1).strip() == "Epoch 1/2"  # epochs bounded: Lightning's text


class DocsEvaluated(PretrainModule):
    """docs/data.md's test_step recipe, as written there."""

    def on_test_epoch_start(self):
        self.total = torch.zeros((), dtype=torch.float64)

    def test_step(self, mb, batch_idx):
        loss = self.training_step(mb, batch_idx)  # this micro-batch's part of the step's mean
        self.total += loss.detach()

    def on_test_epoch_end(self):  # the sum over micro-batches and ranks, per step
        self.log("test/loss", self.total, sync_dist=True, reduce_fx="sum")


def _trainer(tmp_path: Path, **kw) -> pl.Trainer:
    os.environ.pop("MASTER_PORT", None)
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy=ByteScaleStrategy(capacity=CAP, start_method="fork", timeout=60),
        precision="64-true", logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, use_distributed_sampler=False, default_root_dir=tmp_path, **kw,
    )  # fmt: skip


def run_docs_recipe(tmp: str) -> None:
    """Fit without a validation split, then test with the docs' recipe and with strategy.reduce."""
    tmp_path = Path(tmp)
    torch.manual_seed(0)
    model = DocsEvaluated(preset="tiny", vocab=257)
    model.configure_model()  # one set of weights for every call
    _trainer(tmp_path, max_steps=1).fit(model, datamodule=_dm(tmp_path, test_fraction=0.2))  # no val split
    got = _trainer(tmp_path).test(model, datamodule=_dm(tmp_path, test_fraction=0.2), verbose=False)
    reference = EvalModule(preset="tiny", vocab=257)  # the same loss through strategy.reduce(sum)
    reference.configure_model()
    reference.model.load_state_dict(model.model.state_dict())
    want = _trainer(tmp_path).test(reference, datamodule=_dm(tmp_path, test_fraction=0.2), verbose=False)
    print("LOSSES", got[0]["test/loss"], want[0]["test/loss"], flush=True)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_docs_test_step_recipe_and_no_validation_split_raise_no_lightning_warning(tmp_path):
    # a fresh interpreter: under pytest the ranks' warnings would be recorded, not printed
    here = Path(__file__).parent
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parent), env.get("PYTHONPATH", "")])
    code = f"import test_first_hour_noise as m; m.run_docs_recipe({str(tmp_path)!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    err = proc.stderr
    assert "Total length of" not in err and "val_dataloader" not in err, err[-3000:]
    assert "sync_dist=True" not in err, err[-3000:]
    got, want = (float(x) for x in proc.stdout.split("LOSSES", 1)[1].split())
    assert abs(got - want) < 1e-12
