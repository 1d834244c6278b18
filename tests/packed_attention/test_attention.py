"""Packed causal attention: local varlen, zigzag ring over gloo, and the public context API.

Every exactness check is float64 against an independent reference: a dense masked softmax
over the full, unsharded, concatenated sequences with a block-diagonal causal mask.
"""

from __future__ import annotations

import json
import os
import queue
import threading

import pytest
import torch
from _ranks import free_port, init_gloo, run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_bytescale.packed_attention import (
    AttentionLayout,
    AttentionShapeError,
    RingLayoutError,
    attention,
    attention_context,
    comm_stats,
    current_layout,
    kernels,
    reset_comm_stats,
    ring_attention,
    set_overlap,
)
from lightning_bytescale.packed_attention import ring as ring_module
from lightning_bytescale.planner import zigzag

TOL = 1e-10


# ----------------------------------------------------------------------------- reference
def reference_attention(q, k, v, seq_lens, scale=None):
    """Dense softmax attention with a block-diagonal causal mask over concatenated sequences."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    lens = torch.tensor(list(seq_lens))
    seg = torch.repeat_interleave(torch.arange(len(lens)), lens)
    pos = torch.cat([torch.arange(int(s)) for s in lens])
    mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def make_inputs(seq_lens, heads, kv_heads, dim=8, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    t = sum(seq_lens)
    q = torch.randn(t, heads, dim, generator=gen, dtype=dtype)
    k = torch.randn(t, kv_heads, dim, generator=gen, dtype=dtype)
    v = torch.randn(t, kv_heads, dim, generator=gen, dtype=dtype)
    dout = torch.randn(t, heads, dim, generator=gen, dtype=dtype)
    return q, k, v, dout


def reference_with_grads(q, k, v, dout, seq_lens):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = reference_attention(q, k, v, seq_lens)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), dq, dk, dv


def ring_layout(seq_lens, ring, member):
    n = len(ring)
    slots = [zigzag.slots_per_member(s, n) for s in seq_lens]
    cu = torch.tensor([0, *slots]).cumsum(0)
    return AttentionLayout(cu, tuple(seq_lens), ring=tuple(ring), member=member)


def shard_index(layout):
    """Index into the concatenated full sequences of each slot (padding clamped), and the valid mask."""
    starts = torch.tensor([0, *layout.seq_lens]).cumsum(0)[:-1]
    counts = torch.tensor(layout.slots)
    seq_of_slot = torch.repeat_interleave(torch.arange(len(layout.seq_lens)), counts)
    valid = layout.valid()
    lens = torch.tensor(layout.seq_lens)[seq_of_slot]
    pos = torch.minimum(layout.positions(), lens - 1)
    return starts[seq_of_slot] + pos, valid


def local_layout(seq_lens):
    return AttentionLayout(torch.tensor([0, *seq_lens]).cumsum(0), tuple(seq_lens))


def max_err(a, b):
    return float((a.double() - b.double()).detach().abs().max()) if a.numel() else 0.0


# ----------------------------------------------------------------------------- single process
@pytest.mark.parametrize(
    ("seq_lens", "heads", "kv_heads"), [([7, 1, 12, 5], 4, 2), ([9, 9, 9], 4, 4), ([33], 6, 1)]
)
def test_local_varlen_matches_reference(seq_lens, heads, kv_heads):
    q, k, v, dout = make_inputs(seq_lens, heads, kv_heads)
    ref = reference_with_grads(q, k, v, dout, seq_lens)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    reset_comm_stats()
    with attention_context(local_layout(seq_lens)) as lay:
        assert current_layout() is lay
        out = attention(qq, kk, vv)
    out.backward(dout)
    for got, want in zip((out, qq.grad, kk.grad, vv.grad), ref):
        assert max_err(got, want) <= TOL
    assert comm_stats()["p2p_calls"] == 0
    assert current_layout() is None


def test_no_layout_is_one_causal_sequence():
    q, k, v, dout = make_inputs([21], 4, 2)
    ref = reference_with_grads(q, k, v, dout, [21])
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out = attention(qq, kk, vv)
    out.backward(dout)
    for got, want in zip((out, qq.grad, kk.grad, vv.grad), ref):
        assert max_err(got, want) <= TOL
    # a wrong layout really changes the result (the check above can fail)
    assert max_err(reference_attention(q, k, v, [10, 11]), ref[0]) > 1e-3


def test_context_nests_and_restores():
    outer, inner = local_layout([3, 4]), local_layout([7])
    with attention_context(outer):
        with attention_context(inner):
            assert current_layout() is inner
        assert current_layout() is outer
    assert current_layout() is None
    with pytest.raises(TypeError, match="AttentionLayout"), attention_context([3, 4]):
        pass


@pytest.mark.parametrize("impl", ["cpu", "math"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_block_kernels_merge_to_full_attention(impl, dtype):
    """Splitting keys into blocks and merging by log-sum-exp gives full causal attention and grads."""
    tol = TOL if dtype == torch.float64 else 1e-5
    q, k, v, dout = make_inputs([24], 4, 2, dtype=dtype)
    ref = reference_with_grads(*(x.double() for x in (q, k, v, dout)), [24])
    scale = 8**-0.5
    out = torch.zeros(q.shape, dtype=kernels.acc_dtype(dtype))
    lse = torch.full((4, 24), float("-inf"), dtype=out.dtype)
    blocks = [(slice(0, 8), slice(0, 8), True)]
    blocks += [(slice(8, 24), slice(0, 8), False), (slice(8, 16), slice(8, 16), True)]
    blocks += [(slice(16, 24), slice(8, 16), False), (slice(16, 24), slice(16, 24), True)]
    for qs, ks, causal in blocks:
        o, lb = kernels.block_forward(q[qs], k[ks], v[ks], causal=causal, scale=scale, impl=impl)
        kernels.merge_into(out[qs], lse[:, qs], o, lb)
    assert max_err(out.double(), ref[0]) <= tol
    dq, dk, dv = (torch.zeros(x.shape, dtype=out.dtype) for x in (q, k, v))
    for qs, ks, causal in blocks:
        a, b, c = kernels.block_backward(
            dout[qs], q[qs], k[ks], v[ks], out[qs], lse[:, qs], causal=causal, scale=scale, impl=impl
        )
        dq[qs] += a
        dk[ks] += b
        dv[ks] += c
    for got, want in zip((dq, dk, dv), ref[1:]):
        assert max_err(got.double(), want) <= tol


def test_single_member_ring_runs_without_distributed():
    seq_lens = [7, 1, 12]
    q, k, v, dout = make_inputs(seq_lens, 4, 2)
    ref = reference_with_grads(q, k, v, dout, seq_lens)
    layout = ring_layout(seq_lens, (0,), 0)
    idx, valid = shard_index(layout)
    qq, kk, vv = (x[idx].clone().requires_grad_() for x in (q, k, v))
    reset_comm_stats()
    out = ring_attention(qq, kk, vv, layout, scale=8**-0.5)
    out.backward(dout[idx])
    assert max_err(out[valid], ref[0][idx[valid]]) <= TOL
    assert max_err(qq.grad[valid], ref[1][idx[valid]]) <= TOL
    assert comm_stats()["p2p_calls"] == 0


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_low_precision_paths_run_and_stay_close(dtype, tol):
    seq_lens = [13, 6]
    q, k, v, dout = make_inputs(seq_lens, 4, 2)
    ref = reference_with_grads(q, k, v, dout, seq_lens)
    layout = ring_layout(seq_lens, (0,), 0)
    idx, valid = shard_index(layout)
    qq, kk, vv = (x[idx].to(dtype).requires_grad_() for x in (q, k, v))
    out = ring_attention(qq, kk, vv, layout, scale=8**-0.5)
    out.backward(dout[idx].to(dtype))
    assert out.dtype == dtype and qq.grad.dtype == dtype
    assert max_err(out[valid], ref[0][idx[valid]]) <= tol
    assert max_err(kk.grad[valid], ref[2][idx[valid]]) <= tol
    ql, kl, vl = (x.to(dtype) for x in (q, k, v))
    with attention_context(local_layout(seq_lens)):
        assert max_err(attention(ql, kl, vl), ref[0]) <= tol


class _Mailbox:
    """In-memory ring transport: every member runs in its own thread of this process."""

    def __init__(self):
        self._lock = threading.Lock()
        self._queues: dict = {}
        self.posts = 0

    def _queue(self, key):
        with self._lock:
            return self._queues.setdefault(key, queue.Queue())

    def transport(self, me):
        def post(tensor, dst, src, tag):
            self.posts += 1
            self._queue((me, dst, tag)).put(tensor.clone())
            box, got = self._queue((src, me, tag)), []

            class _Pending:
                def wait(self):
                    if not got:
                        got.append(box.get(timeout=30))
                    return got[0]

            return _Pending()

        return post


def run_threads(n, member):
    """``member(i)`` for ``i < n``, each in its own thread; the first error is re-raised here."""
    errors = []

    def run(i):
        try:
            member(i)
        except Exception as err:  # re-raised in the main thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    if errors:
        raise errors[0]


def _threaded_ring(seq_lens, n, heads, kv_heads, impl):
    q, k, v, dout = make_inputs(seq_lens, heads, kv_heads, seed=n)
    mailbox, results = _Mailbox(), {}

    def member(i):
        layout = ring_layout(seq_lens, tuple(range(n)), i)
        idx, valid = shard_index(layout)
        setup = ring_module.ring_setup(layout, idx.shape[0], q.device, transport=mailbox.transport(i))
        qq, kk, vv = (x[idx].clone().requires_grad_() for x in (q, k, v))
        out = ring_module.ZigzagRingAttention.apply(qq, kk, vv, setup, q.shape[-1] ** -0.5, impl)
        out.backward(dout[idx])
        results[i] = (idx, valid, out.detach(), qq.grad, kk.grad, vv.grad)

    run_threads(n, member)
    return reference_with_grads(q, k, v, dout, seq_lens), results, mailbox.posts


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(2, 6),
    seq_lens=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    heads=st.sampled_from([(2, 1), (4, 2), (4, 4), (6, 3)]),
    impl=st.sampled_from(["cpu", "math"]),
)
def test_threaded_ring_matches_full_attention(n, seq_lens, heads, impl):
    """Property: any ring size and lengths, every member in a thread, equals full attention."""
    ref, results, posts = _threaded_ring(seq_lens, n, *heads, impl)
    assert sorted(results) == list(range(n))
    for idx, valid, out, dq, dk, dv in results.values():
        for got, want in zip((out, dq, dk, dv), ref):
            assert max_err(got[valid], want[idx[valid]]) <= TOL
        assert all(float(x[~valid].abs().max()) == 0.0 for x in (out, dq, dk, dv) if (~valid).any())
    # forward: N-1 key/value hops; backward: N-1 key/value hops plus N gradient hops, per member
    assert posts == n * (3 * n - 2)
    # every real token's gradient is delivered exactly once across members
    coverage = torch.zeros(sum(seq_lens), dtype=torch.long)
    for idx, valid, *_ in results.values():
        coverage.index_add_(0, idx[valid], torch.ones(int(valid.sum()), dtype=torch.long))
    assert bool((coverage == 1).all())


def test_bad_shapes_and_layouts_raise_clear_errors():
    q, k, v, _ = make_inputs([8], 4, 3)
    with pytest.raises(AttentionShapeError, match="Hkv"):
        attention(q, k, v)
    q, k, v, _ = make_inputs([8], 4, 2)
    with pytest.raises(AttentionShapeError, match=r"\[T, H, D\]"):
        attention(q[None], k[None], v[None])
    with attention_context(local_layout([3, 4])), pytest.raises(AttentionShapeError, match="7 tokens"):
        attention(q, k, v)
    with pytest.raises(RingLayoutError, match="init_process_group"):
        ring_attention(q, k, v, ring_layout([8], (0, 1), 0), scale=1.0)
    with pytest.raises(RingLayoutError, match="slots"):
        ring_attention(q[:6], k[:6], v[:6], ring_layout([8], (0,), 0), scale=1.0)


# ----------------------------------------------------------------------------- multi-process
# (ring ranks, sequence lengths, heads, kv heads, kernel or "subgroup", dtype, overlap) per phase of one
# world-4 spawn.  Ranks outside a phase's ring run a local micro-batch at the same time and must
# make no P2P call.  float32 phases are checked against the float64 reference at 1e-5.
PHASES = [
    ((0, 1, 2, 3), [37, 5, 64, 1], 4, 2, None, torch.float64, True),
    ((0, 1, 2, 3), [29, 16], 4, 1, "math", torch.float64, False),
    ((0, 2, 3), [23, 50, 6], 4, 4, None, torch.float64, True),
    ((3, 1), [19, 8, 33, 2], 6, 2, None, torch.float64, True),
    ((2, 0), [11], 2, 1, "math", torch.float64, True),
    ((1, 3, 0), [40, 7], 4, 2, None, torch.float32, True),
    ((3, 1), [14, 3], 4, 2, "subgroup", torch.float64, True),
]
F32_TOL = 1e-5
LOCAL_LENS = [9, 4, 15, 1]


def _worker(rank, world, port, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_gloo(rank, world, port)
    # set-up: a group created before the measurements; the "subgroup" phase sends on it, with
    # peers still named by global ranks (its group ranks 0, 1 differ from global ranks 1, 3)
    subgroup = dist.new_group([1, 3])
    pg_before = len(dist.distributed_c10d._world.pg_map)
    report = {"phases": []}
    for p, (ring, seq_lens, heads, kv_heads, impl, dtype, overlap) in enumerate(PHASES):
        entry = {"ring": list(ring), "role": "ring" if rank in ring else "local"}
        reset_comm_stats()
        set_overlap(overlap)
        if rank in ring:
            q, k, v, dout = make_inputs(seq_lens, heads, kv_heads, seed=p)
            ref = reference_with_grads(q, k, v, dout, seq_lens)
            layout = ring_layout(seq_lens, ring, ring.index(rank))
            idx, valid = shard_index(layout)
            # padding slots carry large junk that must not leak into real outputs or gradients
            junk = torch.randn(idx.shape[0], 1, 1, dtype=torch.float64) * 100
            qq, kk, vv = (
                torch.where(valid[:, None, None], x[idx], junk).to(dtype).requires_grad_() for x in (q, k, v)
            )
            if impl in (None, "subgroup"):
                with attention_context(layout, group=subgroup if impl else None):
                    out = attention(qq, kk, vv)
            else:
                out = ring_attention(qq, kk, vv, layout, scale=q.shape[-1] ** -0.5, impl=impl)
            fwd_calls = comm_stats()["p2p_calls"]
            out.backward(dout[idx].to(dtype))
            r = valid
            entry.update(
                out=max_err(out[r], ref[0][idx[r]]),
                dq=max_err(qq.grad[r], ref[1][idx[r]]),
                dk=max_err(kk.grad[r], ref[2][idx[r]]),
                dv=max_err(vv.grad[r], ref[3][idx[r]]),
                pad_abs=max(
                    float(x[~r].abs().max()) if (~r).any() else 0.0 for x in (out, qq.grad, kk.grad, vv.grad)
                ),
                finite=all(bool(torch.isfinite(x).all()) for x in (out, qq.grad, kk.grad, vv.grad)),
                padding_slots=int((~r).sum()),
                fwd_calls=fwd_calls,
            )
        else:
            q, k, v, dout = make_inputs(LOCAL_LENS, 4, 2, seed=100 + rank)
            ref = reference_with_grads(q, k, v, dout, LOCAL_LENS)
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            with attention_context(local_layout(LOCAL_LENS)):
                out = attention(qq, kk, vv)
            out.backward(dout)
            entry.update(
                out=max_err(out, ref[0]),
                dq=max_err(qq.grad, ref[1]),
                dk=max_err(kk.grad, ref[2]),
                dv=max_err(vv.grad, ref[3]),
            )
        entry["tol"] = TOL if dtype == torch.float64 or rank not in ring else F32_TOL
        entry["p2p_calls"] = comm_stats()["p2p_calls"]
        entry["bytes_sent"] = comm_stats()["bytes_sent"]
        report["phases"].append(entry)
    # a layout naming another rank as this member fails fast, before any communication
    report["wrong_member_error"] = None
    if rank < 2:
        x = torch.zeros(4, 2, 4, dtype=torch.float64)
        try:
            with attention_context(ring_layout([8], (0, 1), 1 - rank)):
                attention(x, x, x)
        except RingLayoutError as err:
            report["wrong_member_error"] = str(err)
    report["pg_before"] = pg_before
    report["pg_after"] = len(dist.distributed_c10d._world.pg_map)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(report, fh)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_ring_attention_matches_full_attention_on_gloo(tmp_path):
    world = 4
    run_ranks(_worker, world, world, free_port(), str(tmp_path), method="fork")
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    worst = worst_f32 = 0.0
    for rank, report in enumerate(reports):
        assert report["pg_after"] == report["pg_before"], "ring attention created a process group"
        for (ring, *_), entry in zip(PHASES, report["phases"]):
            errs = [entry[key] for key in ("out", "dq", "dk", "dv")]
            assert max(errs) <= entry["tol"], (rank, ring, entry)
            if entry["tol"] == TOL:
                worst = max(worst, *errs)
            else:
                worst_f32 = max(worst_f32, *errs)
            if entry["role"] == "local":
                assert entry["p2p_calls"] == 0, (rank, ring, entry)
                continue
            n = len(ring)
            assert entry["finite"] and entry["pad_abs"] == 0.0, (rank, ring, entry)
            assert entry["fwd_calls"] == 2 * (n - 1)
            assert entry["p2p_calls"] == 2 * (n - 1) + 2 * (n - 1) + 2 * n
        if rank < 2:
            assert "member" in (report["wrong_member_error"] or ""), report["wrong_member_error"]
    # padding was exercised on every ring size
    assert all(any(e.get("padding_slots", 0) > 0 for e in r["phases"]) for r in reports)
    print(f"max abs error, float64 phases: {worst:.3e}; float32 phase: {worst_f32:.3e}")
