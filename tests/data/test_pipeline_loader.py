"""The step loader with pipelines: each item is the pipeline's ``PipelineStepBatch``, the one the torch floor builds.

``ByteScaleDataModule`` under ``ByteScaleStrategy(pipeline_parallel_size=P)`` plans for the
pipelines (``world_size`` HDP ranks, ``pipeline_degree=P`` from the strategy's planner config) and
gives its :class:`StepDataset` ``pipeline_stages=P`` and the stage's ring ranks; every stage and
lane of a pipeline then builds the same micro-batches.  Here the dataset's store is replaced by
tokens in memory, and its items are compared with :func:`build_pipeline_step` on the same plan.
"""

from __future__ import annotations

import numpy as np
import torch

from lightning_bytescale.data.loader import StepDataset
from lightning_bytescale.parallel import PipelineStepBatch, build_pipeline_step
from lightning_bytescale.planner import make_plan

CAPACITY = 24
SYNTHETIC = {"kind": "synthetic", "name": "github", "num_samples": 120, "scale": 1 / 256}
LENGTHS = (5, 9, 30, 14, 3, 20, 11)


class InMemorySteps(StepDataset):
    """A StepDataset whose global batch is ``LENGTHS`` (random tokens), without a token store."""

    def sample_ids(self, epoch: int, step: int) -> np.ndarray:
        return np.arange(len(LENGTHS))

    def tokens(self, sample: int) -> np.ndarray:
        g = torch.Generator().manual_seed(sample)
        return torch.randint(0, 64, (LENGTHS[sample],), generator=g).numpy()

    @property
    def masked(self) -> bool:
        return False

    def data_identity(self, ids: np.ndarray) -> str:
        return "in memory"

    def plan(self, epoch: int, step: int):
        return make_plan(LENGTHS, world_size=self.world_size, seed=step, **self.plan_options)


def test_items_are_the_pipeline_step_batches_of_the_plan():
    options = {"capacity": CAPACITY, "planner": "balance", "pipeline_degree": 2}
    for hdp_rank in range(2):
        ring_ranks = (2, 3)  # stage 1 of both pipelines on the (2, 2) mesh
        ds = InMemorySteps(None, None, None, hdp_rank, 2, options, ring_ranks=ring_ranks, pipeline_stages=2)
        got = ds[(0, 1)]
        assert isinstance(got, PipelineStepBatch)
        plan = ds.plan(0, 1)
        want = build_pipeline_step(
            plan, hdp_rank, lambda j, ds=ds: torch.from_numpy(ds.tokens(j)), stages=2, step=1, ring_ranks=ring_ranks,
            data_identity="in memory",
        )  # fmt: skip
        assert got.counts == want.counts and got.step.digest == want.step.digest
        assert len(got.micro_batches) == len(want.micro_batches) > 0
        for a, b in zip(got.micro_batches, want.micro_batches):
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
            assert a.layout == b.layout and a.num_slots == CAPACITY
        assert got.stats["loss_tokens"] == sum(n - 1 for n in LENGTHS)  # the loader's statistics on the step
    assert any(mb.layout.ring is not None for mb in got.micro_batches), "the 30-token sequence is a ring item"


def test_data_module_plans_pp_balance_for_the_pipelines_of_the_strategy_mesh(tmp_path):
    """Under pipeline_parallel_size=2 on 4 ranks, global rank 3 is stage 1 of pipeline 1 of 2 (rings with 2 and 3)."""
    from types import SimpleNamespace

    from lightning_bytescale import ByteScaleDataModule, ByteScaleStrategy
    from lightning_bytescale.parallel import ParallelDims

    dims = ParallelDims(4, pipeline=2)
    ring_ranks = tuple(dims.global_rank(h, 0, 1) for h in range(2))
    pmesh = SimpleNamespace(dims=dims, hdp_rank=dims.hdp_rank(3), lane=0, stage=1, ring_ranks=ring_ranks)
    strategy = ByteScaleStrategy(pipeline_parallel_size=2, capacity=96)
    strategy.parallel_mesh = pmesh
    dm = ByteScaleDataModule(SYNTHETIC, cache_dir=tmp_path / "cache", tokens_per_step=512, num_workers=0)
    dm.prepare_data()
    trainer = {"global_rank": 3, "world_size": 4, "strategy": strategy, "overfit_batches": 0}
    dm.trainer = SimpleNamespace(**trainer)
    assert (dm.rank, dm.world_size) == (1, 2)  # HDP rank 1 of 2 pipelines
    assert dm.planner_options()["pipeline_degree"] == 2  # PP-Balance, from the strategy's planner config
    dm.setup("fit")
    dataset = dm.train_dataloader().dataset
    assert (dataset.rank, dataset.world_size, dataset.ring_ranks, dataset.pipeline_stages) == (
        1,
        2,
        (2, 3),
        2,
    )
    batch = next(iter(dm.train_dataloader()))
    assert isinstance(batch, PipelineStepBatch) and batch.stages == 2
    assert all(mb.num_slots == 96 for mb in batch.micro_batches)  # padded to C for static stage shapes
    plan = dataset.plan(0, 0)
    assert plan.options.get("pipeline_degree") == 2
    for mb in batch.micro_batches:
        assert mb.layout.ring is None or set(mb.layout.ring) <= {2, 3}


def test_data_warnings_come_from_global_rank_zero_only_on_a_mesh():
    """HDP rank 0 is several processes with pipeline stages or TP lanes: only global rank 0 logs."""
    from types import SimpleNamespace

    from lightning_bytescale.lightning.datamodule import ByteScaleDataModule
    from lightning_bytescale.parallel.layout import LoaderView

    def on(global_rank: int) -> bool:
        dm = ByteScaleDataModule(source="unused", capacity=64)
        # global ranks 0 and 1 are the two stages of HDP rank 0 (the strategy's loader view says so)
        view = LoaderView(hdp_rank=0, hdp_ranks=2, ring_ranks=None, pipeline_stages=2, tensor_parallel=1)
        dm.trainer = SimpleNamespace(
            global_rank=global_rank, world_size=4, strategy=SimpleNamespace(loader_view=view)
        )
        assert dm.rank == 0
        return dm._reports_data_warnings

    assert on(0) and not on(1)
