"""Refining the cost model during training, in one process on synthetic timings: the samples, the
lag, the loader's schedule, the checkpointed refit (a resume plans as the run without the stop),
the fit telemetry and the option that switches it off."""

from __future__ import annotations

import dataclasses
import math

import lightning.pytorch as pl
import pytest
import torch
from _strategy_helpers import in_this_process

from lightning_bytescale import ByteScaleDataModule, ByteScaleStrategy
from lightning_bytescale.errors import ConfigError
from lightning_bytescale.lightning.cost_refinement import RUN_SCHEDULE_FILE, CostRefinement
from lightning_bytescale.lightning.telemetry import cost_metrics
from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.planner.cost_features import Work
from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.cost_refit import read_schedule, refined_cost_model
from lightning_bytescale.planner.errors import CostRefitError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The "machine": what a micro-batch takes here, whatever the model the run plans with says.
TRUE = CostModel.paper_preset().with_(a=3e-9, b=2e-6, g=4e-5)


def synthetic_seconds(self, local, works):
    """Deterministic timings of the true model with a few percent of noise fixed by the features,
    so two runs of the same steps measure the same."""
    out = []
    for row in works:
        w = Work.from_row(row)
        wobble = 1.0 + 0.04 * math.sin(w.area * 1e-3 + w.tokens)
        out.append(TRUE.num_layers * (TRUE.a * w.area + TRUE.b * w.tokens + TRUE.g) * wobble)
    return out


class LM(pl.LightningModule):
    def __init__(self, vocab: int, seen: list):
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaModel(dataclasses.replace(LlamaConfig.preset("tiny"), vocab=vocab))
        self.seen = seen

    def on_train_batch_start(self, batch, batch_idx):
        self.seen.append((batch.stats["plan_index"], batch.digest))

    def training_step(self, mb, batch_idx):
        return mb.loss(self.model(mb.input_ids, mb.position_ids))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Stats(pl.Callback):
    def __init__(self):
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, *args):
        self.rows.append(dict(trainer.strategy.step_stats))


def _data(tmp_path, num_workers: int = 0) -> ByteScaleDataModule:
    return ByteScaleDataModule(
        source={"kind": "synthetic", "name": "github", "num_samples": 200, "scale": 1 / 256},
        cache_dir=tmp_path / "cache", tokens_per_step=768, num_workers=num_workers,
    )  # fmt: skip


def _fit(
    run, tmp_path, max_steps, *, ckpt=None, save_every=None, num_workers=0, trainer_options=None, **strategy
):
    data = _data(tmp_path, num_workers)
    data.prepare_data()
    data.setup("fit")
    seen: list = []
    stats = Stats()
    callbacks = [stats]
    if save_every:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(dirpath=run / "ckpt", every_n_train_steps=save_every, save_top_k=-1)
        )
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=bool(save_every),
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        default_root_dir=run, callbacks=callbacks,
        strategy=ByteScaleStrategy(timeout=30, capacity=96, **strategy), **(trainer_options or {}),
    )  # fmt: skip
    with in_this_process():
        trainer.fit(LM(data.vocab_size, seen), datamodule=data, ckpt_path=ckpt, weights_only=False)
    return seen, stats.rows


@pytest.fixture
def timings(monkeypatch):
    monkeypatch.setattr(CostRefinement, "local_seconds", synthetic_seconds)


def test_refined_plans_fit_and_a_resume_plans_as_the_run_without_the_stop(tmp_path, timings):
    seen, rows = _fit(tmp_path / "whole", tmp_path, 24, refine_cost_model=True)
    assert [i for i, _ in seen] == list(range(24))  # the plan index counts over epochs
    # the fit: the paper preset is far off this "machine"; after 20 steps the refined model is not
    errors = [r["cost_error"]["median"] for r in rows]
    base = [r["cost_base_error"]["median"] for r in rows]
    assert min(base) > 0.5
    assert max(errors[20:]) <= 0.15, errors
    updated = [
        (i, r["cost_fit_report"]["applies_from"])
        for i, r in enumerate(rows)
        if r["cost_fit_report"]["updated"]
    ]
    assert updated and all(
        at == i + 2 for i, at in updated
    )  # the lag: RefitConfig's 2 (the loader's need: 1)
    assert updated[0][0] >= 2  # the warm-up steps are not sampled
    metrics = cost_metrics(rows[-1])
    assert metrics["cost/error_median"] == errors[-1] and metrics["cost/base_error_median"] == base[-1]
    assert {"cost/a", "cost/b", "cost/g", "cost/error_worst", "cost/refit_updated"} <= set(metrics)
    # the run's folder holds the schedule bytescale-sim reads
    newest = refined_cost_model(read_schedule(tmp_path / "whole" / RUN_SCHEDULE_FILE).to_json_dict())
    assert newest.a != CostModel.paper_preset().a

    # stopped after step 8 (its checkpoint), resumed: steps 8.. plan exactly as in the whole run
    _fit(tmp_path / "stop", tmp_path, 8, save_every=8, refine_cost_model=True)
    (ckpt,) = (tmp_path / "stop" / "ckpt").glob("*.ckpt")
    resumed, _ = _fit(tmp_path / "resumed", tmp_path, 14, ckpt=str(ckpt), refine_cost_model=True)
    assert resumed == seen[8:14]
    assert len({d for _, d in seen[8:14]}) == 6  # (each step's own plan)
    # a checkpoint without a refit (saved with it off): the resume starts refining where it stands
    _fit(tmp_path / "stop_off", tmp_path, 8, save_every=8, refine_cost_model=False)
    (ckpt,) = (tmp_path / "stop_off" / "ckpt").glob("*.ckpt")
    again, _ = _fit(tmp_path / "resumed_off", tmp_path, 10, ckpt=str(ckpt), refine_cost_model=True)
    assert [i for i, _ in again] == [8, 9]


