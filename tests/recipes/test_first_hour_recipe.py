"""The recipe's errors before any process starts: one line, once, exit code 2, no W&B run left
behind (issue 17, item 4).  Subprocess runs of ``bytescale-train``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from _recipe_helpers import train_command

from lightning_bytescale.lightning.datamodule import ByteScaleDataModule


def _fail(args: list[str], tmp: Path, before_launch: bool = True) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "RANK", "LOCAL_RANK", "WORLD_SIZE")
    }
    env.update(
        OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true", BYTESCALE_DATA_CACHE=str(tmp / "cache"),
        NETRC=str(tmp / "no-netrc"),
    )  # fmt: skip
    proc = subprocess.run(
        [*train_command(), f"hydra.run.dir={tmp / 'run'}", *args],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp,
    )  # fmt: skip
    assert proc.returncode == 2, (
        f"exit {proc.returncode}\nSTDOUT\n{proc.stdout[-3000:]}\nSTDERR\n{proc.stderr[-5000:]}"
    )
    assert "Traceback" not in proc.stderr + proc.stdout
    assert ("Initializing distributed" in proc.stderr + proc.stdout) is not before_launch
    assert not list((tmp / "run").rglob("wandb")), "a W&B folder for a run that never started"
    return proc


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("bytescale-train:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def _notes(tmp: Path) -> Path:
    folder = tmp / "notes"
    folder.mkdir()
    for i in range(6):
        (folder / f"n{i}.md").write_text(f"note {i} " + "words and more words " * (20 + 30 * i))
    return folder


def test_a_budget_below_the_longest_sample_fails_before_the_ranks_start(tmp_path):
    folder = _notes(tmp_path)
    # the store of an earlier run exists: its index tells the longest sample without a build
    ByteScaleDataModule(source=str(folder), pattern="*.md", cache_dir=str(tmp_path / "cache")).prepare_data()
    proc = _fail(
        ["data=text", f"data.source={folder}", "data.pattern=*.md", "data.tokens_per_step=100",
         "data.context_length=512", "trainer.max_steps=1"],
        tmp_path,
    )  # fmt: skip
    line = _one_error_line(proc)
    assert "tokens_per_step=100 is smaller than the longest sample (512 tokens; context_length=512)" in line


def test_a_missing_source_is_one_line_naming_the_key(tmp_path):
    proc = _fail(["data=text"], tmp_path)
    line = _one_error_line(proc)
    assert "data.source has no value" in line and "data.source=/path/to/folder" in line
    assert "MissingMandatoryValue" not in proc.stderr


def test_a_bad_option_of_the_data_module_is_one_line(tmp_path):
    proc = _fail(["data=jsonl", "data.source=x.jsonl", "data.pattern=*.md"], tmp_path)
    assert "pattern='*.md' is an option of a folder" in _one_error_line(proc)


def test_a_budget_found_wrong_only_once_the_store_is_built_is_still_one_line(tmp_path):
    """No store yet: the check happens in setup, on every rank; still one line, exit 2, no W&B run."""
    proc = _fail(
        ["data=github", "data.tokens_per_step=100", "data.context_length=512", "trainer.max_steps=1"],
        tmp_path, before_launch=False,
    )  # fmt: skip
    assert "tokens_per_step=100 is smaller than the longest sample (512 tokens" in _one_error_line(proc)


def test_a_misspelt_key_is_answered_with_the_key_meant_not_with_plus(monkeypatch, capsys):
    import sys

    import pytest

    from lightning_bytescale.cli.train import main, override_typo

    monkeypatch.setattr(sys, "argv", ["bytescale-train", "strategy.plannr=static", "trainer.max_steps=1"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "bytescale-train: strategy.plannr is not a key of the strategy config (StrategyConfig): "
        "did you mean strategy.planner? (strategy.planner=static)"
    )
    assert override_typo(["trainer.max_step=3"]).endswith(
        "did you mean trainer.max_steps? (trainer.max_steps=3)"
    )
    # valid overrides, sweeps, keys added with +, and keys close to nothing are left to Hydra
    for args in (["strategy.planner=static"], ["-m", "strategy.planner=static,naive"], ["+strategy.plannr=1"],
                 ["strategy.zzzzq=1"]):  # fmt: skip
        assert override_typo(args) is None, args


def test_a_context_the_ranks_cannot_hold_is_one_line_before_launch(tmp_path):
    """Issue 37, item 4: 1,024 tokens on 2 ranks of capacity 256 used to train on 512-token pieces."""
    proc = _fail(["experiment=cpu_smoke", "data.context_length=1024", "trainer.max_steps=1"], tmp_path)
    line = _one_error_line(proc)
    assert line.startswith(
        "bytescale-train: ContextLengthError: context_length=1,024 is more than the planner can place on 2 HDP "
        "rank(s) with capacity 256 tokens a rank: at most 512 tokens"
    ), line
    assert (
        "data.context_length=512" in line and "strategy.capacity" in line and "strategy.offload=true" in line
    )
    assert "call.py" not in proc.stderr  # nothing attributed to Lightning's hook caller
