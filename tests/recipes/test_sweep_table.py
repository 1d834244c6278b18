"""The sweep's closing table and the per-run figures it is built from."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_bytescale.lightning.run_summary import RunSummary, run_figures
from lightning_bytescale.recipes.sweep_table import format_table, read_sweep, write_job_summary


def test_table_lists_jobs_in_job_order_with_rates_relative_to_the_first(tmp_path):
    jobs = [
        (10, "strategy.planner=balance", 30, 4000.0, 3.0),
        (0, "strategy.planner=static", 30, 2000.0, 3.5),
        (2, "strategy.planner=naive", 30, 3000.0, None),
    ]
    for num, overrides, steps, rate, loss in jobs:
        write_job_summary(
            tmp_path / f"{num}_{overrides}",
            {"overrides": overrides, "run/steps": steps, "run/tokens_per_s": rate, "loss": loss},
        )
    (tmp_path / "3_broken").mkdir()
    (tmp_path / "3_broken" / "summary.json").write_text("{not json")
    found = read_sweep(tmp_path)
    assert [j["overrides"] for j in found] == [
        "strategy.planner=static",
        "strategy.planner=naive",
        "strategy.planner=balance",
    ]
    lines = format_table(found).splitlines()
    assert lines[0].split() == ["job", "steps", "tokens/s", "vs", "first", "last", "loss"]
    assert lines[1].split() == ["strategy.planner=static", "30", "2,000", "1.00x", "3.5000"]
    assert lines[2].split() == ["strategy.planner=naive", "30", "3,000", "1.50x", "-"]
    assert lines[3].split() == ["strategy.planner=balance", "30", "4,000", "2.00x", "3.0000"]


class _Trainer(SimpleNamespace):
    pass


def _trainer() -> _Trainer:
    return _Trainer(
        global_step=0,
        strategy=SimpleNamespace(step_stats={}),
        callback_metrics={},
        is_global_zero=True,
        loggers=[],
    )


def test_run_summary_counts_optimizer_steps_and_tokens_after_the_first(monkeypatch):
    clock = iter([0.0, 2.0, 3.0, 3.5, 4.0])  # start, then the end of each batch
    monkeypatch.setattr("lightning_bytescale.lightning.run_summary.time.perf_counter", lambda: next(clock))
    trainer, summary = _trainer(), RunSummary()
    summary.on_train_start(trainer, None)
    for step, tokens in ((1, 100), (2, 200), (2, 999), (3, 400)):  # the third batch stepped nothing
        trainer.global_step = step
        trainer.strategy.step_stats = {"tokens": tokens}
        summary.on_train_batch_end(trainer, None, None, None, 0)
    summary.on_train_end(trainer, None)
    figures = run_figures(trainer)
    assert figures["run/steps"] == 3
    assert figures["run/tokens"] == 700
    assert figures["run/train_s"] == pytest.approx(3.5)
    # steps 2 and 3 (600 tokens) between the end of step 1 (t=2) and of step 3 (t=3.5)
    assert figures["run/tokens_per_s"] == pytest.approx(600 / 1.5)
    assert all(isinstance(v, torch.Tensor) for v in trainer.callback_metrics.values())


def test_the_first_loss_is_read_under_the_strategy_loss_name():
    """``ByteScaleStrategy(loss_name=...)`` logs the step's loss under that name; the closing block's
    first loss is read there, not under the default name (nor from what training_step returned)."""
    from lightning_bytescale import ByteScaleStrategy

    trainer, summary = _trainer(), RunSummary()
    trainer.strategy.loop_options = ByteScaleStrategy(loss_name="my/loss").loop_options
    trainer.callback_metrics = {"my/loss": torch.tensor(2.5), "train/loss": torch.tensor(9.0)}
    summary.on_train_start(trainer, None)
    trainer.global_step, trainer.strategy.step_stats = 1, {"tokens": 10}
    summary.on_train_batch_end(trainer, None, {"loss": torch.tensor(7.0)}, None, 0)
    assert summary.first_loss == pytest.approx(2.5)


def test_run_summary_reports_nothing_without_a_step():
    trainer, summary = _trainer(), RunSummary()
    summary.on_train_start(trainer, None)
    summary.on_train_end(trainer, None)
    assert run_figures(trainer) == {}


def test_the_table_says_why_and_that_the_equal_loss_is_exactness(tmp_path):
    """Issue 37, item 3: micro-batches per rank, ring tokens, balance (and a bubble with pipelines),
    and one line when every job ends at the same loss."""
    jobs = [
        {"overrides": "strategy.planner=static", "run/steps": 30, "run/tokens_per_s": 2000.0, "loss": 5.46801,
         "run/micro_batches_per_rank": 4.0, "run/ring_token_share": 1.0, "run/busy_max_over_mean": 1.004},
        {"overrides": "strategy.planner=balance", "run/steps": 30, "run/tokens_per_s": 3000.0, "loss": 5.46799,
         "run/micro_batches_per_rank": 2.5, "run/ring_token_share": 0.31, "run/busy_max_over_mean": 1.02},
    ]  # fmt: skip
    lines = format_table(jobs).splitlines()
    assert lines[0].split() == ["job", "steps", "tokens/s", "vs", "first", "micro-batches/rank", "ring", "tokens",
                                "busy", "max/mean", "last", "loss"]  # fmt: skip
    assert lines[1].split() == [
        "strategy.planner=static",
        "30",
        "2,000",
        "1.00x",
        "4.00",
        "100%",
        "1.00",
        "5.4680",
    ]
    assert lines[2].split() == [
        "strategy.planner=balance",
        "30",
        "3,000",
        "1.50x",
        "2.50",
        "31%",
        "1.02",
        "5.4680",
    ]
    assert lines[3].startswith("The last loss is the same for every job (5.4680)") and "exactness" in lines[3]
    jobs[1]["loss"] = 5.4701  # another loss, or other steps: no such line
    assert "exactness" not in format_table(jobs)
    jobs[1]["loss"], jobs[1]["run/steps"] = 5.46801, 29
    assert "exactness" not in format_table(jobs)
    jobs[0]["run/pipeline_bubble"] = 0.25  # a pipeline run: the bubble column appears
    assert format_table(jobs).splitlines()[0].split()[-3:] == ["bubble", "last", "loss"]


def test_run_summary_keeps_the_first_loss_and_the_figures_that_say_why(monkeypatch):
    clock = iter([0.0, 1.0, 2.0, 3.0])
    monkeypatch.setattr("lightning_bytescale.lightning.run_summary.time.perf_counter", lambda: next(clock))
    trainer, summary = _trainer(), RunSummary()
    summary.on_train_start(trainer, None)
    steps = [  # tokens, the step's loss, micro-batches per HDP rank, lengths and their ring sizes, balance
        (100, 5.5, [2, 4], [60, 40], [2, 1], 1.2),
        (200, 5.0, [3, 3], [100, 100], [1, 1], 1.0),
    ]
    for step, (tokens, loss, counts, lengths, degrees, balance) in enumerate(steps, start=1):
        trainer.global_step = step
        trainer.callback_metrics = {"train/loss": torch.tensor(loss)}
        trainer.strategy.step_stats = {
            "tokens": tokens, "num_micro_batches": counts, "lengths": lengths, "cp_degrees": degrees,
            "max_over_mean_measured": balance,
        }  # fmt: skip
        summary.on_train_batch_end(trainer, None, None, None, 0)
    summary.on_train_end(trainer, None)
    figures = run_figures(trainer)
    assert figures["run/first_loss"] == pytest.approx(5.5)
    assert figures["run/micro_batches_per_rank"] == pytest.approx(3.0)  # (3 + 3) / 2 steps
    assert figures["run/ring_token_share"] == pytest.approx(60 / 300)  # tokens in sequences on rings
    assert figures["run/busy_max_over_mean"] == pytest.approx(1.1)
    assert "run/pipeline_bubble" not in figures
