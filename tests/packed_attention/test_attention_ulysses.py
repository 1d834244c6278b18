"""Ulysses and hybrid attention for ring items: exact against full causal attention, in threads and on gloo.

The reference is independent of the code under test: every whole sequence alone through
``F.scaled_dot_product_attention(is_causal=True)`` in float64, in one process.  Members hold the
zigzag slots a ring member holds (padding slots filled with large junk, which must not leak);
their outputs and the gradients of their q, k and v must equal the reference's at the same
(sequence, position) to 1e-10, and be exactly zero on padding slots.

* In one process, every member in its own thread with an in-memory transport (the P2P
  exchange replaced, everything else the production code): a hypothesis property over ring
  sizes 2-5, Ulysses and hybrid (every Ulysses group size that divides the ring), GQA with the
  key/value heads split and replicated, lengths not divisible by the ring; exact operation
  counts per member; each token's gradient delivered exactly once.
* On gloo, one forked world of 5 ranks: Ulysses items of 2 to 5 members, a hybrid item, a ring
  item and a Ulysses item at the same time on other ranks, a set-up subgroup, float32; exact P2P
  counts and bytes, no process group created, ranks outside an item make no P2P call, and a head
  count the members cannot split is refused on every member before any exchange.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from _ranks import free_port, init_gloo, run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st
from test_attention import _Mailbox, run_threads

from lightning_bytescale.engine import PackingError, build_micro_batch
from lightning_bytescale.engine.micro_batch import hybrid_ulysses_size
from lightning_bytescale.packed_attention import (
    AttentionLayout,
    AttentionModeError,
    RingLayoutError,
    UlyssesHeadsError,
    attention,
    attention_context,
    comm_stats,
    reset_comm_stats,
    ulysses_attention,
)
from lightning_bytescale.packed_attention.ulysses_plan import (
    head_split,
    node_rows,
    sequence_rows,
    ulysses_setup,
)
from lightning_bytescale.planner import zigzag
from lightning_bytescale.planner.plan import MicroBatch, Piece

TOL = 1e-10
F32_TOL = 1e-5
DIM = 8


# ----------------------------------------------------------------------------- reference
def sdpa_reference(q, k, v, dout, seq_lens):
    """Outputs and q/k/v gradients of each whole sequence alone through SDPA (float64, one process)."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    outs, start = [], 0
    for s in seq_lens:
        rows = [x[start : start + s].transpose(0, 1)[None] for x in (q, k, v)]  # [1, H, s, D]
        out = F.scaled_dot_product_attention(*rows, is_causal=True, enable_gqa=True)
        outs.append(out[0].transpose(0, 1))
        start += s
    out = torch.cat(outs)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), dq, dk, dv


