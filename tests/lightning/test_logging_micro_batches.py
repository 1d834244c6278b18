"""What ``self.log`` inside ``training_step`` records when the strategy calls it once per micro-batch.

``ByteScaleStrategy`` calls the user's ``training_step`` once per micro-batch, and one
Lightning batch is one optimizer step, so ``self.log`` runs several times inside one Lightning
batch.  Lightning 2.6 (``trainer/connectors/logger_connector/result.py``) then keeps, for
``on_step=True``, the value of the *last* call of the batch, whatever ``reduce_fx`` says;
``on_epoch=True`` reduces *every* call of the epoch with ``reduce_fx`` (a mean weights each call
by its ``batch_size``, inferred once per Lightning batch unless given).

These tests pin that behaviour on one CPU process against micro-batch values computed from the
data itself, and on two ranks (fork launcher, unequal micro-batch counts) the documented ways to
log a per-step sum: add up in the module and log in ``on_train_batch_end``, reduced over the
ranks with ``trainer.strategy.reduce``, or read ``trainer.strategy.step_stats``.  They also
check that ``self.log(..., sync_dist=True)`` reduces over the ranks at the call in
``on_train_batch_end`` and, inside ``training_step`` (where ranks run different numbers of
micro-batches), with ``on_epoch=True`` once at the end of the epoch (on step it is refused:
``tests/lightning/test_conformance.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _strategy_helpers import in_this_process
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.data import extract_batch_size
from torch.utils.data import DataLoader, Dataset

from lightning_bytescale import ByteScaleStrategy, token_loss
from lightning_bytescale.engine import StepBatch, build_step
from lightning_bytescale.engine.loss import IGNORE_INDEX
from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.planner import make_plan

CAPACITY = 32
STEPS = 4
WORLD = 2


def step_sequences(step: int, world: int) -> list[torch.Tensor]:
    """Global batch ``step``: 5-8 short sequences (plus, on several ranks, one for a ring of 2)."""
    g = torch.Generator().manual_seed(100 + step)
    n = int(torch.randint(5, 9, (1,), generator=g))
    lengths = torch.randint(4, CAPACITY, (n,), generator=g).tolist()
    if world > 1:
        lengths.append(int(torch.randint(CAPACITY + 1, 2 * CAPACITY, (1,), generator=g)))
    return [torch.randint(0, 64, (s,), generator=g) for s in lengths]


def step_batch(step: int, world: int, rank: int) -> StepBatch:
    seqs = step_sequences(step, world)
    plan = make_plan([len(s) for s in seqs], world_size=world, capacity=CAPACITY, planner="balance")
    return build_step(plan, rank, lambda j: seqs[j], step=step)


def loss_tokens(mb: Any) -> float:
    return float((mb.labels != IGNORE_INDEX).sum())


def micro_batch_values(world: int, rank: int) -> list[list[float]]:
    """The loss-token count of every micro-batch of every step on ``rank``, from the data (not the module)."""
    return [[loss_tokens(mb) for mb in step_batch(k, world, rank).micro_batches] for k in range(STEPS)]


class Steps(Dataset):
    def __init__(self, world: int, rank: int) -> None:
        self.world, self.rank = world, rank

    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, k: int) -> StepBatch:
        return step_batch(k, self.world, self.rank)


class StepsModule(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(Steps(self.trainer.world_size, self.trainer.global_rank), batch_size=None)


class MemoryLogger(Logger):
    """Every ``log_metrics`` call, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append(dict(metrics))


PER_STEP_KEYS = ("step_sum", "step_sum_global", "step_sum_sync_dist", "stats_loss_tokens")


class PerMicroBatchLogging(pl.LightningModule):
    """Logs each micro-batch's loss-token count in every way a user might, and the per-step sums."""

    def __init__(self, out: Path | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaModel(LlamaConfig.preset("tiny"))
        self.out = out
        self.step_sum = 0.0
        self.records: list[dict[str, float]] = []

    def training_step(self, mb, batch_idx):
        n = torch.tensor(loss_tokens(mb), dtype=torch.float64)
        self.log("last", n, on_step=True, on_epoch=False, reduce_fx="sum")
        self.log("both", n, on_step=True, on_epoch=True, reduce_fx="sum")
        self.log("mean_inferred", n, on_step=False, on_epoch=True)
        self.log("mean_weighted", n, on_step=False, on_epoch=True, batch_size=int(n))
        self.log("largest", n, on_step=False, on_epoch=True, reduce_fx="max")
        # ranks run different numbers of micro-batches: a collective per call here would pair with
        # another rank's next collective, but the epoch's value is reduced once, when every rank is there
        self.log("epoch_sync_dist", n, on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True)
        if torch.is_grad_enabled():  # the strategy's loss probe runs a second forward without gradients
            self.step_sum += float(n)
        return token_loss(self.model(mb.input_ids, mb.position_ids), mb.labels, mb.num_global_tokens)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # once per step on every rank, even on a rank without micro-batches: a collective here is safe
        local = torch.tensor(self.step_sum, dtype=torch.float64)
        self.log("step_sum", local, on_step=True, on_epoch=False)
        self.log(
            "step_sum_global", self.trainer.strategy.reduce(local.clone(), reduce_op="sum"), on_step=True
        )
        self.log("step_sum_sync_dist", local, on_step=True, on_epoch=False, sync_dist=True, reduce_fx="sum")
        self.log("stats_loss_tokens", float(self.trainer.strategy.step_stats["loss_tokens"]), on_step=True)
        self.records.append({k: float(self.trainer.callback_metrics[k]) for k in PER_STEP_KEYS})
        self.step_sum = 0.0

    def on_train_end(self):
        self.records.append({"epoch_sync_dist": float(self.trainer.callback_metrics["epoch_sync_dist"])})
        if self.out is not None:
            (self.out / f"records_{self.global_rank}.json").write_text(json.dumps(self.records))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def trainer_for(devices: int, start_method: str, logger: Logger | bool) -> pl.Trainer:
    strategy = ByteScaleStrategy(capacity=CAPACITY, timeout=30, start_method=start_method)
    return pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=logger,
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
    )  # fmt: skip


