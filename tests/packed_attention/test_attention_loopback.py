"""The loopback ring: all members of a zigzag ring in one process and one thread.

float64 against the dense single-sequence reference of ``test_attention`` (block-diagonal
causal softmax over the unsharded sequences), forward and backward, rings of 1 to 8, several
sequences per ring item, lengths not divisible by ``2N`` and shorter than ``2N``, GQA / MQA /
MHA, both CPU kernels, transfers posted before or after compute.  Sharding uses the test's own
index (``shard_index``), not the library's.  Padding slots hold large junk and must come out
as exact zeros.  The loopback ring and a ring of threads over an in-memory transport run the
same per-member code, so their results must be bit-identical.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_attention import (
    TOL,
    _threaded_ring,
    make_inputs,
    max_err,
    reference_attention,
    reference_with_grads,
    shard_index,
)

from lightning_bytescale.packed_attention import RingLayoutError, loopback_ring_attention, set_overlap
from lightning_bytescale.packed_attention import ring as ring_module
from lightning_bytescale.packed_attention.loopback import (
    LoopbackError,
    Mailboxes,
    ring_layouts,
    zigzag_shard,
    zigzag_unshard,
)

JUNK = 1e3
CASES = [
    # ring size, sequence lengths, (heads, kv heads)
    (1, [7, 1, 12], (4, 2)),
    (2, [37, 5, 64, 1], (4, 2)),
    (3, [23, 50, 6], (4, 4)),
    (4, [29, 16], (4, 1)),
    (5, [19, 8, 33, 2], (6, 2)),
    (6, [11, 40], (2, 1)),
    (7, [3, 61, 14], (4, 2)),
    (8, [70, 9, 1, 17], (8, 2)),
]


def run_loopback(seq_lens, n, heads, kv_heads, impl, seed=0, mail=None):
    """Shard with the test's own index, run the loopback ring, return (reference, per-member results)."""
    q, k, v, dout = make_inputs(seq_lens, heads, kv_heads, seed=seed)
    ref = reference_with_grads(q, k, v, dout, seq_lens)
    layouts = ring_layouts(seq_lens, n)
    shards = [shard_index(lay) for lay in layouts]
    parts = {
        name: [
            torch.where(valid[:, None, None], x[idx], torch.full_like(x[idx], JUNK)).requires_grad_()
            for idx, valid in shards
        ]
        for name, x in (("q", q), ("k", k), ("v", v))
    }
    outs = loopback_ring_attention(parts["q"], parts["k"], parts["v"], layouts, impl=impl, mailboxes=mail)
    torch.autograd.backward(outs, [dout[idx] for idx, _ in shards])
    results = [
        (idx, valid, out.detach(), parts["q"][m].grad, parts["k"][m].grad, parts["v"][m].grad)
        for m, ((idx, valid), out) in enumerate(zip(shards, outs))
    ]
    return ref, results


def check_against_reference(ref, results, seq_lens):
    coverage = torch.zeros(sum(seq_lens), dtype=torch.long)
    for idx, valid, *tensors in results:
        for got, want in zip(tensors, ref):
            assert max_err(got[valid], want[idx[valid]]) <= TOL
            assert bool(torch.isfinite(got).all())
        if (~valid).any():
            assert all(float(x[~valid].abs().max()) == 0.0 for x in tensors), "padding leaked"
        coverage.index_add_(0, idx[valid], torch.ones(int(valid.sum()), dtype=torch.long))
    assert bool((coverage == 1).all()), "every real token belongs to exactly one member"


@pytest.mark.parametrize("impl", ["cpu", "math"])
@pytest.mark.parametrize(("n", "seq_lens", "heads"), CASES)
def test_loopback_ring_matches_dense_reference(n, seq_lens, heads, impl):
    assert any(s % (2 * n) for s in seq_lens) or n == 1  # padding is exercised
    mail = Mailboxes()
    ref, results = run_loopback(seq_lens, n, *heads, impl, seed=n, mail=mail)
    check_against_reference(ref, results, seq_lens)
    # forward: N-1 key/value hops; backward: N-1 key/value hops plus N gradient hops, per member
    assert mail.posts == (n * (3 * n - 2) if n > 1 else 0)
    assert not any(mail.boxes.values()), "every posted message was received"


@pytest.mark.parametrize("n", [2, 5])
def test_transfers_posted_after_compute(n):
    previous = set_overlap(False)
    try:
        ref, results = run_loopback([13, 30, 4], n, 4, 2, None)
    finally:
        set_overlap(previous)
    check_against_reference(ref, results, [13, 30, 4])


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 8),
    seq_lens=st.lists(st.integers(1, 48), min_size=1, max_size=4),
    heads=st.sampled_from([(2, 1), (4, 2), (4, 4), (6, 3), (8, 1)]),
    impl=st.sampled_from(["cpu", "math"]),
)
def test_loopback_ring_property(n, seq_lens, heads, impl):
    ref, results = run_loopback(seq_lens, n, *heads, impl)
    check_against_reference(ref, results, seq_lens)


