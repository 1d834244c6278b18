"""ByteScaleStrategy under a real Trainer on CPU (gloo, fork launcher).

The model, data, reference and ``fit`` are in ``tests/_strategy_helpers.py``.

Exactness: parameters and logged losses after several steps equal an independent
single-process float64 loop over the same global batches (whole sequences, plain causal
SDPA, no plan, no strategy), for every planner, with ZeRO-1, across a mid-epoch resume, and
across a resume on a smaller world.
"""

from __future__ import annotations

import json
import os

import _strategy_helpers
import lightning.pytorch as pl
import pytest
import torch
from _strategy_helpers import (
    CAPACITY,
    StepDataModule,
    TinyLM,
    assert_params_equal,
    fit,
    global_batch,
    make_plan,
    read_rows,
    reference,
)

import lightning_bytescale
from lightning_bytescale import ByteScaleStrategy

pytestmark = pytest.mark.multiprocess


class PoisonedLM(TinyLM):
    """Produces a non-finite loss or gradient for global-batch sequence ``POISON_SEQ`` of step 1."""

    kind = "loss"

    def training_step(self, mb, batch_idx):
        loss = super().training_step(mb, batch_idx)
        if batch_idx == 1 and POISON_SEQ in mb.seq_ids:
            if self.kind == "loss":
                return loss * float("nan")
            loss.register_hook(lambda g: g * float("inf"))
        return loss


POISON_SEQ = 1


# ----------------------------------------------------------------------------- tests
def test_registered_names():
    from lightning.pytorch.strategies import StrategyRegistry

    for name, start in (("bytescale", "popen"), ("bytescale_spawn", "spawn"), ("bytescale_fork", "fork")):
        assert StrategyRegistry[name]["strategy"] is ByteScaleStrategy
        assert StrategyRegistry[name]["init_params"] == {"start_method": start}
    trainer = pl.Trainer(strategy="bytescale_fork", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ByteScaleStrategy)
    assert lightning_bytescale.ByteScaleStrategy is ByteScaleStrategy


def test_options_validated():
    with pytest.raises(ValueError, match="planner must be one of"):
        ByteScaleStrategy(planner="fast")
    with pytest.raises(ValueError, match="capacity"):
        ByteScaleStrategy(capacity=0)
    with pytest.raises(ValueError, match="DistributedDataParallel options"):
        ByteScaleStrategy(find_unused_parameters=True)
    with pytest.raises(ValueError, match="ranks_per_node must be a positive integer"):
        ByteScaleStrategy(ranks_per_node=0)
    with pytest.raises(ValueError, match="comm_aware must be True or False"):
        ByteScaleStrategy(comm_aware="no")
    with pytest.raises(ValueError, match=r"cost_model file .*missing.json' does not exist; write one with"):
        ByteScaleStrategy(cost_model="missing.json")
    s = ByteScaleStrategy(planner="static", capacity=128, cp_size=2, timeout=5, seed=3)
    assert s.planner_options() == {
        "planner": "static",
        "capacity": 128,
        "cp_size": 2,
        "offload": False,
        "slack": 0.05,
        "cost_model": None,
        "comm_aware": True,
        "ranks_per_node": None,
        "seed": 3,
        "num_buckets": 8,
        "pipeline_degree": 1,
        "max_micro_batches": None,
    }
    assert s.planner_options() == s.planner_config.as_options()
    assert s._timeout.total_seconds() == 5


def test_max_micro_batches_reaches_the_planner_and_the_pipeline_stages():
    from types import SimpleNamespace

    from lightning_bytescale.lightning.strategy import stage_schedules

    config = ByteScaleStrategy(pipeline_parallel_size=2, max_micro_batches=4).planner_config
    assert (config.max_micro_batches, config.pipeline_degree) == (4, 2)
    with pytest.raises(
        ValueError,
        match=r"max_micro_batches=4 bounds the micro-batches of a pipeline.*pipeline_parallel_size",
    ):
        ByteScaleStrategy(max_micro_batches=4)  # no pipelines: a setting that would do nothing
    strategy = SimpleNamespace(_stage_schedules=None, parallel_mesh=object(), planner_config=config)
    stage = object()
    schedules = stage_schedules(strategy, stage)
    assert schedules.max_micro_batches == 4 and stage_schedules(strategy, stage) is schedules  # one per run
    assert stage_schedules(strategy, object()) is not schedules  # another stage module: another cache


