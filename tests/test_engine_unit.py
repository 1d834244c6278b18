"""Single-process engine checks: token loss, the coalesced all-reduce helper, run_step on one rank."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_bytescale.engine import (
    allreduce_gradients,
    build_step,
    run_step,
    token_loss,
)
from lightning_bytescale.engine.reference import causal_attention, reference_loss
from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan


def test_token_loss_is_sum_over_global_tokens_and_ignores_minus_100():
    torch.manual_seed(0)
    logits = torch.randn(6, 11, dtype=torch.float64)
    labels = torch.tensor([3, -100, 0, 10, -100, 7])
    keep = labels != -100
    expected = F.cross_entropy(logits[keep], labels[keep], reduction="sum") / 9
    assert torch.allclose(token_loss(logits, labels, 9), expected, atol=0, rtol=1e-15)
    assert token_loss(logits, torch.full((6,), -100), 9).item() == 0.0


def test_token_loss_upcasts_half_precision():
    logits = torch.randn(5, 7).to(torch.bfloat16)
    labels = torch.tensor([1, 2, 3, 4, 5])
    out = token_loss(logits, labels, 5)
    assert out.dtype == torch.float32
    ref = F.cross_entropy(logits.float(), labels, reduction="sum") / 5
    assert torch.equal(out, ref)


def test_token_loss_errors():
    with pytest.raises(ValueError, match="positive"):
        token_loss(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="do not match"):
        token_loss(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long), 4)


def test_allreduce_without_process_group_fills_missing_grads_and_returns_extra():
    a = nn.Parameter(torch.ones(2, 3, dtype=torch.float64))
    b = nn.Parameter(torch.ones(4, dtype=torch.float64))
    frozen = nn.Parameter(torch.ones(2), requires_grad=False)
    a.grad = torch.full((2, 3), 2.0, dtype=torch.float64)
    extra = allreduce_gradients([a, b, frozen], extra=torch.tensor([5.0, 6.0]))
    assert torch.equal(a.grad, torch.full((2, 3), 2.0, dtype=torch.float64))
    assert b.grad is not None and b.grad.abs().sum() == 0 and b.grad.dtype == torch.float64
    assert frozen.grad is None
    assert extra.tolist() == [5.0, 6.0] and extra.dtype == torch.float64


def tiny_model(attention_fn=None, **overrides) -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(LlamaConfig.preset("tiny", **overrides), attention_fn=attention_fn).double()


def test_run_step_single_rank_equals_reference_and_calls_context_hook():
    lengths = (5, 9, 3, 7)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 64, (s,), generator=g) for s in lengths]
    plan = Plan(
        1,
        16,
        "hand",
        lengths,
        [
            [
                MicroBatch([Piece(0, ((0, 5),)), Piece(1, ((0, 9),))]),
                MicroBatch([Piece(3, ((0, 7),)), Piece(2, ((0, 3),))]),
            ]
        ],
    )
    step = build_step(plan, 0, lambda j: seqs[j])

    ref = tiny_model(attention_fn=causal_attention)
    ref_loss = reference_loss(ref, seqs)
    ref_loss.backward()

    model = tiny_model(tie_embeddings=False)
    seen = []

    @contextlib.contextmanager
    def hook(mb):
        seen.append(mb.index)
        yield

    result = run_step(model, step, micro_batch_context=hook)
    assert seen == [0, 1]
    assert result.num_micro_batches == 2 and len(result.busy_seconds) == 1
    assert abs(result.loss - ref_loss.item()) <= 1e-12
    err = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    assert err <= 1e-10


def test_run_step_reports_non_finite_loss_with_micro_batch_and_sequences():
    from lightning_bytescale.engine import NonFiniteError, default_forward

    lengths = (4, 6)
    plan = Plan(
        1, 16, "hand", lengths, [[MicroBatch([Piece(0, ((0, 4),))]), MicroBatch([Piece(1, ((0, 6),))])]]
    )
    step = build_step(plan, 0, lambda j: torch.arange(lengths[j]))
    model = tiny_model()

    def poisoned(m, mb):
        loss = default_forward(m, mb)
        return loss * float("nan") if mb.index == 1 else loss

    with pytest.raises(NonFiniteError, match=r"loss on rank\(s\) \[0\].*micro-batch 1 \(sequences \[1\]\)"):
        run_step(model, step, forward=poisoned)
    model.zero_grad(set_to_none=True)
    result = run_step(model, step, forward=poisoned, check_finite=False, extra=torch.tensor([2.0, 3.0]))
    assert result.extra.tolist() == [2.0, 3.0]
