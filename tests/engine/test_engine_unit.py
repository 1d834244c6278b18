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


def _three_micro_batch_step(world_size: int = 1):
    lengths = (4, 6, 5)
    ranks = [[MicroBatch([Piece(0, ((0, 4),))]), MicroBatch([Piece(1, ((0, 6),)), Piece(2, ((0, 5),))])]]
    ranks += [[] for _ in range(world_size - 1)]
    plan = Plan(world_size, 16, "hand", lengths, ranks)
    return build_step(plan, 0, lambda j: torch.arange(lengths[j]))


def test_run_step_names_the_micro_batch_that_made_the_gradients_non_finite():
    from lightning_bytescale.engine import NonFiniteError, default_forward, run_micro_batches

    step = _three_micro_batch_step()
    model = tiny_model()

    def poisoned(m, mb):  # finite loss, NaN gradient from micro-batch 1 on
        if mb.index != 1:
            return default_forward(m, mb)
        logits = m(mb.input_ids, mb.position_ids)
        logits.register_hook(lambda g: torch.full_like(g, float("nan")))
        return token_loss(logits, mb.labels, mb.num_global_tokens)

    with pytest.raises(NonFiniteError) as info:
        run_step(model, step, forward=poisoned, locate_non_finite=True)
    message = str(info.value)
    assert "local gradients on rank(s) [0]" in message and "loss on rank(s) []" in message
    assert "gradients first non-finite after micro-batch 1 (sequences [1, 2])" in message
    assert "non-finite loss" not in message

    # by default the gradients are checked once, after the last micro-batch: the error names
    # the rank and every micro-batch (and sequence) that check covered, and the option to narrow it
    model.zero_grad(set_to_none=True)
    with pytest.raises(NonFiniteError) as info:
        run_step(model, step, forward=poisoned)
    message = str(info.value)
    assert "local gradients on rank(s) [0]" in message and "loss on rank(s) []" in message
    assert "gradients non-finite after micro-batches 0..1" in message and "(sequences [0, 1, 2])" in message
    assert "locate_non_finite=True" in message

    model.zero_grad(set_to_none=True)
    local = run_micro_batches(
        model, step.micro_batches, forward=poisoned, check_finite=True, locate_non_finite=True
    )
    assert [m.grads_finite for m in local.micro_batches] == [True, False]
    assert local.first_non_finite_gradient.index == 1
    model.zero_grad(set_to_none=True)
    once = run_micro_batches(model, step.micro_batches, forward=poisoned, check_finite=True)
    assert [m.grads_finite for m in once.micro_batches] == [None, False]
    assert once.report().bad_from == 0 and once.report().bad_micro_batch == 1
    model.zero_grad(set_to_none=True)
    unchecked = run_micro_batches(model, step.micro_batches, forward=poisoned)
    assert [m.grads_finite for m in unchecked.micro_batches] == [None, None]
    assert unchecked.first_non_finite_gradient is None
    model.zero_grad(set_to_none=True)
    assert run_step(model, step, forward=poisoned, check_finite=False).num_micro_batches == 2


def test_run_step_refuses_a_step_planned_for_another_world_size_before_any_micro_batch():
    from lightning_bytescale.engine import StepError

    step = _three_micro_batch_step(world_size=2)
    assert step.stats["world_size"] == 2
    calls = []

    def forward(m, mb):
        calls.append(mb.index)
        raise AssertionError("no micro-batch may run")

    with pytest.raises(
        StepError, match=r"planned for 2 ranks but the process group has 1; plan with world_size="
    ):
        run_step(tiny_model(), step, forward=forward)
    assert calls == []
    step.stats.pop("world_size")  # a hand-built step without the entries is not checked
    step.stats.pop("micro_batch_counts", None)
    with pytest.raises(AssertionError, match="no micro-batch may run"):
        run_step(tiny_model(), step, forward=forward)


def test_allreduce_is_one_call_for_mixed_dtypes_on_a_one_rank_group(monkeypatch):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        calls = []
        original = dist.all_reduce
        monkeypatch.setattr(
            dist, "all_reduce", lambda t, **kw: (calls.append((t.dtype, t.numel())), original(t, **kw))[1]
        )
        a = nn.Parameter(torch.ones(3, dtype=torch.float32))
        b = nn.Parameter(torch.ones(2, dtype=torch.float64))
        h = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        a.grad = torch.full((3,), 0.5)
        h.grad = torch.full((4,), 0.25, dtype=torch.bfloat16)
        out = allreduce_gradients([a, b, h], extra=torch.tensor([7.0]), counts=torch.tensor([2**40 + 3]))
        assert calls == [(torch.float64, 3 + 2 + 4 + 1 + 1)]
        assert (
            a.grad.dtype == torch.float32 and b.grad.dtype == torch.float64 and h.grad.dtype == torch.bfloat16
        )
        assert a.grad.tolist() == [0.5] * 3 and b.grad.tolist() == [0.0] * 2 and h.grad.tolist() == [0.25] * 4
        assert out.tolist() == [7.0, 2**40 + 3]
        calls.clear()
        a32 = nn.Parameter(torch.ones(3, dtype=torch.float32))
        out = allreduce_gradients(
            [a32], extra=torch.tensor([0.1], dtype=torch.float64), counts=torch.tensor([33_554_433])
        )
        assert calls[0][0] == torch.float32 and out[1].item() == 33_554_433  # 2**25 + 1: not a float32
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("world", [2, 7, 16384])
def test_counts_sum_exactly_in_narrow_buffers(dtype, world):
    from lightning_bytescale.engine.executor import _decode_counts, _encode_counts, _limb_bits

    g = torch.Generator().manual_seed(world)
    per_rank = torch.randint(0, 2**36, (min(world, 64), 3), generator=g).double()
    if world > 64:  # every rank sends the largest limbs (sums stay below 2**53)
        per_rank = torch.full((world, 3), float(2**38 - 1), dtype=torch.float64)
    if dtype == torch.bfloat16 and world > 128:
        with pytest.raises(ValueError, match="reduce_dtype=torch.float32"):
            _limb_bits(dtype, world)
        return
    bits = _limb_bits(dtype, world)
    rows = [_encode_counts(row, bits).to(dtype) for row in per_rank[:64]]
    total = torch.zeros_like(rows[0])
    for i in range(len(per_rank)):  # sequential sums in the narrow dtype, as a ring all-reduce does
        total = total + rows[min(i, len(rows) - 1)]
    exact = [sum(int(x) for x in per_rank[:, j]) for j in range(3)]
    assert [int(x) for x in _decode_counts(total, 3, bits).tolist()] == exact
    with pytest.raises(ValueError, match="integers"):
        _encode_counts(torch.tensor([1.5]), bits)


def test_move_micro_batch_moves_tensors_and_keeps_the_layout_on_the_host():
    from lightning_bytescale.engine import move_micro_batch

    plan = Plan(1, 16, "hand", (4,), [[MicroBatch([Piece(0, ((0, 4),))])]])
    mb = build_step(plan, 0, lambda j: [1, 2, 3, 4]).micro_batches[0]
    assert move_micro_batch(mb, "cpu") is mb
    moved = move_micro_batch(mb, "meta")
    assert moved.input_ids.is_meta and moved.labels.is_meta and moved.position_ids.is_meta
    assert moved.layout == mb.layout and isinstance(moved.layout.cu_seqlens, tuple)
    assert not mb.input_ids.is_meta  # the original is untouched