def test_comm_aware_and_cost_model_file_reach_make_plan(tmp_path):
    """The strategy's comm_aware / ranks_per_node / cost-model file travel through the DataModule's
    planner options into make_plan; every rank computes the same plan (same digest) from them."""
    from types import SimpleNamespace

    from lightning_bytescale import ByteScaleDataModule
    from lightning_bytescale.data.loader import _make_plan
    from lightning_bytescale.planner.cost_model import CostModel

    cost = CostModel.paper_preset().with_(name="from-file")
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"format": "bytescale-profile/1", "cost_model": cost.to_json_dict()}))
    lengths = (700, 40, 30, 300, 12, 90)
    digests = {}
    for aware in (True, False):
        strategy = ByteScaleStrategy(capacity=128, cost_model=str(path), comm_aware=aware, ranks_per_node=2)
        assert strategy.cost_model == cost
        dm = ByteScaleDataModule(num_workers=0)
        dm.trainer = SimpleNamespace(global_rank=0, world_size=8, strategy=strategy)
        opts = dm.planner_options()
        assert opts["comm_aware"] is aware and opts["ranks_per_node"] == 2 and opts["cost_model"] == cost
        plan = _make_plan(lengths, 8, 5, opts)
        assert plan.options["comm_aware"] is aware and plan.options["ranks_per_node"] == 2
        assert plan.options["cost_model"]["name"] == "from-file"
        again = _make_plan(lengths, 8, 5, dict(opts))  # another rank: the same plan
        assert again.digest() == plan.digest()
        assert plan.stats()["exposed_ring_time"] >= 0.0
        digests[aware] = plan.digest()
    assert digests[True] != digests[False]
    own = ByteScaleDataModule(cost_model=path, comm_aware=False, ranks_per_node=4, num_workers=0)
    assert own.planner_options()["comm_aware"] is False and own.planner_options()["cost_model"] == cost


@pytest.mark.parametrize(
    ("planner", "world", "zero1", "offload", "gradient_sync"),
    [
        ("balance", 3, False, False, "bucketed"),
        ("naive", 2, False, False, "bucketed"),
        ("static", 4, False, False, "bucketed"),
        ("balance", 4, True, False, "bucketed"),
        ("balance", 2, False, True, "bucketed"),
        ("balance", 3, False, False, "flat"),
    ],
)
def test_equals_single_process(tmp_path, planner, world, zero1, offload, gradient_sync):
    # small buckets (about 16 KB of float64), so a step has many and the last backward launches some
    fit(
        tmp_path,
        world,
        planner,
        zero1=zero1,
        offload=offload,
        offload_ratio=0.5 if offload else 0.0,
        gradient_sync=gradient_sync,
        bucket_cap_mb=1 / 64,
    )
    expected, losses = reference(5)
    assert_params_equal(tmp_path, world, expected)
    for r in range(world):
        rows = read_rows(tmp_path, r)
        assert [row["step"] for row in rows] == list(range(5))
        for row, want in zip(rows, losses):
            assert abs(row["logged"] - want) <= 1e-12, (row["logged"], want)
            assert abs(row["output"] - want) <= 1e-12
    if offload:  # activations really went through the offloader (bit-identical gradients above)
        assert all(row["offloaded_bytes"] > 0 for r in range(world) for row in read_rows(tmp_path, r))
    stats = read_rows(tmp_path)[-1]["stats"]
    seqs = global_batch(4)
    assert stats["lengths"] == [len(s) for s in seqs]
    assert stats["cp_degrees"][-1] >= 2 and all(1 <= d <= world for d in stats["cp_degrees"])
    if planner == "static":  # every packed sequence is sharded over the whole CP group
        assert set(stats["cp_degrees"]) == {world}
    assert stats["tokens"] == sum(len(s) for s in seqs)
    assert stats["loss_tokens"] == sum(len(s) - 1 for s in seqs)
    assert len(stats["busy_s"]) == world and all(b > 0 for b in stats["busy_s"] if b)
    assert sum(stats["num_micro_batches"]) >= 1 and len(stats["num_micro_batches"]) == world
    assert stats["ring_bytes"] > 0  # the long sequence always runs on a ring
    # measured ring wait: one slot per rank, positive exactly where that rank exchanged ring data
    assert len(stats["ring_wait_s"]) == world
    for sent, wait in zip(stats["ring_bytes_per_rank"], stats["ring_wait_s"]):
        assert (wait > 0) if sent > 0 else (wait == 0)
    # planned exposed ring time: the plan's own figure (recomputed here from the same plan)
    plan = make_plan([len(s) for s in seqs], world, planner, 0)
    assert stats["exposed_ring_planned_s"] == pytest.approx(plan.stats()["exposed_ring_time"], rel=1e-12)
    assert stats["max_over_mean_measured"] >= 1.0 and 0.0 <= stats["bubble_fraction"] < 1.0
    assert stats["step_time_s"] > 0


def test_resume_mid_epoch_same_and_smaller_world(tmp_path):
    expected, losses = reference(6)
    # 2 ranks, stop after 3 of 8 steps, resume on 2 ranks.
    fit(tmp_path / "a", 2, max_steps=3, ckpt_every=3)
    ckpt = next((tmp_path / "a" / "ckpt").glob("*.ckpt"))
    fit(tmp_path / "b", 2, max_steps=6, resume=ckpt)
    assert [row["step"] for row in read_rows(tmp_path / "b")] == [3, 4, 5]
    assert_params_equal(tmp_path / "b", 2, expected)
    # 4 ranks with ZeRO-1, stop after 3, resume on 2 ranks (optimizer state re-partitioned).
    fit(tmp_path / "c", 4, max_steps=3, ckpt_every=3, zero1=True)
    ckpt = next((tmp_path / "c" / "ckpt").glob("*.ckpt"))
    fit(tmp_path / "d", 2, max_steps=6, resume=ckpt, zero1=True)
    rows = read_rows(tmp_path / "d", 1)
    assert [row["step"] for row in rows] == [3, 4, 5]
    assert [row["logged"] for row in rows] == pytest.approx(losses[3:], abs=1e-12)
    assert_params_equal(tmp_path / "d", 2, expected)


