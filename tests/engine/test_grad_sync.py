"""The bucketed gradient sync's bookkeeping in one process (no communication): buckets,
gradients as bucket views, in-place accumulation over micro-batches, parameters without a
gradient, narrow dtypes.  Its multi-rank equivalence is in ``test_engine_distributed.py`` and
``test_strategy.py``; its memory in ``benchmarks/grad_sync_memory.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_bytescale.engine.grad_sync import BucketedGradSync


def _model(dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 64), nn.Linear(64, 2), nn.Linear(2, 2)).to(dtype)


def test_buckets_hold_small_parameters_together_and_large_ones_alone():
    model = _model()
    sync = BucketedGradSync(list(model.parameters()), bucket_bytes=8 * 64 * 8)  # one 8x64 float64 weight
    solo = [b for b in sync.buckets if b.solo]
    assert [tuple(b.params[0].shape) for b in solo] == [(64, 8)]
    shared = [b for b in sync.buckets if not b.solo]
    assert sum(len(b.params) for b in shared) == len(list(model.parameters())) - 1
    order = [id(p) for b in sync.buckets for p in b.params]
    assert order == [id(p) for p in reversed(list(model.parameters()))]  # backward order
    sync.close()


def test_the_first_bucket_is_small_and_launched_while_the_last_backward_runs():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).double()  # 2 MiB, one default bucket
    sync = BucketedGradSync(list(model.parameters()))  # 25 MiB buckets, DDP's 1 MiB first bucket
    first = sync.buckets[0]
    assert first.buffer is not None and first.buffer.numel() * first.buffer.element_size() <= 2**20
    assert len(sync.buckets) == 2 and not any(b.solo for b in sync.buckets)
    sync.prepare()
    sync.arm()
    hidden = model[0](torch.randn(3, 256, dtype=torch.float64))
    launched: list[int] = []  # buckets launched when the backward reaches layer 0 (still to run)
    hidden.register_hook(lambda grad: launched.append(sync.launched_in_backward))
    model[1:](hidden).sum().backward()
    assert launched == [1]
    assert sync.launched_in_backward == 2
    sync.finish()
    sync.close()


def test_gradients_are_bucket_views_and_accumulate_in_place_over_micro_batches():
    model, ref = _model(), _model()
    sync = BucketedGradSync(list(model.parameters()), bucket_bytes=2**20)
    xs = [torch.randn(3, 8, dtype=torch.float64) for _ in range(3)]
    sync.prepare()
    buffers = {b.buffer.data_ptr() for b in sync.buckets if b.buffer is not None}
    for i, x in enumerate(xs):
        if i == len(xs) - 1:
            sync.arm()
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
    assert sync.launched_in_backward == len(sync.buckets)  # every gradient was final in the last backward
    sync.finish()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
        assert sync.produced(p)
    assert {b.buffer.data_ptr() for b in sync.buckets if b.buffer is not None} == buffers  # no reallocation
    sync.close()


def test_a_rank_without_micro_batches_contributes_zeros_and_produced_nothing():
    model = _model()
    sync = BucketedGradSync(list(model.parameters()), bucket_bytes=256)
    sync.prepare()
    sync.finish()  # no backward at all
    for p in model.parameters():
        assert p.grad is not None and not p.grad.any()
        assert not sync.produced(p)
    sync.close()


def test_a_parameter_unused_in_the_last_backward_waits_for_finish():
    model = _model()
    sync = BucketedGradSync(list(model.parameters()), bucket_bytes=2**20)
    sync.prepare()
    model(torch.randn(2, 8, dtype=torch.float64)).sum().backward()  # an earlier micro-batch
    sync.arm()
    model[0](torch.randn(2, 8, dtype=torch.float64)).sum().backward()  # the last one uses layer 0 only
    assert sync.launched_in_backward < len(sync.buckets)
    sync.finish()
    assert all(p.grad is not None for p in model.parameters())
    sync.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrow_gradients_are_summed_in_float32_and_written_back(dtype):
    model = _model(dtype)
    sync = BucketedGradSync(list(model.parameters()), bucket_bytes=2**20)
    sync.prepare()
    sync.arm()
    model(torch.randn(2, 8, dtype=dtype)).float().sum().backward()
    sync.finish()
    assert all(p.grad.dtype == dtype for p in model.parameters())
    assert sync.extra_bytes == 0  # the float32 copies are gone after finish
    sync.close()


def test_bad_bucket_size_is_refused():
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        BucketedGradSync(list(_model().parameters()), bucket_bytes=0)


def test_finiteness_is_read_from_this_ranks_own_values_even_while_a_sum_is_in_flight():
    """A launched bucket's buffer may already hold other ranks' values (an all-reduce in flight):
    the flag recorded at launch counts for it, and buckets not launched yet are read directly."""
    model = _model()
    sync = BucketedGradSync(list(model.parameters()), bucket_bytes=8 * 64 * 8)
    assert len(sync.buckets) >= 3
    sync.prepare()
    sync.track_finite = True
    sync.arm()
    model(torch.randn(3, 8, dtype=torch.float64)).sum().backward()  # launches every bucket
    assert sync.launched_in_backward == len(sync.buckets)
    assert bool(sync.local_grads_finite())
    for bucket in sync.buckets:  # another rank's NaN arrives through the in-place sum
        (bucket.params[0].grad if bucket.solo else bucket.buffer).fill_(float("nan"))
    assert bool(sync.local_grads_finite()), "blamed this rank for another rank's NaN"
    sync.finish()

    model.zero_grad(set_to_none=True)  # what the optimizer does between steps
    sync.prepare()  # next step: this rank's own NaN, in a bucket launched and in one not launched
    sync.track_finite = True
    sync.arm()
    out = model(torch.randn(3, 8, dtype=torch.float64))
    (out.sum() * float("nan")).backward()
    assert not bool(sync.local_grads_finite())
    sync.finish()

    model.zero_grad(set_to_none=True)
    sync.prepare()  # not armed: nothing launched, the buffers are read as they are
    model(torch.randn(3, 8, dtype=torch.float64)).sum().backward()
    assert bool(sync.local_grads_finite())
    next(iter(model.parameters())).grad[0, 0] = float("inf")
    assert not bool(sync.local_grads_finite())
    sync.close()