def make_inputs(seq_lens, heads, kv_heads, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    t = sum(seq_lens)
    q, dout = (torch.randn(t, heads, DIM, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(t, kv_heads, DIM, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, dout


def layout_of(seq_lens, ring, member, mode, ulysses_size=None):
    n = len(ring)
    slots = [zigzag.slots_per_member(s, n) for s in seq_lens]
    cu = torch.tensor([0, *slots]).cumsum(0)
    return AttentionLayout(
        cu, tuple(seq_lens), ring=tuple(ring), member=member, mode=mode, ulysses_size=ulysses_size
    )


def slot_index(layout):
    """Row of the concatenated whole sequences that every slot holds (padding clamped), and the real-slot mask."""
    starts = torch.tensor([0, *layout.seq_lens]).cumsum(0)[:-1]
    seq = torch.repeat_interleave(torch.arange(len(layout.seq_lens)), torch.tensor(layout.slots))
    lens = torch.tensor(layout.seq_lens)[seq]
    pos = layout.positions()
    return starts[seq] + torch.minimum(pos, lens - 1), pos < lens


def shard(q, k, v, layout, seed, dtype=torch.float64):
    """This member's slots of q, k and v, padding slots filled with junk, as leaves."""
    idx, real = slot_index(layout)
    junk = (
        torch.randn(idx.shape[0], 1, 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        * 100
    )
    return [torch.where(real[:, None, None], x[idx], junk).to(dtype).requires_grad_() for x in (q, k, v)]


def max_err(a, b):
    return float((a.double() - b.double()).detach().abs().max()) if a.numel() else 0.0


# ----------------------------------------------------------------------------- in-process members
class Mailboxes(_Mailbox):
    """In-memory transports for members running in threads: the ring's mailbox, and exchanges through it too."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()  # member -> sends and receives issued (each counts one)

    def exchange(self, me):
        def post(sends, recvs, tag):
            self.ops[me] += len(sends) + len(recvs)
            for dst, t in sends:
                self._queue((me, dst, tag)).put(t.clone())
            boxes = [(self._queue((src, me, tag)), buf) for src, buf in recvs]

            class Pending:
                def wait(self):
                    for box, buf in boxes:
                        buf.copy_(box.get(timeout=30))

            return Pending()

        return post

    def ring(self, me):
        post = self.transport(me)

        def counted(tensor, dst, src, tag):
            self.ops[me] += 2  # one send, one receive
            return post(tensor, dst, src, tag)

        return counted


def run_members(seq_lens, n, heads, kv_heads, mode, u=None, seed=0):
    """Every member of one item in its own thread; returns the reference, each member's results and op counts."""
    q, k, v, dout = make_inputs(seq_lens, heads, kv_heads, seed=seed)
    mail, results = Mailboxes(), {}

    def member(i):
        layout = layout_of(seq_lens, tuple(range(n)), i, mode, u)
        idx, real = slot_index(layout)
        qq, kk, vv = shard(q, k, v, layout, seed=i)
        out = ulysses_attention(
            qq, kk, vv, layout, scale=DIM**-0.5, transport=mail.exchange(i), ring_transport=mail.ring(i)
        )
        out.backward(dout[idx])
        results[i] = (idx, real, out.detach(), qq.grad, kk.grad, vv.grad)

    run_threads(n, member)
    return sdpa_reference(q, k, v, dout, seq_lens), results, mail.ops


def expected_ops(n, mode, u=None):
    """Sends and receives of one member, forward and backward: 16 per other member of its Ulysses
    group (q, k, v and the output each way, twice); a hybrid's ring adds 2 per transfer, 3R - 2 of them."""
    u = n if mode == "ulysses" else u
    r = n // u
    return 16 * (u - 1) + (2 * (3 * r - 2) if r > 1 else 0)


def check_members(ref, results, seq_lens):
    worst = 0.0
    coverage = torch.zeros(sum(seq_lens), dtype=torch.long)
    for idx, real, *got in results.values():
        for x, want in zip(got, ref):
            err = max_err(x[real], want[idx[real]])
            assert err <= TOL, err
            worst = max(worst, err)
            if (~real).any():
                assert float(x[~real].abs().max()) == 0.0  # padding: zero output, zero gradient
        coverage.index_add_(0, idx[real], torch.ones(int(real.sum()), dtype=torch.long))
    assert bool((coverage == 1).all())  # every real token on exactly one member
    return worst


@st.composite
def items(draw):
    n = draw(st.integers(2, 5))
    mode = draw(st.sampled_from(["ulysses", "hybrid"]))
    u = None
    if mode == "hybrid":
        u = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    split = n if u is None else u
    heads = split * draw(st.integers(1, 3))
    kv_heads = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    seq_lens = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    return seq_lens, n, heads, kv_heads, mode, u


@settings(max_examples=40, deadline=None)
@given(items())
def test_threaded_members_match_full_attention(item):
    """Property: any ring size 2-5, Ulysses or hybrid, GQA split or replicated, equals SDPA per sequence."""
    seq_lens, n, heads, kv_heads, mode, u = item
    ref, results, ops = run_members(seq_lens, n, heads, kv_heads, mode, u)
    assert sorted(results) == list(range(n))
    check_members(ref, results, seq_lens)
    assert dict(ops) == {m: expected_ops(n, mode, u) for m in range(n) if expected_ops(n, mode, u)}


# (lengths, ring size, heads, kv heads, mode, Ulysses group size): every ring size 2-5, lengths not
# divisible by the ring, key/value heads split (n | Hkv), replicated in GQA groups (MQA: one head each),
# and replicated across groups (H = 12, Hkv = 3 on 2 and 4 members: expanded per query head)
CASES = [
    ([37, 5, 64, 1], 2, 4, 2, "ulysses", None),
    ([23, 50, 6], 3, 6, 3, "ulysses", None),
    ([19, 8, 33, 2], 3, 6, 2, "ulysses", None),
    ([40, 3], 4, 12, 3, "ulysses", None),
    ([17], 4, 8, 1, "ulysses", None),
    ([41, 9], 5, 10, 5, "ulysses", None),
    ([29, 2, 13], 5, 5, 1, "ulysses", None),
    ([37, 5, 64, 1], 4, 4, 2, "hybrid", 2),
    ([31, 2], 4, 12, 3, "hybrid", 2),
    ([50, 9, 3], 6, 6, 3, "hybrid", 3),
    ([50, 9, 3], 6, 6, 2, "hybrid", 2),
]


@pytest.mark.parametrize(("seq_lens", "n", "heads", "kv_heads", "mode", "u"), CASES)
def test_threaded_cases_match_full_attention(seq_lens, n, heads, kv_heads, mode, u):
    ref, results, ops = run_members(seq_lens, n, heads, kv_heads, mode, u, seed=n)
    check_members(ref, results, seq_lens)
    assert set(ops.values()) == {expected_ops(n, mode, u)}


def test_a_wrong_row_order_is_caught(monkeypatch):
    """The checks can fail: two tokens swapped in the exchange's sequence order break the outputs."""
    from lightning_bytescale.packed_attention import ulysses_plan

    real = ulysses_plan.sequence_rows

    def swapped(*args):
        rows = real(*args)
        rows[[3, 4]] = rows[[4, 3]]
        return rows

    monkeypatch.setattr(ulysses_plan, "sequence_rows", swapped)
    with pytest.raises(AssertionError):
        check_members(*run_members([12, 7], 2, 4, 2, "ulysses")[:2], [12, 7])


# ----------------------------------------------------------------------------- set-up pieces
def test_head_split_splits_query_heads_and_splits_or_replicates_key_value_heads():
    split = head_split(8, 4, 4)  # n | Hkv: split, GQA groups of 2 on every member
    assert split.q == ((0, 2), (2, 4), (4, 6), (6, 8)) and split.kv == ((0, 1), (1, 2), (2, 3), (3, 4))
    assert split.expand == (None,) * 4
    split = head_split(8, 2, 4)  # n > Hkv: each member receives the one head its queries read
    assert split.kv == ((0, 1), (0, 1), (1, 2), (1, 2)) and split.expand == (None,) * 4
    split = head_split(12, 3, 4)  # groups of 4 queries over members of 3: heads read by two members
    assert split.kv == ((0, 1), (0, 2), (1, 3), (2, 3))
    assert split.expand == (None, (0, 1, 1), (0, 0, 1), None)
    with pytest.raises(UlyssesHeadsError, match=r"3 members .* 4 query heads .*modes=\('ring',\)"):
        head_split(4, 2, 3)


@pytest.mark.parametrize(("seq_lens", "n"), [([37, 5, 64, 1], 4), ([1, 2, 3, 11], 3), ([9], 5)])
def test_sequence_rows_put_every_token_in_position_order(seq_lens, n):
    layouts = [layout_of(seq_lens, tuple(range(n)), m, "ulysses") for m in range(n)]
    # independent: every member's slot positions from the planner's zigzag sharding
    pos = torch.cat([lay.positions() for lay in layouts])
    seq = torch.cat(
        [torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(lay.slots)) for lay in layouts]
    )
    rows = torch.from_numpy(sequence_rows(seq_lens, layouts[0].cu_seqlens[:-1], layouts[0].num_slots, n))
    want_seq = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    assert torch.equal(seq[rows], want_seq)
    assert torch.equal(pos[rows], torch.cat([torch.arange(s) for s in seq_lens]))


@pytest.mark.parametrize(
    ("seq_lens", "n", "u"), [([37, 5, 64, 1], 4, 2), ([50, 9, 3], 6, 3), ([7, 100], 6, 2)]
)
def test_node_rows_order_a_node_as_a_zigzag_ring_member(seq_lens, n, u):
    layouts = [layout_of(seq_lens, tuple(range(n)), m, "hybrid", u) for m in range(n)]
    slots = layouts[0].num_slots
    for node in range(n // u):
        members = layouts[node * u : (node + 1) * u]
        pos = torch.cat([lay.positions() for lay in members])
        rows = torch.from_numpy(node_rows(seq_lens, layouts[0].cu_seqlens[:-1], slots, n, u, node))
        assert sorted(rows.tolist()) == list(range(u * slots))  # a permutation
        start = 0
        for j, s in enumerate(seq_lens):
            mine = pos[rows[start : start + u * layouts[0].slots[j]]]
            real = mine[mine < s]
            assert torch.equal(real, torch.sort(real).values)  # real tokens in position order, padding last
            assert bool((mine[: real.numel()] < s).all())
            runs = (real[1:] != real[:-1] + 1).sum()
            assert int(runs) <= 1  # two contiguous ranges at most: the node's first and second chunks
            start += u * layouts[0].slots[j]


def test_layout_modes_are_checked():
    with pytest.raises(AttentionModeError, match="'zigzag' is not one of"):
        layout_of([8], (0, 1), 0, "zigzag")
    with pytest.raises(AttentionModeError, match="ulysses_size"):
        layout_of([8], (0, 1, 2, 3), 0, "hybrid")
    with pytest.raises(AttentionModeError, match="dividing its ring of 4"):
        layout_of([8], (0, 1, 2, 3), 0, "hybrid", 3)
    with pytest.raises(AttentionModeError, match="for hybrid layouts"):
        layout_of([8], (0, 1), 0, "ulysses", 2)
    assert layout_of([8], (0, 1, 2, 3), 0, "hybrid", 2).ulysses_size == 2


def test_hybrid_groups_are_the_members_of_one_node():
    assert hybrid_ulysses_size((0, 1, 2, 3), 2) == 2
    assert hybrid_ulysses_size((6, 7, 2, 3, 4, 5), 2) == 2
    assert hybrid_ulysses_size((4, 5, 6, 7, 0, 1, 2, 3), 4) == 4
    with pytest.raises(PackingError, match="ranks_per_node"):
        hybrid_ulysses_size((0, 1, 2, 3), None, item=3)
    with pytest.raises(
        PackingError, match=r"holds \[1, 1, 1, 1\] consecutive members on nodes \[0, 1, 0, 1\]"
    ):
        hybrid_ulysses_size((0, 2, 1, 3), 2)
    with pytest.raises(PackingError, match=r"holds \[2, 1\]"):
        hybrid_ulysses_size((0, 1, 2), 2)


def test_hybrid_groups_a_plan_check_refuses_are_refused_by_the_engine_too():
    # one node: the planner's (and Plan.validate's) Ulysses item, not a hybrid one
    with pytest.raises(PackingError, match=r"holds \[4\] consecutive members on nodes \[0\]"):
        hybrid_ulysses_size((0, 1, 2, 3), 4)
    # one member a node: a plain ring across nodes, not a Ulysses group inside each
    with pytest.raises(PackingError, match=r"holds \[1, 1\] consecutive members on nodes \[0, 1\]"):
        hybrid_ulysses_size((0, 2), 2)


def _member_setups(ring, u):
    """The torch floor's set-up of every member of a hybrid item of ``ring``: (exchange peers, ring across)."""
    out = []
    for m in range(len(ring)):
        setup = ulysses_setup(layout_of([23], ring, m, "hybrid", u), zigzag.slots_per_member(23, len(ring)),
                              torch.device("cpu"), transport=lambda *a: None, ring_transport=lambda *a: None)  # fmt: skip
        out.append((setup.exchange.peers, setup.ring.ranks))
    return out


def test_the_engine_runs_the_planners_hybrid_groups_and_charges_the_heads_it_holds():
    """The planner and the torch floor agree on every ring of up to 8 ranks over nodes of 1-4: where
    the planner allows hybrid (its layout, Plan.validate and the cost) the engine's group size is its
    per-node count, each member exchanges with its node group (``modes.hybrid_groups``) and rings with
    the same member of every other group; where it does not the engine refuses.  The key/value heads a
    Ulysses member holds (``head_split``) are at most what the cost model charges it, and exactly that
    for the member that holds the most."""
    from itertools import permutations

    from lightning_bytescale.planner import CostModel
    from lightning_bytescale.planner.modes import group_layout, hybrid_groups

    allowed = 0
    for rpn in (1, 2, 3, 4):
        for n in (2, 3, 4, 6):
            for ring in permutations(range(8 if n <= 4 else 6), n):
                per_node = group_layout(ring, rpn).per_node
                if per_node is None:
                    with pytest.raises(PackingError, match="a hybrid ring spans two nodes or more"):
                        hybrid_ulysses_size(ring, rpn)
                    continue
                allowed += 1
                assert hybrid_ulysses_size(ring, rpn) == per_node
                if rpn == 2 and n == 4 or rpn == 3 and n == 6 and ring[0] == 0:
                    groups = hybrid_groups(ring, rpn)
                    for m, (peers, across) in enumerate(_member_setups(ring, per_node)):
                        node, k = divmod(m, per_node)
                        assert peers == groups[node] and across == tuple(g[k] for g in groups)
    assert allowed > 100
    for heads in range(1, 17):
        for kv_heads in (d for d in range(1, heads + 1) if heads % d == 0):
            cost = CostModel(a=1e-9, b=1e-6, attention_heads=heads, kv_heads=kv_heads)
            for n in (d for d in range(2, heads + 1) if heads % d == 0):
                held = [b - a for a, b in head_split(heads, kv_heads, n).kv]
                assert max(held) == cost.ulysses_kv_heads(n), (heads, kv_heads, n, held)


def test_micro_batches_carry_the_mode_into_the_layout():
    seq = torch.arange(30)
    ring = (2, 3, 0, 1)
    pieces = [Piece(0, tuple(zigzag.member_ranges(30, 4, 1)))]
    for mode, rpn, size in (("ring", None, None), ("ulysses", None, None), ("hybrid", 2, 2)):
        mb = MicroBatch(pieces, ring=ring, item=0, mode=mode)
        packed = build_micro_batch(mb, 3, lambda j: seq, 29, ranks_per_node=rpn)
        assert (packed.layout.mode, packed.layout.ulysses_size, packed.layout.member) == (mode, size, 1)
    with pytest.raises(PackingError, match="ranks_per_node"):
        build_micro_batch(MicroBatch(pieces, ring=ring, item=0, mode="hybrid"), 3, lambda j: seq, 29)
    with pytest.raises(PackingError, match="mode 'spiral'"):
        build_micro_batch(MicroBatch(pieces, ring=ring, item=0, mode="spiral"), 3, lambda j: seq, 29)


def test_heads_the_members_cannot_split_are_refused_before_any_exchange():
    mail = Mailboxes()
    layout = layout_of([20], (0, 1, 2), 0, "ulysses")
    x = torch.zeros(layout.num_slots, 4, DIM, dtype=torch.float64)
    with pytest.raises(UlyssesHeadsError, match="4 query heads"):
        ulysses_attention(x, x[:, :2], x[:, :2], layout, scale=1.0, transport=mail.exchange(0))
    assert not mail.ops  # nothing was sent or received


# ----------------------------------------------------------------------------- multi-process
# (item ranks, mode, Ulysses group size, lengths, heads, kv heads, dtype, on the set-up subgroup) per
# phase of one world-5 fork.  Ranks outside a phase's items run a local micro-batch meanwhile.
PHASES = [
    [((0, 1, 2, 3, 4), "ulysses", None, [37, 5, 64, 1], 10, 5, torch.float64, False)],
    [((4, 2, 0), "ulysses", None, [23, 50, 6], 6, 2, torch.float64, False)],
    [  # a ring item and a Ulysses item at once
        ((3, 1), "ulysses", None, [19, 8, 33, 2], 4, 1, torch.float64, False),
        ((0, 2, 4), "ring", None, [40, 7], 4, 2, torch.float64, False),
    ],
    [((0, 1, 2, 3), "hybrid", 2, [37, 5, 64, 1], 4, 2, torch.float64, False)],
    [((2, 3, 0, 1), "hybrid", 2, [31, 2, 12], 12, 3, torch.float64, False)],
    [((3, 1), "ulysses", None, [14, 3], 4, 2, torch.float64, True)],
    [((2, 4, 1, 0), "ulysses", None, [40, 7], 8, 2, torch.float32, False)],
]
LOCAL_LENS = [9, 4, 15]


def _expected_bytes(seq_lens, n, heads, kv_heads, member, element):
    """Bytes one member of a Ulysses item sends per micro-batch.

    Forward: every other member's query heads of q and of the output, and the key/value heads it
    reads of k and v; backward: the output's gradient the same way, and back to every other member
    the gradients of this member's heads of its q, k and v slots.
    """
    t = sum(zigzag.slots_per_member(s, n) for s in seq_lens)
    split = head_split(heads, kv_heads, n)
    others = sum(b - a for m, (a, b) in enumerate(split.kv) if m != member)
    own = split.kv[member][1] - split.kv[member][0]
    return t * DIM * element * (4 * (n - 1) * (heads // n) + 2 * others + 2 * (n - 1) * own)


def _worker(rank, world, port, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_gloo(rank, world, port)
    subgroup = dist.new_group([1, 3])  # set-up: created before any measurement
    pg_before = len(dist.distributed_c10d._world.pg_map)
    created = []
    real_new_group = dist.new_group
    dist.new_group = lambda *a, **kw: created.append(a) or real_new_group(*a, **kw)
    report = {"phases": []}
    for p, items_ in enumerate(PHASES):
        entry = {"role": "local"}
        reset_comm_stats()
        mine = [it for it in items_ if rank in it[0]]
        if mine:
            ring, mode, u, seq_lens, heads, kv_heads, dtype, sub = mine[0]
            q, k, v, dout = make_inputs(seq_lens, heads, kv_heads, seed=p)
            ref = sdpa_reference(q, k, v, dout, seq_lens)
            layout = layout_of(seq_lens, ring, ring.index(rank), mode, u)
            idx, real = slot_index(layout)
            qq, kk, vv = shard(q, k, v, layout, seed=rank, dtype=dtype)
            with attention_context(layout, group=subgroup if sub else None):
                out = attention(qq, kk, vv)
            fwd_calls = comm_stats()["p2p_calls"]
            out.backward(dout[idx].to(dtype))
            got = (out, qq.grad, kk.grad, vv.grad)
            entry = {
                "role": mode,
                "n": len(ring),
                "u": u,
                "errors": [max_err(x[real], want[idx[real]]) for x, want in zip(got, ref)],
                "pad_abs": max(float(x[~real].abs().max()) if (~real).any() else 0.0 for x in got),
                "padding_slots": int((~real).sum()),
                "tol": TOL if dtype == torch.float64 else F32_TOL,
                "fwd_calls": fwd_calls,
            }
            if mode == "ulysses":
                entry["expected_bytes"] = _expected_bytes(
                    seq_lens, len(ring), heads, kv_heads, ring.index(rank), dtype.itemsize
                )
        else:
            q, k, v, dout = make_inputs(LOCAL_LENS, 4, 2, seed=100 + rank)
            ref = sdpa_reference(q, k, v, dout, LOCAL_LENS)
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            cu = torch.tensor([0, *LOCAL_LENS]).cumsum(0)
            with attention_context(AttentionLayout(cu, tuple(LOCAL_LENS))):
                out = attention(qq, kk, vv)
            out.backward(dout)
            entry["errors"] = [max_err(x, w) for x, w in zip((out, qq.grad, kk.grad, vv.grad), ref)]
            entry["tol"] = TOL
        stats = comm_stats()
        entry.update(p2p_calls=stats["p2p_calls"], p2p_batches=stats["p2p_batches"])
        entry.update(bytes_sent=stats["bytes_sent"], ulysses_bytes=stats["ulysses_bytes_sent"])
        report["phases"].append(entry)
    # refusals on every member before any exchange: heads 3 members cannot split, a wrong member
    reset_comm_stats()
    report["refused"] = []
    if rank < 3:
        x = torch.zeros(zigzag.slots_per_member(20, 3), 4, DIM, dtype=torch.float64)
        for layout in (
            layout_of([20], (0, 1, 2), rank, "ulysses"),
            layout_of([20], (0, 1, 2), (rank + 1) % 3, "ulysses"),
        ):
            try:
                with attention_context(layout):
                    attention(x, x[:, :2], x[:, :2])
            except (UlyssesHeadsError, RingLayoutError) as err:
                report["refused"].append(f"{type(err).__name__}: {err}")
    report["refused_calls"] = comm_stats()["p2p_calls"]
    report["pg_before"] = pg_before
    report["pg_after"] = len(dist.distributed_c10d._world.pg_map)
    report["new_groups"] = len(created)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(report, fh)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_ulysses_and_hybrid_items_match_full_attention_on_gloo(tmp_path):
    world = 5
    run_ranks(_worker, world, world, free_port(), str(tmp_path), method="fork", timeout_s=240)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    worst = {torch.float64: 0.0, torch.float32: 0.0}
    for rank, report in enumerate(reports):
        assert report["pg_after"] == report["pg_before"] and report["new_groups"] == 0, (
            "a process group was created"
        )
        for p, entry in enumerate(report["phases"]):
            assert max(entry["errors"]) <= entry["tol"], (rank, p, entry)
            worst[torch.float64 if entry["tol"] == TOL else torch.float32] = max(
                worst[torch.float64 if entry["tol"] == TOL else torch.float32], *entry["errors"]
            )
            if entry["role"] == "local":
                assert entry["p2p_calls"] == 0, (rank, p, entry)
                continue
            assert entry["pad_abs"] == 0.0, (rank, p, entry)
            n, u = entry["n"], entry["u"]
            if entry["role"] == "ring":
                assert entry["ulysses_bytes"] == 0 and entry["p2p_calls"] == 2 * (n - 1) + 2 * (n - 1) + 2 * n
                continue
            assert entry["p2p_calls"] == expected_ops(n, entry["role"], u), (rank, p, entry)
            if entry["role"] == "ulysses":
                assert entry["fwd_calls"] == 8 * (n - 1) and entry["p2p_batches"] == 4, (rank, p, entry)
                assert entry["ulysses_bytes"] == entry["bytes_sent"] == entry["expected_bytes"], (
                    rank,
                    p,
                    entry,
                )
            else:  # hybrid: the Ulysses exchange inside the node, the rest around the ring
                assert 0 < entry["ulysses_bytes"] < entry["bytes_sent"], (rank, p, entry)
        if rank < 3:
            heads, member = report["refused"]
            assert heads.startswith("UlyssesHeadsError: a Ulysses item of 3 members"), heads
            assert member.startswith("RingLayoutError: this process is global rank"), member
            assert report["refused_calls"] == 0
    # every item size 2-5 ran, and padding was exercised
    sizes = {e["n"] for r in reports for e in r["phases"] if e["role"] in ("ulysses", "hybrid")}
    assert sizes == {2, 3, 4, 5}
    assert all(any(e.get("padding_slots", 0) > 0 for e in r["phases"]) for r in reports)
    print(
        f"max abs error, float64 phases: {worst[torch.float64]:.3e}; float32 phase: {worst[torch.float32]:.3e}"
    )
