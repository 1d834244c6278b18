"""Spread zigzag padding in ring attention: exact against the unpadded reference, and never seen.

The layout (docs/planner.md, "Zigzag padding") gives every chunk ``floor`` or ``ceil`` of
``s / 2N`` real tokens and puts each member's padding last in each sequence's slots, so the
ring's ``earlier``/``later`` blocks depend on the source member.  Three checks:

* the block plans, enumerated pair by pair, cover every causal pair of real tokens exactly once
  and never pair a real query with a padding key (a structural check, independent of kernels);
* float64 outputs and gradients equal single-process attention over the unpadded sequences,
  with junk in the padding slots, and changing the junk changes no real row by a single bit;
* the vectorised token table of the block plans equals :mod:`.zigzag`'s per-member counts.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_attention import make_inputs, max_err, reference_with_grads, shard_index

from lightning_bytescale.packed_attention import loopback_ring_attention
from lightning_bytescale.packed_attention.loopback import Mailboxes, ring_layouts
from lightning_bytescale.packed_attention.ring import ring_setup
from lightning_bytescale.packed_attention.ring_plan import _rows, chunk_tokens
from lightning_bytescale.packed_attention.segments import Rows
from lightning_bytescale.planner import zigzag

TOL = 1e-10

# lengths that leave padding on most rings, including sequences shorter than the ring
LENGTHS = st.lists(st.integers(1, 40), min_size=1, max_size=3)
RINGS = st.integers(2, 8)


def _slots(rows: Rows, total: int) -> list[int]:
    if rows.index is None:
        return list(range(rows.start, rows.stop))
    return rows.index.tolist()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seq_lens=LENGTHS, n=RINGS)
def test_blocks_cover_every_causal_pair_once_and_no_padding_key(seq_lens, n):
    layouts = ring_layouts(seq_lens, n)
    num_slots = int(layouts[0].cu_seqlens[-1])
    seq_of = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(layouts[0].slots)).tolist()
    positions = [lay.positions().tolist() for lay in layouts]
    pairs: Counter = Counter()
    for i, lay in enumerate(layouts):
        setup = ring_setup(lay, num_slots, torch.device("cpu"), transport=Mailboxes().transport(i))
        assert setup.block(i) is setup.own and setup.own.causal
        for r in range(n):
            plan = setup.block(r)
            if plan is None:
                continue
            q_slots, k_slots = _slots(plan.q_rows, num_slots), _slots(plan.k_rows, num_slots)
            for (qa, qb), (ka, kb) in zip(plan.q_seg.bounds, plan.k_seg.bounds, strict=True):
                j = seq_of[q_slots[qa]]
                assert {seq_of[u] for u in q_slots[qa:qb]} == {seq_of[u] for u in k_slots[ka:kb]} == {j}
                s = seq_lens[j]
                for a, u in enumerate(q_slots[qa:qb]):
                    qp = positions[i][u]
                    keys = k_slots[ka : ka + a + 1] if plan.causal else k_slots[ka:kb]
                    for v in keys:
                        kp = positions[r][v]
                        if qp < s:  # a real query: only real keys at or before it
                            assert kp < s, f"member {i} query {qp} sees padding key {kp} of member {r}"
                            assert kp <= qp, f"member {i} query {qp} sees future key {kp} of member {r}"
                            pairs[(j, qp, kp)] += 1
    want = {(j, qp, kp) for j, s in enumerate(seq_lens) for qp in range(s) for kp in range(qp + 1)}
    assert set(pairs) == want and set(pairs.values()) == {1}


def _run(seq_lens, n, heads, kv_heads, junk, seed):
    q, k, v, dout = make_inputs(seq_lens, heads, kv_heads, seed=seed)
    layouts = ring_layouts(seq_lens, n)
    shards = [shard_index(lay) for lay in layouts]
    parts = [
        [
            torch.where(valid[:, None, None], x[idx], torch.full_like(x[idx], junk)).requires_grad_()
            for idx, valid in shards
        ]
        for x in (q, k, v)
    ]
    outs = loopback_ring_attention(*parts, layouts)
    torch.autograd.backward(outs, [dout[idx] for idx, _ in shards])
    got = [(o.detach(), pq.grad, pk.grad, pv.grad) for o, pq, pk, pv in zip(outs, *parts)]
    return (q, k, v, dout), shards, got


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seq_lens=LENGTHS,
    n=RINGS,
    heads=st.sampled_from([(2, 1), (4, 2), (4, 4)]),
    seed=st.integers(0, 2**16),
)
def test_ring_equals_the_unpadded_reference_in_float64(seq_lens, n, heads, seed):
    """(a): outputs and q/k/v gradients of real tokens equal the unpadded single-process reference."""
    (q, k, v, dout), shards, got = _run(seq_lens, n, *heads, junk=1e3, seed=seed)
    ref = reference_with_grads(q, k, v, dout, seq_lens)
    covered = torch.zeros(sum(seq_lens), dtype=torch.long)
    for (idx, valid), tensors in zip(shards, got):
        for g, want in zip(tensors, ref):
            assert max_err(g[valid], want[idx[valid]]) <= TOL
            assert bool((g[~valid] == 0).all()), "padding rows output nothing and get no gradient"
        covered.index_add_(0, idx[valid], torch.ones(int(valid.sum()), dtype=torch.long))
    assert bool((covered == 1).all())
    # padding content never reaches a real row: other junk, the same bits
    _, _, again = _run(seq_lens, n, *heads, junk=-7.5, seed=seed)
    for (_, valid), a, b in zip(shards, got, again):
        assert all(torch.equal(x[valid], y[valid]) for x, y in zip(a, b))


@settings(max_examples=100, deadline=None)
@given(seq_lens=st.lists(st.integers(1, 5000), min_size=1, max_size=6), n=st.integers(1, 64))
def test_block_plan_token_table_matches_zigzag(seq_lens, n):
    first, second = chunk_tokens(seq_lens, n)
    for j, s in enumerate(seq_lens):
        for m in range(n):
            assert (int(first[j, m]), int(second[j, m])) == zigzag.member_tokens(s, n, m)


def test_one_long_sequence_shares_plans_and_reads_views():
    """One sequence (an HDP ring item): at most two distinct earlier and later plans, all views."""
    n, s = 16, 907
    layouts = ring_layouts([s], n)
    slots = int(layouts[0].cu_seqlens[-1])
    for i, lay in enumerate(layouts):
        setup = ring_setup(lay, slots, torch.device("cpu"), transport=Mailboxes().transport(i))
        earlier = {id(setup.block(r)) for r in range(i)}
        later = {id(setup.block(r)) for r in range(i + 1, n)}
        assert len(earlier) <= 2 and len(later) <= 2
        for r in range(n):
            plan = setup.block(r)
            assert plan is not None and plan.q_rows.index is None and plan.k_rows.index is None


@settings(max_examples=60, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 5)), min_size=1, max_size=8))
def test_vectorised_rows_equal_rows_of(runs):
    """The block plans' vectorised row builder gives the rows :meth:`Rows.of` gives (gaps or none)."""
    lo, hi, at = [], [], 0
    for gap, length in runs:
        at += gap
        lo.append(at)
        hi.append(at + length)
        at += length
    want = Rows.of(list(zip(lo, hi)))
    got = _rows(np.array(lo, dtype=np.int64), np.array(hi, dtype=np.int64))
    assert _slots(got, at) == _slots(want, at)
    assert (got.index is None) == (want.index is None)
