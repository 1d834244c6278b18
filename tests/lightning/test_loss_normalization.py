"""The loss-normalisation guard: a per-micro-batch mean stops training, ``token_loss`` never does.

The probe runs one micro-batch again without gradients with ``num_global_tokens`` doubled and
compares the losses (see ``lightning_bytescale/engine/loss_check.py``).  Tested on hand-made
cases, on random models and data (hypothesis: dropout, tied or untied heads, fp32/fp64,
empty-loss micro-batches), and through a ``Trainer`` on 1, 2 and 3 ranks.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from _strategy_helpers import CAPACITY, StepDataModule, TinyLM
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_bytescale import ByteScaleStrategy, token_loss
from lightning_bytescale.engine import build_step, run_micro_batches
from lightning_bytescale.engine.loss_check import LossScaling, verdict
from lightning_bytescale.errors import LossNormalizationError
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan


def test_verdicts():
    assert verdict(1.0, 0.5) == LossScaling.NORMALISED
    assert verdict(1.0, 1.0) == LossScaling.PER_MICRO_BATCH
    assert verdict(1.0, 0.7) == LossScaling.PARTLY
    assert verdict(0.0, 0.0) == LossScaling.UNCHECKED  # nothing trained: not conclusive
    assert verdict(float("nan"), 0.5) == LossScaling.UNCHECKED


class TinyMLPLM(torch.nn.Module):
    """Not the Llama: embedding, dropout, an MLP, a tied or untied head; no attention at all."""

    def __init__(self, vocab: int, dim: int, dropout: float, tied: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.drop = torch.nn.Dropout(dropout)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim)
        )
        self.head = None if tied else torch.nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = self.mlp(self.drop(self.embed(ids)))
        return h @ self.embed.weight.T if self.head is None else self.head(h)


def _step(lengths: list[int], vocab: int, seed: int, masked: set[int] = frozenset()):
    """One rank, one micro-batch per sequence; sequences in ``masked`` train no token."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (s,), generator=g) for s in lengths]
    plan = Plan(
        1,
        max(lengths),
        "hand",
        tuple(lengths),
        [[MicroBatch([Piece(j, ((0, s),))]) for j, s in enumerate(lengths)]],
    )
    step = build_step(plan, 0, lambda j: seqs[j])
    for mb in step.micro_batches:
        if set(mb.seq_ids) & set(masked):
            mb.labels.fill_(-100)
    return step


def _forward(kind: str):
    def forward(model, mb):
        logits = model(mb.input_ids, mb.position_ids)
        if kind == "token":
            return token_loss(logits, mb.labels, mb.num_global_tokens)
        if kind == "method":
            return mb.loss(logits)
        mean = F.cross_entropy(logits.float(), mb.labels, ignore_index=-100)
        if kind == "mean":
            return mean
        return token_loss(logits, mb.labels, mb.num_global_tokens) + 0.5 * mean  # "partly"

    return forward


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("token", LossScaling.NORMALISED),
        ("method", LossScaling.NORMALISED),
        ("mean", LossScaling.PER_MICRO_BATCH),
        ("partly", LossScaling.PARTLY),
    ],
)
def test_probe_tells_the_losses_apart(kind, expected):
    model = TinyMLPLM(50, 16, dropout=0.3, tied=False)
    step = _step([9, 12, 7], 50, seed=1)
    local = run_micro_batches(model, step.micro_batches, forward=_forward(kind), check_loss_scaling=True)
    assert local.loss_scaling == expected


def test_probe_does_not_change_training():
    """Same gradients and RNG stream with and without the probe (dropout on)."""
    torch.manual_seed(0)
    a = TinyMLPLM(50, 16, dropout=0.5, tied=True)
    b = TinyMLPLM(50, 16, dropout=0.5, tied=True)
    b.load_state_dict(a.state_dict())
    step = _step([9, 12, 7], 50, seed=2)
    torch.manual_seed(123)
    run_micro_batches(a, step.micro_batches, forward=_forward("token"), check_loss_scaling=True)
    after_a = torch.rand(1)
    torch.manual_seed(123)
    run_micro_batches(b, step.micro_batches, forward=_forward("token"))
    after_b = torch.rand(1)
    assert torch.equal(after_a, after_b)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_probe_skips_micro_batches_without_trained_tokens():
    model = TinyMLPLM(50, 16, dropout=0.0, tied=True)
    step = _step([9, 12, 7], 50, seed=3, masked={0})
    probed = []

    def forward(m, mb):
        if not torch.is_grad_enabled():
            probed.append(mb.index)
        return _forward("mean")(m, mb)

    local = run_micro_batches(model, step.micro_batches, forward=forward, check_loss_scaling=True)
    assert probed == [0, 1]  # micro-batch 0 trains nothing (loss 0): the probe moved on, then stopped
    assert local.loss_scaling == LossScaling.PER_MICRO_BATCH


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    vocab=st.integers(3, 300),
    dim=st.sampled_from([4, 8, 24]),
    dropout=st.sampled_from([0.0, 0.1, 0.6]),
    tied=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    lengths=st.lists(st.integers(2, 40), min_size=1, max_size=4),
    seed=st.integers(0, 10_000),
    kind=st.sampled_from(["token", "method"]),
)
def test_no_false_alarm_on_token_loss(vocab, dim, dropout, tied, dtype, lengths, seed, kind):
    torch.manual_seed(seed)
    model = TinyMLPLM(vocab, dim, dropout, tied).to(dtype)
    step = _step(lengths, vocab, seed)
    local = run_micro_batches(model, step.micro_batches, forward=_forward(kind), check_loss_scaling=True)
    assert local.loss_scaling in (LossScaling.NORMALISED, LossScaling.UNCHECKED)