def test_loopback_and_threaded_ring_are_bit_identical():
    """Same per-member code: a ring of threads over an in-memory transport gives the same bits.

    (The threaded ring fills padding slots with copies of real tokens, the loopback run with
    junk; real rows never see padding, so they must agree to the bit.)
    """
    seq_lens, n, heads = [37, 5, 20], 4, (4, 2)
    _, threaded, _ = _threaded_ring(seq_lens, n, *heads, "cpu")  # inputs seeded with n
    _, loop = run_loopback(seq_lens, n, *heads, "cpu", seed=n)
    for m, (idx, valid, *tensors) in enumerate(loop):
        t_idx, t_valid, *t_tensors = threaded[m]
        assert torch.equal(idx, t_idx) and torch.equal(valid, t_valid)
        assert all(torch.equal(a[valid], b[valid]) for a, b in zip(tensors, t_tensors))


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_low_precision_loopback_stays_close(dtype, tol):
    seq_lens, n = [45, 8], 3
    q, k, v, dout = make_inputs(seq_lens, 4, 2)
    ref = reference_with_grads(q, k, v, dout, seq_lens)
    layouts = ring_layouts(seq_lens, n)
    parts = [[p.to(dtype).requires_grad_() for p in zigzag_shard(x, layouts)] for x in (q, k, v)]
    outs = loopback_ring_attention(*parts, layouts)
    assert all(o.dtype == dtype for o in outs)
    torch.autograd.backward(outs, [d.to(dtype) for d in zigzag_shard(dout, layouts)])
    got = [zigzag_unshard(outs, layouts)] + [zigzag_unshard([p.grad for p in ps], layouts) for ps in parts]
    for g, want in zip(got, ref):
        assert g.dtype == dtype and max_err(g, want) <= tol


def test_shard_helpers_agree_with_the_test_index():
    seq_lens, n = [9, 30, 2], 3
    layouts = ring_layouts(seq_lens, n)
    x = torch.arange(sum(seq_lens), dtype=torch.float64)[:, None]
    parts = zigzag_shard(x, layouts, pad=-1.0)
    for part, lay in zip(parts, layouts):
        idx, valid = shard_index(lay)
        assert torch.equal(part[valid, 0], x[idx[valid], 0]) and bool((part[~valid] == -1).all())
    assert torch.equal(zigzag_unshard(parts, layouts), x)


def test_unused_outputs_and_partial_backward():
    seq_lens, n = [20, 11], 2
    q, k, v, dout = make_inputs(seq_lens, 4, 2)
    layouts = ring_layouts(seq_lens, n)
    parts = [[p.requires_grad_() for p in zigzag_shard(x, layouts)] for x in (q, k, v)]
    outs = loopback_ring_attention(*parts, layouts)
    # only member 1's output feeds the loss: gradients must equal those of that part alone
    (outs[1] * zigzag_shard(dout, layouts)[1]).sum().backward()
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    full = reference_attention(qq, kk, vv, seq_lens)
    mask = torch.zeros(sum(seq_lens), 1, 1, dtype=torch.float64)
    idx, valid = shard_index(layouts[1])
    mask[idx[valid]] = 1.0
    (full * dout * mask).sum().backward()
    for ps, want in zip(parts, (qq.grad, kk.grad, vv.grad)):
        assert max_err(zigzag_unshard([p.grad for p in ps], layouts), want) <= TOL


def test_loopback_errors():
    seq_lens = [10, 3]
    layouts = ring_layouts(seq_lens, 3)
    parts = [zigzag_shard(x, layouts) for x in make_inputs(seq_lens, 2, 1)[:3]]
    with pytest.raises(RingLayoutError, match="member order"):
        loopback_ring_attention(*parts, layouts[::-1])
    other = ring_layouts([10, 4], 3)
    with pytest.raises(RingLayoutError, match="differs from layout 0"):
        loopback_ring_attention(*parts, [layouts[0], other[1], layouts[2]])
    with pytest.raises(RingLayoutError, match="slots"):
        loopback_ring_attention([p[:-1] for p in parts[0]], parts[1], parts[2], layouts)
    # a member run alone (not in lockstep) waits for a message nobody posted
    mail = Mailboxes()
    setup = ring_module.ring_setup(
        layouts[1], parts[0][1].shape[0], torch.device("cpu"), transport=mail.transport(1)
    )
    kernel = ring_module.kernels.resolve_kernel(None, parts[0][1])
    steps = ring_module.forward_steps(parts[0][1], parts[1][1], parts[2][1], setup, 1.0, kernel)
    with pytest.raises(LoopbackError, match="member 0 has not posted"):
        ring_module.run_steps(steps)