@pytest.fixture(scope="module")
def logged() -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """(per-step rows, epoch rows) of one epoch of STEPS steps on one CPU process."""
    logger = MemoryLogger()
    trainer = trainer_for(1, "popen", logger)  # one device: no launcher runs
    with in_this_process():
        trainer.fit(PerMicroBatchLogging(), datamodule=StepsModule())
    steps = [row for row in logger.rows if "last" in row]
    epochs = [row for row in logger.rows if "both_epoch" in row]
    return steps, epochs


def test_on_step_keeps_the_last_micro_batch_whatever_reduce_fx(logged):
    steps, _ = logged
    values = micro_batch_values(1, 0)
    assert all(len(v) >= 2 for v in values), "the data must give several micro-batches a step"
    assert len(steps) == STEPS
    for row, step_values in zip(steps, values):
        assert row["last"] == step_values[-1]
        assert row["both_step"] == step_values[-1]  # reduce_fx="sum" does not sum within the step
        assert row["last"] != sum(step_values)


def test_on_epoch_reduces_every_micro_batch_of_the_epoch(logged):
    _, epochs = logged
    values = micro_batch_values(1, 0)
    flat = [v for step_values in values for v in step_values]
    assert len(epochs) == 1
    row = epochs[0]
    assert row["both_epoch"] == sum(flat)  # the loss probe's extra forward is not counted
    assert row["largest"] == max(flat)
    assert row["mean_weighted"] == pytest.approx(sum(v * v for v in flat) / sum(flat), rel=1e-12)
    # without batch_size, Lightning infers one size per Lightning batch (the StepBatch's first
    # tensor) and gives every micro-batch of that step the same weight
    sizes = [extract_batch_size(step_batch(k, 1, 0)) for k in range(STEPS)]
    expected = sum(b * sum(v) for b, v in zip(sizes, values)) / sum(b * len(v) for b, v in zip(sizes, values))
    assert row["mean_inferred"] == pytest.approx(expected, rel=1e-12)


def test_per_step_sum_on_one_process(logged):
    steps, _ = logged
    for row, step_values in zip(steps, micro_batch_values(1, 0)):
        assert row["step_sum"] == row["step_sum_global"] == row["stats_loss_tokens"] == sum(step_values)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[list[dict[str, float]]]:
    """Per rank, per step: the values ``on_train_batch_end`` logged, on WORLD ranks (fork launcher)."""
    out = tmp_path_factory.mktemp("logging_two_ranks")
    os.environ.pop("MASTER_PORT", None)
    trainer_for(WORLD, "fork", False).fit(PerMicroBatchLogging(out), datamodule=StepsModule())
    return [json.loads((out / f"records_{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.multiprocess
def test_per_step_sum_over_ranks_with_strategy_reduce_and_step_stats(two_ranks):
    per_rank = [[sum(v) for v in micro_batch_values(WORLD, r)] for r in range(WORLD)]
    counts = [[len(v) for v in micro_batch_values(WORLD, r)] for r in range(WORLD)]
    assert any(len(set(c)) > 1 for c in zip(*counts)), "the data must give ranks unequal micro-batch counts"
    for rank, records in enumerate(two_ranks):
        assert len(records) == STEPS + 1  # and the epoch's values at the end
        for step, row in enumerate(records[:STEPS]):
            total = sum(per_rank[r][step] for r in range(WORLD))
            assert row["step_sum"] == per_rank[rank][step]  # this rank's own micro-batches
            assert row["step_sum_global"] == total  # trainer.strategy.reduce in on_train_batch_end
            assert row["stats_loss_tokens"] == total  # trainer.strategy.step_stats


@pytest.mark.multiprocess
def test_sync_dist_reduces_over_ranks_per_step_outside_the_loop_and_per_epoch_inside(two_ranks):
    per_rank = [[sum(v) for v in micro_batch_values(WORLD, r)] for r in range(WORLD)]
    for records in two_ranks:
        for step, row in enumerate(records[:STEPS]):
            assert row["step_sum_sync_dist"] == sum(per_rank[r][step] for r in range(WORLD))
        # logged in training_step with on_epoch=True: every micro-batch of every rank, reduced at the end
        assert records[STEPS]["epoch_sync_dist"] == sum(map(sum, per_rank))