def test_divergent_plans_name_the_ranks(tmp_path):
    with pytest.raises(Exception, match=r"ranks \[2\] differ from ranks \[0, 1\]"):
        fit(tmp_path, 3, diverge_rank=2, max_steps=2)


def test_plan_for_another_world_size_rejected(tmp_path):
    os.environ.pop("MASTER_PORT", None)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ByteScaleStrategy(capacity=CAPACITY, start_method="fork", timeout=30),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        max_steps=1,
    )
    with pytest.raises(Exception, match=r"hold plans made for \[3\] ranks, but the run has 2"):
        trainer.fit(TinyLM(), datamodule=StepDataModule("balance", plan_world=3))


class ManualLM(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.parametrize(
    ("accumulate", "module", "message"),
    [(2, TinyLM, "accumulate_grad_batches=2"), (1, ManualLM, "needs automatic optimization")],
)
def test_unsupported_trainer_settings_rejected(tmp_path, accumulate, module, message):
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ByteScaleStrategy(start_method="fork"),
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    os.environ.pop("MASTER_PORT", None)
    with pytest.raises(Exception, match=message):
        trainer.fit(module(), datamodule=StepDataModule("balance"))


@pytest.mark.parametrize("kind", ["loss", "gradient"])
def test_non_finite_names_micro_batch_and_sequences(tmp_path, kind):
    module = PoisonedLM()
    module.kind = kind
    what = (  # gradients are checked once a step: exact when the rank had one micro-batch
        r"non-finite loss in micro-batch \d+"
        if kind == "loss"
        else r"gradients (first non-finite after micro-batch \d+|non-finite after micro-batches \d+\.\.\d+)"
    )
    pattern = rf"Non-finite values at step 1.*rank \d: {what} \(sequences \[[\d, ]*\b{POISON_SEQ}\b"
    with pytest.raises(Exception, match=pattern):
        fit(tmp_path, 2, module=module, max_steps=3)


def test_ranks_without_micro_batches(tmp_path, monkeypatch):
    """Global batches of one or two short sequences: most ranks have no work and still join
    the one all-reduce; parameters still equal the single-process run."""

    def tiny_batch(step: int, seed: int = 0) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(500 + step)
        return [
            torch.randint(0, 64, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g)
            for _ in range(1 + step % 2)
        ]

    monkeypatch.setattr(_strategy_helpers, "global_batch", tiny_batch)  # where fit and reference read it
    fit(tmp_path, 4, "balance", max_steps=4)
    expected, losses = reference(4)
    assert_params_equal(tmp_path, 4, expected)
    rows = read_rows(tmp_path)
    assert [row["logged"] for row in rows] == pytest.approx(losses, abs=1e-12)
    assert all(sorted(row["stats"]["num_micro_batches"])[0] == 0 for row in rows)


def test_rank_report_round_trip_and_messages():
    from lightning_bytescale.engine.step_checks import (
        SLOT,
        RankReport,
        describe_divergence,
        describe_non_finite,
        digest_key,
    )

    rep = RankReport(
        busy_s=0.25,
        ring_bytes=4096,
        num_micro_batches=3,
        bad_micro_batch=2,
        bad_kind=2,
        bad_seq_ids=(0, 7),
        ring_wait_s=0.125,
    )
    slot = rep.encode()
    assert len(slot) == SLOT
    assert RankReport.decode(slot) == rep
    assert RankReport.decode(RankReport(num_micro_batches=1).encode()).bad_micro_batch is None
    msg = describe_non_finite([RankReport(), rep], step=5)
    assert (
        "step 5" in msg
        and "rank 1: gradients first non-finite after micro-batch 2" in msg
        and "[0, 7]" in msg
    )
    spanned = RankReport(num_micro_batches=3, bad_micro_batch=2, bad_kind=2, bad_seq_ids=(3,), bad_from=0)
    assert RankReport.decode(spanned.encode()) == spanned
    assert "rank 0: gradients non-finite after micro-batches 0..2" in describe_non_finite([spanned], step=1)
    assert "rank 0" not in msg
    a, b = digest_key("abc"), digest_key("abd")
    assert a != b and 0 <= a < 2**60
    msg = describe_divergence([(a, 3), (a, 3), (b, 3), (a, 3)])
    assert "ranks [2] differ from ranks [0, 1, 3]" in msg and "same seed" in msg