class MeanLossLM(TinyLM):
    """The most common mistake: a per-micro-batch mean."""

    def training_step(self, mb, batch_idx):
        logits = self.model(mb.input_ids, mb.position_ids)
        return F.cross_entropy(logits, mb.labels, ignore_index=-100)


class CountingLM(TinyLM):
    """``token_loss``, and a logged per-epoch count of the micro-batches it saw."""

    def training_step(self, mb, batch_idx):
        self.log("micro_batches", 1.0, on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=False)
        return super().training_step(mb, batch_idx)


def _trainer(world: int, tmp_path, **options) -> pl.Trainer:
    os.environ.pop("MASTER_PORT", None)
    return pl.Trainer(
        accelerator="cpu", devices=world,
        strategy=ByteScaleStrategy(
            capacity=CAPACITY, start_method="fork" if world > 1 else "popen", timeout=60, **options
        ),
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0, default_root_dir=tmp_path,
    )  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_a_per_micro_batch_mean_stops_every_rank_at_the_first_step(tmp_path, world):
    with pytest.raises(Exception, match=r"LossNormalizationError.*per-micro-batch mean.*mb\.loss\(logits\)"):
        _trainer(world, tmp_path).fit(MeanLossLM(), datamodule=StepDataModule("balance"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_a_per_micro_batch_mean_stops_a_plan_made_of_rings_only(tmp_path, world):
    # static CP: every micro-batch is a ring, so no rank has a local one to probe; the plan's
    # first ring item is probed by all of its members together
    from _strategy_helpers import StepData

    batch = StepData(world, 0, "static")[0]
    assert batch.micro_batches and all(mb.layout.ring is not None for mb in batch.micro_batches)
    with pytest.raises(Exception, match=r"LossNormalizationError.*per-micro-batch mean.*mb\.loss\(logits\)"):
        _trainer(world, tmp_path).fit(MeanLossLM(), datamodule=StepDataModule("static"))


def test_the_probed_ring_item_is_marked_on_every_member_and_only_there():
    from lightning_bytescale.engine.micro_batch import probe_ring_item

    ring = lambda item, ratio=0.0: [  # noqa: E731
        MicroBatch([Piece(item, ((0, 2), (6, 8)))], ring=(0, 1), item=item, offload_ratio=ratio),
        MicroBatch([Piece(item, ((2, 6),))], ring=(0, 1), item=item, offload_ratio=ratio),
    ]
    a, b, c = ring(0, ratio=0.5), ring(1), ring(2)
    plan = Plan(
        2,
        8,
        "hand",
        (8, 8, 8, 3),
        [[a[0], b[0], c[0], MicroBatch([Piece(3, ((0, 3),))])], [a[1], b[1], c[1]]],
    )
    assert probe_ring_item(plan) == 1  # the first ring item without offload
    seqs = [torch.arange(n) for n in plan.lengths]
    marked = [[mb.probe_ring for mb in build_step(plan, r, lambda j: seqs[j]).micro_batches] for r in (0, 1)]
    assert marked == [[False, True, False, False], [False, True, False]]
    local = Plan(1, 8, "hand", (3,), [[MicroBatch([Piece(0, ((0, 3),))])]])
    assert probe_ring_item(local) is None


def test_a_per_micro_batch_mean_stops_one_process(tmp_path, monkeypatch):
    import _strategy_helpers

    from lightning_bytescale.planner import make_plan

    def one_rank_plan(lengths, world, planner, seed):
        return make_plan(tuple(lengths), world_size=world, seed=seed, planner=planner, capacity=64)

    monkeypatch.setattr(_strategy_helpers, "make_plan", one_rank_plan)
    had_group = torch.distributed.is_initialized()
    try:
        with pytest.raises(LossNormalizationError, match="did not change|stayed the same"):
            _trainer(1, tmp_path).fit(MeanLossLM(), datamodule=StepDataModule("balance"))
        trainer = _trainer(1, tmp_path, check_loss_normalization=False)
        trainer.fit(MeanLossLM(), datamodule=StepDataModule("balance"))  # the documented way out
        assert trainer.global_step == 2
        counting = _trainer(1, tmp_path)
        counting.fit(CountingLM(), datamodule=StepDataModule("balance"))
        expected = sum(len(b.micro_batches) for b in _batches(counting))
        assert float(counting.callback_metrics["micro_batches"]) == expected  # the probe's log did not count
    finally:
        if not had_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _batches(trainer: pl.Trainer):
    loader = trainer.datamodule.train_dataloader()
    return [b for _, b in zip(range(trainer.global_step), loader)]
