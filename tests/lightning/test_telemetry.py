"""TelemetryCallback and its pure helpers, against a fake trainer and strategy (no processes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _strategy_helpers import in_this_process

from lightning_bytescale.lightning.telemetry import (
    CPU_PEAK_TFLOPS,
    PLAN_COLUMNS,
    TelemetryCallback,
    cp_degrees_of,
    merge_plan_stats,
    plan_rows,
    rank_rows,
    replan,
    step_metrics,
)
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan


def _stats(**extra):
    stats = {
        "loss": 2.5,
        "tokens": 6000,
        "loss_tokens": 5997,
        "step_time_s": 2.0,
        "busy_s": [1.0, 1.5, 0.5],
        "planned_s": [0.9, 1.2, 0.6],
        "num_micro_batches": [2, 3, 1],
        "max_over_mean_planned": 1.2,
        "max_over_mean_measured": 1.5,
        "bubble_fraction": 1 / 3,
        "ring_bytes": 4096.0,
        "ring_wait_s": [0.5, 0.25, 0.0],
        "exposed_ring_planned_s": 0.25,
        "plan_ms": 3.5,
        "lengths": [4000, 1000, 1000],
        "cp_degrees": [2, 1, 1],
    }
    stats.update(extra)
    return stats


def test_step_metrics_values():
    m = step_metrics(_stats(), flops=6e12, peak_tflops=0.5, world_size=3)
    assert m["train/loss"] == 2.5
    assert m["perf/tokens_per_s"] == pytest.approx(3000.0)
    # 6e12 FLOPs in 2 s over 3 devices = 1 TFLOP/s per device; MFU against 0.5 -> 2.0
    assert m["perf/tflops_per_device"] == pytest.approx(1.0)
    assert m["perf/mfu"] == pytest.approx(2.0)
    assert m["balance/max_over_mean_measured"] == 1.5
    assert m["balance/bubble_fraction"] == pytest.approx(1 / 3)
    assert m["comm/ring_bytes"] == 4096.0
    assert m["comm/exposed_ring_planned_s"] == 0.25 and m["comm/ring_wait_s"] == pytest.approx(0.75)
    assert [m[f"ranks/ring_wait_s/{r}"] for r in range(3)] == [0.5, 0.25, 0.0]
    assert m["plan/plan_ms"] == 3.5
    assert [m[f"ranks/busy_s/{r}"] for r in range(3)] == [1.0, 1.5, 0.5]
    assert [m[f"ranks/micro_batches/{r}"] for r in range(3)] == [2, 3, 1]
    assert m["ranks/planned_s_max"] == 1.2 and m["ranks/busy_s_min"] == 0.5
    assert m["comm/cp_degree_max"] == 2 and m["comm/sharded_sequences"] == 1
    assert m["data/seq_len_max"] == 4000 and m["data/num_sequences"] == 3


def test_step_metrics_limits_and_missing_values():
    m = step_metrics(_stats(plan_ms=float("nan")), per_rank_limit=2)
    assert not any(k.startswith("ranks/busy_s/") for k in m)  # 3 ranks > limit: only min/mean/max
    assert m["ranks/busy_s_mean"] == pytest.approx(1.0)
    assert "plan/plan_ms" not in m  # non-finite values are dropped, not logged as NaN
    assert "perf/mfu" not in m  # no FLOPs given
    assert step_metrics({}) == {}


def _plan():
    return Plan(
        world_size=2,
        capacity=8,
        planner="balance",
        lengths=(10, 3),
        ranks=[
            [MicroBatch([Piece(0, ((0, 3), (8, 10)))], ring=(0, 1), item=0, est_time=1.0)],
            [
                MicroBatch([Piece(0, ((3, 8),))], ring=(0, 1), item=0, est_time=1.0),
                MicroBatch([Piece(1, ((0, 3),))]),
            ],
        ],
    )


def test_rank_and_plan_rows():
    assert rank_rows(_stats()) == [[0, 0.9, 1.0, 2.0], [1, 1.2, 1.5, 3.0], [2, 0.6, 0.5, 1.0]]
    rows = plan_rows(_plan())
    assert len(rows[0]) == len(PLAN_COLUMNS)
    assert rows == [
        [0, 0, "0,1", "0", 5, 0.0, 1.0],
        [1, 0, "0,1", "0", 5, 0.0, 1.0],
        [1, 1, "-", "1", 3, 0.0, 0.0],
    ]


class _Module:
    """Records ``log`` calls like a LightningModule would receive them."""

    device = torch.device("cpu")

    def __init__(self, flops_per_token=None):
        self.logged = {}
        self.prog_bar = set()
        if flops_per_token is not None:
            self.flops_per_token = flops_per_token

    def log(self, name, value, *, prog_bar=False, **kwargs):
        assert kwargs["on_step"] and not kwargs["on_epoch"] and kwargs["batch_size"] == 1
        self.logged[name] = value
        if prog_bar:
            self.prog_bar.add(name)


def _trainer(stats, *, log_loss=False, step=1):
    strategy = SimpleNamespace(step_stats=stats, loop_options=SimpleNamespace(log_loss=log_loss))
    return SimpleNamespace(strategy=strategy, world_size=3, global_step=step, is_global_zero=True, loggers=[])


def test_callback_logs_every_step_and_shows_tokens_per_s():
    cb = TelemetryCallback(peak_tflops=None)
    module = _Module(flops_per_token=1e9)
    cb.on_train_batch_end(_trainer(_stats()), module, None, None, 0)
    assert module.logged["perf/tokens_per_s"] == pytest.approx(3000.0)
    expected_mfu = 6000 * 1e9 / 2.0 / 3 / 1e12 / CPU_PEAK_TFLOPS  # nominal CPU peak when unset
    assert module.logged["perf/mfu"] == pytest.approx(expected_mfu)
    assert {"perf/tokens_per_s", "train/loss"} <= module.prog_bar
    for key in (
        "balance/max_over_mean_planned",
        "balance/bubble_fraction",
        "comm/ring_bytes",
        "plan/plan_ms",
    ):
        assert key in module.logged


def test_callback_leaves_loss_to_a_strategy_that_logs_it():
    module = _Module()
    TelemetryCallback().on_train_batch_end(_trainer(_stats(), log_loss=True), module, None, None, 0)
    assert "train/loss" not in module.logged and "perf/tokens_per_s" in module.logged


def test_callback_prefers_train_flops_from_the_module():
    module = _Module()
    module.train_flops = lambda lengths: 2.0 * sum(lengths)
    cb = TelemetryCallback(peak_tflops=1.0)
    cb.on_train_batch_end(_trainer(_stats()), module, None, None, 0)
    assert module.logged["perf/tflops_per_device"] == pytest.approx(2.0 * 6000 / 2.0 / 3 / 1e12)


def test_callback_without_step_stats_warns_once():
    cb = TelemetryCallback()
    module = _Module()
    with pytest.warns(UserWarning, match="step_stats"):
        cb.on_train_batch_end(_trainer({}), module, None, None, 0)
    cb.on_train_batch_end(_trainer({}), module, None, None, 1)  # no second warning, no crash
    assert module.logged == {}


def test_callback_rejects_bad_options():
    with pytest.raises(ValueError, match="peak_tflops"):
        TelemetryCallback(peak_tflops=0)
    with pytest.raises(ValueError, match="charts_every_n_steps"):
        TelemetryCallback(charts_every_n_steps=-1)


def test_tensorboard_charts(tmp_path):
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(save_dir=str(tmp_path), name="tb")
    trainer = _trainer(_stats(), step=1)
    trainer.loggers = [logger]
    TelemetryCallback(charts_every_n_steps=5).on_train_batch_end(trainer, _Module(), None, None, 0)
    logger.experiment.flush()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logger.log_dir), size_guidance={"histograms": 0, "tensors": 0})
    events.Reload()
    assert {"charts/seq_len", "charts/cp_degree"} <= set(events.Tags()["histograms"])
    assert any(tag.startswith("charts/rank_load") for tag in events.Tags()["tensors"])


def test_plan_stats_fill_the_gaps_of_step_stats():
    step = _stats(
        planned_s=[], max_over_mean_planned=float("nan"), plan_ms=float("nan"), lengths=[], cp_degrees=[]
    )
    plan = {
        "rank_time": [1.0, 3.0],
        "max_over_mean": 1.5,
        "cp_degree_histogram": {"2": 1, "1": 3},
        "num_sequences": 4,
    }
    merged = merge_plan_stats(step, plan)
    assert merged["planned_s"] == [1.0, 3.0] and merged["max_over_mean_planned"] == 1.5
    assert merged["cp_degrees"] == [1, 1, 1, 2] and merged["num_sequences"] == 4
    assert merge_plan_stats(_stats(), plan)["planned_s"] == [0.9, 1.2, 0.6]  # own values win
    module = _Module()
    module.train_flops = lambda lengths: float(len(lengths) * 1000 + sum(lengths))
    cb = TelemetryCallback(peak_tflops=1.0)
    cb.on_train_batch_end(_trainer(step), module, None, SimpleNamespace(stats=plan), 0)
    # 6000 tokens over 4 sequences without lengths: 4 sequences of 1500 assumed
    assert module.logged["perf/tflops_per_device"] == pytest.approx((4 * 1000 + 6000) / 2.0 / 3 / 1e12)
    assert module.logged["balance/max_over_mean_planned"] == 1.5


def test_a_plan_in_the_batch_stats_gives_lengths_and_cp_degrees():
    plan = _plan()
    assert cp_degrees_of(plan) == [2, 1]
    for given in (plan, plan.to_json_dict()):
        merged = merge_plan_stats({"tokens": 13}, {"plan": given})
        assert merged["lengths"] == [10, 3] and merged["cp_degrees"] == [2, 1]


def test_replan_returns_the_plan_only_when_the_digest_matches():
    from lightning_bytescale.engine.micro_batch import plan_digest

    plan = _plan()
    dataset = SimpleNamespace(plan=lambda epoch, step: plan)
    trainer = SimpleNamespace(train_dataloader=SimpleNamespace(dataset=dataset), current_epoch=0)
    good = SimpleNamespace(digest=plan_digest(plan), step=3, stats={"epoch": 0})
    assert replan(trainer, good) is plan
    assert replan(trainer, SimpleNamespace(digest="other", step=3, stats={})) is None
    assert replan(SimpleNamespace(train_dataloader=None, current_epoch=0), good) is None


def test_step_stats_count_sequences_from_the_plan_on_masked_data(tmp_path):
    """Loss-masked data (chat): the step telemetry counts the plan's sequences, not tokens minus loss tokens.

    One process under ``ByteScaleStrategy`` (no launcher), 3 sequences each with half of its
    tokens masked out of the loss; ``TelemetryCallback`` logs what ``strategy.step_stats`` holds.
    """
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_bytescale import ByteScaleStrategy
    from lightning_bytescale.engine.micro_batch import build_step
    from lightning_bytescale.models import LlamaConfig, LlamaModel
    from lightning_bytescale.planner import make_plan

    lengths = [12, 20, 30]
    seqs = [torch.arange(n) % 50 for n in lengths]
    masks = [torch.arange(n) >= n // 2 for n in lengths]  # the second half of each sequence is trained
    plan = make_plan(lengths, world_size=1, capacity=32, planner="balance")

    class Steps(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, k):
            return build_step(plan, 0, lambda j: seqs[j], step=k, loss_mask=lambda j: masks[j].numpy())

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = LlamaModel(LlamaConfig.preset("tiny"))
            self.stats = []

        def training_step(self, mb, batch_idx):
            return mb.loss(self.model(mb.input_ids, mb.position_ids))

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.stats.append(dict(self.trainer.strategy.step_stats))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    telemetry = TelemetryCallback(charts_every_n_steps=0)
    module = LM()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=ByteScaleStrategy(capacity=32, timeout=30), max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[telemetry], default_root_dir=tmp_path,
    )  # fmt: skip
    with in_this_process():
        trainer.fit(module, train_dataloaders=DataLoader(Steps(), batch_size=None))
    assert telemetry.last_metrics["data/num_sequences"] == len(lengths)
    assert telemetry.last_metrics["data/seq_len_mean"] == pytest.approx(sum(lengths) / len(lengths))
    for stats in module.stats:
        assert stats["num_sequences"] == 3 and stats["lengths"] == lengths
        assert stats["cp_degrees"] == [1, 1, 1] and stats["loss_tokens"] < stats["tokens"] - 3


def test_pipeline_metrics_one_key_per_pipeline_and_stage_up_to_the_limit():
    from lightning_bytescale.lightning.telemetry import pipeline_metrics

    stats = {
        "pipeline_micro_batches": [3, 5],
        "pipeline_bubble": [0.25, 0.5],
        "pipeline_bubble_sim": [0.2, 0.4],
        "pipeline_stage_bubble": [[0.1, 0.4], [0.3, 0.7]],
    }
    got = step_metrics(stats)
    assert got["pipeline/micro_batches/1"] == 5.0 and got["pipeline/micro_batches_max"] == 5.0
    assert got["pipeline/bubble/0"] == 0.25 and got["pipeline/bubble_sim/0"] == 0.2
    assert got["pipeline/bubble_mean"] == pytest.approx(0.375)
    assert got["pipeline/stage_bubble/1/1"] == 0.7
    few = pipeline_metrics(stats, per_rank_limit=1)  # two pipelines above the limit: only mean and max
    assert "pipeline/bubble/0" not in few and "pipeline/stage_bubble/0/0" not in few
    assert few["pipeline/bubble_max"] == 0.5
    assert not pipeline_metrics({"busy_s": [1.0]}), "no pipeline figures without pipelines"


def test_stage_bubble_is_the_share_of_the_schedule_not_computing():
    from lightning_bytescale.parallel import stage_bubble

    assert stage_bubble(3.0, 4.0) == 0.25
    assert stage_bubble(0.0, 0.0) == 0.0  # a pipeline without micro-batches


def test_mode_counts_and_bytes_per_mode_come_from_the_plan_the_same_on_every_rank():
    """``comm/mode_counts/<mode>`` and ``comm/mode_bytes_planned/<mode>`` of a step whose plan (balance,
    a cost model with heads) runs ring, Ulysses and hybrid items: ``Plan.mode_stats()``, on every rank."""
    from _mode_plans import MIXED_LENGTHS, mixed_mode_plan

    from lightning_bytescale.engine.micro_batch import build_step
    from lightning_bytescale.lightning.step_stats import step_stats

    plan = mixed_mode_plan()
    want = plan.mode_stats()
    assert all(
        want["mode_counts"][m] > 0 and want["comm_bytes"][m] > 0 for m in ("ring", "ulysses", "hybrid")
    )
    tokens = [torch.arange(s) % 64 for s in MIXED_LENGTHS]
    report = SimpleNamespace(busy_s=1.0, num_micro_batches=1, ring_bytes=0.0, ring_wait_s=0.0)
    result = SimpleNamespace(reports=[report] * 4, loss=1.0, allreduce_s=0.0)
    for rank in range(4):
        batch = build_step(plan, rank, lambda j: tokens[j])
        metrics = step_metrics(
            step_stats(batch, result)
        )  # what ByteScaleStrategy leaves and the callback logs
        for mode in ("ring", "ulysses", "hybrid"):
            assert metrics[f"comm/mode_counts/{mode}"] == want["mode_counts"][mode], (rank, mode)
            assert metrics[f"comm/mode_bytes_planned/{mode}"] == want["comm_bytes"][mode], (rank, mode)
    ring_only = step_metrics(merge_plan_stats({}, _plan().stats()))
    assert ring_only["comm/mode_counts/ring"] == 1 and ring_only["comm/mode_counts/ulysses"] == 0
