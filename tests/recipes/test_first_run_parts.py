"""The parts of a first run and of its resume that need no run (issue 37, items 6 and 8): the resume
command's launcher prefix and run folder, the W&B run id kept in a checkpoint, W&B's stale settings,
the progress bar's count and names, and a data module without validation data under a module
without ``validation_step``."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from lightning.pytorch.callbacks import RichProgressBar

from lightning_bytescale.cli._run_end import launch_prefix, resume_command
from lightning_bytescale.lightning.progress import StepProgressBar, prefer_step_bar
from lightning_bytescale.lightning.wandb_run import WandbRunId, WandbRunLogger, checkpoint_wandb_run_id


def _script(folder: Path, interpreter: str) -> Path:
    path = folder / "bin" / "bytescale-train"
    path.parent.mkdir()
    path.write_text(f"#!{interpreter}\nimport sys\n")
    path.chmod(0o755)
    return path


def test_the_prefix_is_what_the_user_typed(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    python = sys.executable
    script = _script(tmp_path, python)
    args = ["experiment=cpu_smoke", "trainer.devices=2"]
    # a console script the shell started through its #! line: the script, as typed (no PATH entry finds it)
    assert launch_prefix([str(script), *args], [python, str(script), *args], {}) == [str(script)]
    # ... and by its bare name where PATH finds that same file (an activated venv)
    monkeypatch.setenv("PATH", str(script.parent))
    assert launch_prefix([str(script), *args], [python, str(script), *args], {}) == ["bytescale-train"]
    # python -m, and a script handed to Python, keep the interpreter as typed
    module = "/site/lightning_bytescale/cli/train.py"
    typed = [".venv/bin/python", "-m", "lightning_bytescale.cli.train"]
    assert launch_prefix([module, *args], [*typed, *args], {}) == typed
    assert launch_prefix(["recipes/pretrain.py", *args], ["python", "-u", "recipes/pretrain.py", *args], {}) == [
        "python", "-u", "recipes/pretrain.py",
    ]  # fmt: skip
    # torchrun: the command line of the torchrun process that started this rank
    torchrun = ["torchrun", "--nproc-per-node", "4", "-m", "lightning_bytescale.cli.train"]
    rank = [python, "-u", module, *args]
    assert launch_prefix([module, *args], rank, {"TORCHELASTIC_RUN_ID": "1"}, [*torchrun, *args]) == torchrun
    # what cannot be typed again: bytescale-train
    assert launch_prefix(["-c", *args], [python, "-c", "main()", *args], {}) == ["bytescale-train"]


def test_the_resume_command_names_the_run_folder_and_keeps_the_prefix(tmp_path):
    command = resume_command(
        ["experiment=cpu_smoke"], tmp_path / "run" / "checkpoints" / "last.ckpt", 4,
        prefix=["python", "-m", "lightning_bytescale.cli.train"], run_dir=tmp_path / "run",
    )  # fmt: skip
    assert shlex.split(command) == [
        "python", "-m", "lightning_bytescale.cli.train", "experiment=cpu_smoke",
        f"ckpt_path={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}", "trainer.max_steps=4",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]  # fmt: skip
    given = resume_command(["hydra.run.dir=/mine"], "/x.ckpt", run_dir="/other")
    assert shlex.split(given) == [
        "bytescale-train",
        "hydra.run.dir=/mine",
        "ckpt_path=/x.ckpt",
    ]  # the user's wins


def test_the_w_and_b_run_id_is_kept_in_the_checkpoint_and_read_back_without_the_weights(tmp_path):
    callback = WandbRunId()
    callback.run_id = "ab12cd34"
    checkpoint = {
        "state_dict": {"w": torch.zeros(3)},
        "callbacks": {WandbRunId.__qualname__: callback.state_dict()},
    }
    torch.save(checkpoint, tmp_path / "last.ckpt")
    assert checkpoint_wandb_run_id(tmp_path / "last.ckpt") == "ab12cd34"
    folder = tmp_path / "sharded"  # a sharded folder: its meta.pt holds the callbacks
    folder.mkdir()
    torch.save({"callbacks": checkpoint["callbacks"]}, folder / "meta.pt")
    (folder / ".metadata").write_bytes(b"")
    assert checkpoint_wandb_run_id(folder) == "ab12cd34"
    torch.save({"state_dict": {}}, tmp_path / "other.ckpt")
    assert checkpoint_wandb_run_id(tmp_path / "other.ckpt") is None
    assert checkpoint_wandb_run_id(tmp_path / "missing.ckpt") is None
    restored = WandbRunId()
    restored.load_state_dict({"run_id": "ab12cd34"})
    assert restored.run_id == "ab12cd34"


def test_the_logger_hands_wandb_neither_of_its_stale_settings(tmp_path, monkeypatch):
    from lightning_bytescale.lightning.compat import wandb_init_options

    logger = WandbRunLogger(save_dir=str(tmp_path), offline=True, project="p", id="ab12cd34")
    options = wandb_init_options(logger)
    assert "anonymous" not in options and options["id"] == "ab12cd34" and options["resume"] == "allow"
    import wandb

    asked = []
    monkeypatch.setattr(wandb, "require", lambda requirement=None, **kw: asked.append(requirement))
    from lightning_bytescale.lightning import wandb_run

    with wandb_run._without_require_service():
        wandb.require("service")
        wandb.require("core")
    assert asked == ["core"]  # "service" never reaches wandb
    # what the spawn launcher pickles: Lightning's __getstate__ asks for "service" and starts the run
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    asked.clear()
    state = logger.__getstate__()
    try:
        assert asked == [] and state["_id"] == "ab12cd34"
    finally:
        wandb.finish()


def _bar(max_steps: int, global_step: int) -> StepProgressBar:
    bar = StepProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=-1, max_steps=max_steps, global_step=global_step)
    return bar


def test_the_bar_counts_steps_from_the_resumed_step_under_short_names(monkeypatch):
    bar = _bar(max_steps=4, global_step=3)
    assert bar.total_train_batches == 4  # not min(batches of the epoch, steps left)
    seen = []
    monkeypatch.setattr(RichProgressBar, "on_train_batch_end", lambda self, t, m, o, b, i: seen.append(i + 1))
    bar.on_train_batch_end(bar._trainer, None, None, None, 0)  # batch 0 of the resumed epoch, step 3
    assert seen == [3]
    monkeypatch.setattr(
        RichProgressBar, "get_metrics",
        lambda self, t, m: {"v_num": "l2ae", "train/loss": 5.5, "perf/tokens_per_s": 1555.26, "val/loss": 5.0},
    )  # fmt: skip
    assert bar.get_metrics(bar._trainer, None) == {"loss": 5.5, "tokens/s": "1,555", "val loss": 5.0}


def test_the_strategy_puts_the_step_bar_in_place_of_lightnings_default_rich_bar():
    default, other = RichProgressBar(refresh_rate=7), object()
    trainer = SimpleNamespace(callbacks=[other, default])
    prefer_step_bar(trainer)
    bar = trainer.callbacks[1]
    assert type(bar) is StepProgressBar and bar.refresh_rate == 7 and trainer.callbacks[0] is other
    mine = StepProgressBar()
    trainer = SimpleNamespace(callbacks=[mine])
    prefer_step_bar(trainer)
    assert trainer.callbacks == [mine]


class _Module:
    """Stands in for the trainer's LightningModule: with or without its own ``validation_step``."""

    def __init__(self, validates: bool) -> None:
        import lightning.pytorch as pl

        cls = type(
            "M", (pl.LightningModule,), {"validation_step": lambda self, b, i: None} if validates else {}
        )
        self.module = cls()


def test_no_validation_data_and_no_validation_step_show_lightning_no_val_dataloader(tmp_path):
    """Lightning warns "You passed in a val_dataloader but have no validation_step" when a data module
    overrides ``val_dataloader``; without a validation split there is nothing to skip."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lightning_bytescale.lightning.datamodule import ByteScaleDataModule

    def seen(val_fraction: float, validates: bool) -> bool:
        dm = ByteScaleDataModule(
            source="github", cache_dir=str(tmp_path), val_fraction=val_fraction, num_workers=0
        )
        dm.trainer = SimpleNamespace(strategy=SimpleNamespace(lightning_module=_Module(validates).module))
        return is_overridden("val_dataloader", dm)

    assert not seen(0.0, validates=False)  # the README's module: no warning
    assert seen(0.0, validates=True)  # a module that validates: no "validation_step but no val_dataloader"
    assert seen(0.1, validates=False)  # a split nobody evaluates: Lightning's warning is true
    detached = ByteScaleDataModule(source="github", cache_dir=str(tmp_path), num_workers=0)
    assert detached.val_dataloader.__func__ is ByteScaleDataModule.__dict__["val_dataloader"].method