def test_switched_off_it_plans_with_the_base_model_and_still_reports_the_fit(tmp_path, timings):
    seen, rows = _fit(tmp_path / "off", tmp_path, 6, refine_cost_model=False)
    on, _ = _fit(tmp_path / "on", tmp_path, 6, refine_cost_model=True)
    assert seen[:3] == on[:3] and seen[3:] != on[3:]  # the same until the first refit applies
    assert all("cost_fit_report" not in r for r in rows)
    assert all(r["cost_coefficients"]["a"] == CostModel.paper_preset().a for r in rows)
    assert all(r["cost_error"]["count"] > 0 for r in rows)
    default, _ = _fit(tmp_path / "default", tmp_path, 6)  # an explicit (here the preset) model stays pinned
    assert default == seen


@pytest.mark.multiprocess  # a loader worker process
def test_loader_workers_plan_each_step_with_the_model_the_schedule_gives_it(tmp_path, timings):
    """A worker plans ahead, so the lag is raised to its look-ahead plus one (1 x 2 + 1): it waits
    for the schedule file and plans every step as the inline loader does with the same lag."""
    workers, rows = _fit(tmp_path / "workers", tmp_path, 12, num_workers=1, refine_cost_model=True)
    inline, _ = _fit(tmp_path / "inline", tmp_path, 12, refine_cost_model={"lag": 3})
    base, _ = _fit(tmp_path / "base", tmp_path, 12, refine_cost_model=False)
    updates = [
        (i, r["cost_fit_report"]["applies_from"])
        for i, r in enumerate(rows)
        if r["cost_fit_report"]["updated"]
    ]
    assert updates and all(at == i + 3 for i, at in updates)
    assert workers == inline
    assert workers[:5] == base[:5] and workers[5:] != base[5:]  # the refined model re-plans from step 2 + 3


@pytest.mark.parametrize("limit", [1])
def test_epochs_cut_short_are_refused_before_the_first_step(tmp_path, limit):
    """``limit_train_batches`` skips step indices the lag counts on (the next epoch's loader would
    wait for a model no step publishes): refused at set-up, an int 1 (``fast_dev_run``'s) too."""
    with pytest.raises(ConfigError, match="limit_train_batches"):
        _fit(tmp_path / "run", tmp_path, 8, refine_cost_model=True,
             trainer_options={"limit_train_batches": limit, "max_epochs": 3})  # fmt: skip


def test_the_option_is_refused_where_it_cannot_run():
    with pytest.raises(ConfigError, match="refine_cost_model"):
        ByteScaleStrategy(refine_cost_model="yes")
    with pytest.raises(ConfigError, match="tensor_parallel_size=2"):
        ByteScaleStrategy(refine_cost_model=True, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="tensor_parallel_size=2"):
        ByteScaleStrategy(refine_cost_model={"window": 10}, tensor_parallel_size=2)
    with pytest.raises(CostRefitError, match="window"):  # a bad setting, before any rank starts
        ByteScaleStrategy(refine_cost_model={"window": 0})
    with pytest.raises(CostRefitError, match="unknown refit option"):
        ByteScaleStrategy(refine_cost_model={"windows": 10})


def test_the_wandb_run_gets_the_planned_against_measured_chart():
    """A chart that fails only warns (it must never stop training): check the payload itself."""
    import types

    from lightning_bytescale.lightning.telemetry import COST_FIT_COLUMNS, TelemetryCallback

    logged: list[dict] = []
    logger = types.SimpleNamespace(experiment=types.SimpleNamespace(log=logged.append))
    rows = [[0, 0, 0.5, 0.6, 96], [1, 0, 0.25, 0.2, 40]]
    TelemetryCallback._wandb_charts(logger, 3, {"cost_fit_rows": rows}, None)
    chart = logged[0]["charts/cost_fit"]
    assert chart.table.columns == COST_FIT_COLUMNS and chart.table.data == rows
