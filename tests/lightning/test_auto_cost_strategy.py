"""``ByteScaleStrategy(cost_model="auto")`` in one process: measured at set-up, read back on the
second start, refused before the first step where it cannot measure."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from _strategy_helpers import in_this_process
from torch.utils.data import DataLoader

from lightning_bytescale import ByteScaleStrategy
from lightning_bytescale.engine.micro_batch import build_step
from lightning_bytescale.errors import ConfigError
from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.planner import make_plan
from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.profiler.cache import CACHE_ENV
from lightning_bytescale.profiler.errors import ProfileError

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LENGTHS = [12, 20, 30]


class Steps(torch.utils.data.Dataset):
    def __init__(self):
        self.plan = make_plan(LENGTHS, world_size=1, capacity=64, planner="balance")

    def __len__(self):
        return 2

    def __getitem__(self, k):
        return build_step(self.plan, 0, lambda j: torch.arange(LENGTHS[j]) % 50, step=k)


class LM(pl.LightningModule):
    """No forward of its own: the LlamaModel it holds is what is measured."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaModel(LlamaConfig.preset("tiny"))
        self.configs_seen: list = []

    def training_step(self, mb, batch_idx):
        self.configs_seen.append(self.trainer.strategy.planner_config.cost_model)
        return mb.loss(self.model(mb.input_ids, mb.position_ids))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(tmp_path, module, **strategy):
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=ByteScaleStrategy(timeout=30, **strategy), max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, default_root_dir=tmp_path,
    )  # fmt: skip
    with in_this_process():
        trainer.fit(module, train_dataloaders=DataLoader(Steps(), batch_size=None))
    return trainer


def test_auto_is_measured_at_set_up_then_read_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    module = LM()
    with caplog.at_level("INFO"):
        trainer = _fit(tmp_path, module, cost_model="auto", capacity=64)
    cost = trainer.strategy.planner_config.cost_model
    assert isinstance(cost, CostModel) and cost.name == "auto-LlamaModel-cpu" and cost.num_layers == 2
    assert cost != CostModel.paper_preset() and (cost.attention_heads, cost.kv_heads) == (4, 2)
    assert module.configs_seen and all(
        c == cost for c in module.configs_seen
    )  # every micro-batch after set-up
    refinement = trainer.strategy.cost_refinement  # refine_cost_model=None refines an "auto" model ...
    assert refinement is not None and refinement.enabled and refinement.refit.base == cost
    files = list((tmp_path / "cache").glob("auto-*.json"))
    assert len(files) == 1
    assert any(
        "measured at lengths 16,32,64" in r.getMessage() and str(files[0]) in r.getMessage()
        for r in caplog.records
    )
    caplog.clear()
    with caplog.at_level("INFO"):
        again = _fit(tmp_path, LM(), cost_model="auto", capacity=64)
    assert again.strategy.planner_config.cost_model == cost
    pinned = _fit(tmp_path, LM(), cost_model=cost, capacity=64)  # ... and keeps an explicit one pinned
    assert not pinned.strategy.cost_refinement.enabled
    assert any("read back, nothing measured" in r.getMessage() for r in caplog.records)


def test_paper_and_none_are_todays_default(tmp_path):
    assert ByteScaleStrategy(cost_model="paper").planner_config.cost_model == CostModel.paper_preset()
    assert ByteScaleStrategy().planner_config.cost_model is None


def test_a_measurement_that_fails_stops_before_the_first_step_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    module = LM()
    with pytest.raises(
        ProfileError, match=r"C=32 is below 64.*cost_model='paper' \(the default\) or a bytescale-profile"
    ):
        _fit(tmp_path, module, cost_model="auto", capacity=32)
    assert module.configs_seen == []


def test_a_module_with_nothing_to_measure_is_refused_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))

    class Opaque(LM):
        def __init__(self):
            super().__init__()
            self.model.config = None  # no config naming heads

    with pytest.raises(ConfigError, match=r"cannot find the model to measure in Opaque.*bytescale-profile"):
        _fit(tmp_path, Opaque(), cost_model="auto", capacity=64)


def test_auto_is_refused_with_tensor_parallelism_before_any_rank_starts():
    with pytest.raises(ConfigError, match=r"cost_model='auto' measures a whole layer.*--tensor-parallel N"):
        ByteScaleStrategy(cost_model="auto", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="neither a cost model name nor an existing file"):
        ByteScaleStrategy(cost_model="Auto")
