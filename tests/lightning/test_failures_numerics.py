"""A non-finite loss or gradient stops training with the micro-batch and sequence ids involved.

Lightning level: ``ByteScaleStrategy(check_finite=True)`` under a real one-process Trainer
(the 3-rank engine-level version is in ``tests/lightning/test_failures_dist.py``).  Every
micro-batch's loss is checked; the accumulated gradients once a step by default (the report names
the rank and the micro-batches that check covered) or, with ``locate_non_finite=True``, after each
micro-batch (the report names the one that made them non-finite).  The optimizer step is not taken.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _ranks import free_port

from lightning_bytescale.engine.micro_batch import build_step
from lightning_bytescale.engine.step_checks import RankReport, describe_non_finite
from lightning_bytescale.planner import make_plan

pytestmark = pytest.mark.timeout(120)

LENGTHS = (9, 5, 12, 4, 7, 11)
CAPACITY = 16


def test_reports_round_trip_through_the_step_buffer_and_name_every_bad_rank():
    reports = [
        RankReport(busy_s=0.5, num_micro_batches=3),
        RankReport(busy_s=0.4, num_micro_batches=2, bad_micro_batch=1, bad_kind=2, bad_seq_ids=(4, 0)),
        RankReport(num_micro_batches=1, bad_micro_batch=0, bad_kind=1, bad_seq_ids=tuple(range(20))),
    ]
    decoded = [RankReport.decode(r.encode()) for r in reports]
    assert decoded[1].bad_seq_ids == (4, 0) and decoded[1].bad_micro_batch == 1
    assert decoded[0].bad_micro_batch is None
    msg = describe_non_finite(decoded, step=7)
    assert "Non-finite values at step 7; the optimizer step was not taken" in msg
    assert "loss on rank(s) [2], local gradients on rank(s) [1]" in msg
    assert "rank 1: gradients first non-finite after micro-batch 1 (sequences [4, 0])" in msg
    assert (
        "rank 2: non-finite loss in micro-batch 0 (sequences [0, 1, 2, 3, 4, 5, 6, 7], first ids shown)"
        in msg
    )
    assert "rank 0" not in msg
    assert "gradient_clip_val" in msg  # a fix is named


def _steps():
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 64, (s,), generator=g) for s in LENGTHS]
    plan = make_plan(list(LENGTHS), world_size=1, capacity=CAPACITY, planner="balance")
    return [build_step(plan, 0, lambda j: seqs[j], step=0)]


@pytest.mark.parametrize(("kind", "locate"), [("loss", False), ("gradient", True), ("gradient", False)])
def test_strategy_names_the_micro_batch_and_sequences(tmp_path, monkeypatch, kind, locate):
    import lightning.pytorch as pl

    from lightning_bytescale import ByteScaleStrategy, token_loss
    from lightning_bytescale.errors import NonFiniteError
    from lightning_bytescale.models import LlamaConfig, LlamaModel

    steps = _steps()
    assert len(steps[0].micro_batches) >= 2
    bad = 1
    bad_ids = list(steps[0].micro_batches[bad].seq_ids)

    class Poisoned(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = LlamaModel(LlamaConfig.preset("tiny"))

        def training_step(self, mb, batch_idx):
            logits = self.model(mb.input_ids, mb.position_ids)
            if mb.index == bad:
                if kind == "loss":
                    logits = logits * float("inf")
                else:
                    logits.register_hook(lambda g: torch.full_like(g, float("nan")))
            return token_loss(logits, mb.labels, mb.num_global_tokens)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Poisoned()
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    had_group = dist.is_available() and dist.is_initialized()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1,
        strategy=ByteScaleStrategy(capacity=CAPACITY, timeout=30, locate_non_finite=locate),
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, default_root_dir=tmp_path,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(steps, batch_size=None, collate_fn=lambda x: x)
    try:
        with pytest.raises(NonFiniteError) as err:
            trainer.fit(module, train_dataloaders=loader)
    finally:
        if not had_group and dist.is_initialized():
            dist.destroy_process_group()
    msg = str(err.value)
    if kind == "loss":
        assert f"rank 0: non-finite loss in micro-batch {bad} (sequences {bad_ids})" in msg, msg
    elif locate:
        assert f"rank 0: gradients first non-finite after micro-batch {bad} (sequences {bad_ids})" in msg, msg
    else:  # one check after the last micro-batch: all of them, and how to narrow it down
        last = len(steps[0].micro_batches) - 1
        every = [s for mb in steps[0].micro_batches for s in mb.seq_ids]
        assert f"rank 0: gradients non-finite after micro-batches 0..{last}" in msg, msg
        assert f"(sequences {every})" in msg and "locate_non_finite=True" in msg, msg
    for k, v in module.state_dict().items():  # the optimizer step was skipped
        assert torch.equal(v, before[k]), k
