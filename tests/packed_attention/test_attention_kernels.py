"""Varlen block kernels, their selection, and the CUDA adapters checked on CPU.

The CUDA adapters (``cuda_kernels.py``) cannot run here, so they are checked two ways:

* on ``meta`` tensors, through the real ``torch.ops.aten`` ops: the calls bind to the ops'
  schemas and the outputs have the shapes the ring expects (the ops' shape functions run);
* against CPU emulations of the four aten ops written here from their contracts (argument
  names bound to the real schemas, padded head sizes required, the efficient kernel's
  per-sequence padded log-sum-exp layout with junk in the padding, backward computed from the
  *given* output and log-sum-exp): the adapters' conversions are then checked numerically.

Numbers are checked against an independent dense per-sequence reference.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_attention import TOL, max_err

from lightning_bytescale.packed_attention import cuda_kernels, kernels, local, select_kernel
from lightning_bytescale.packed_attention.segments import Rows, Segments

LAYOUTS = [
    # (query lengths, key lengths, causal)
    ([9], [9], True),
    ([7, 1, 12], [7, 1, 12], True),
    ([6, 4, 10], [3, 2, 5], False),
    ([3, 5], [6, 10], False),
]


# ----------------------------------------------------------------------------- reference
def dense(q, k, v, q_lens, k_lens, causal, scale):
    """Per-sequence softmax attention: (out, lse [H, Tq]); causal aligns equal lengths."""
    outs, lses = [], []
    qa = ka = 0
    g = q.shape[1] // k.shape[1]
    for lq, lk in zip(q_lens, k_lens):
        qs, ks = q[qa : qa + lq], k[ka : ka + lk].repeat_interleave(g, 1)
        vs = v[ka : ka + lk].repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if causal:
            s = s.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), float("-inf"))
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vs))
        qa, ka = qa + lq, ka + lk
    return torch.cat(outs), torch.cat(lses, dim=1)


def inputs(q_lens, k_lens, heads=4, kv_heads=2, dim=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), heads, dim, generator=g, dtype=dtype)
    k = torch.randn(sum(k_lens), kv_heads, dim, generator=g, dtype=dtype)
    v = torch.randn(sum(k_lens), kv_heads, dim, generator=g, dtype=dtype)
    dout = torch.randn(sum(q_lens), heads, dim, generator=g, dtype=dtype)
    return q, k, v, dout


def dense_grads(q, k, v, dout, q_lens, k_lens, causal, scale):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = dense(q, k, v, q_lens, k_lens, causal, scale)
    return out.detach(), lse.detach(), torch.autograd.grad(out, (q, k, v), dout)


# ----------------------------------------------------------------------------- cpu / math kernels
@pytest.mark.parametrize("impl", ["cpu", "math"])
@pytest.mark.parametrize(("q_lens", "k_lens", "causal"), LAYOUTS)
@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (3, 3)])
def test_varlen_block_matches_dense(impl, q_lens, k_lens, causal, heads):
    scale = 0.3
    q, k, v, dout = inputs(q_lens, k_lens, *heads)
    ref_out, ref_lse, ref_grads = dense_grads(q, k, v, dout, q_lens, k_lens, causal, scale)
    seg = {"q_seg": Segments.of(q_lens), "k_seg": Segments.of(k_lens)}
    out, lse = kernels.block_forward(q, k, v, causal=causal, scale=scale, impl=impl, **seg)
    assert max_err(out, ref_out) <= TOL and max_err(lse, ref_lse) <= TOL
    # backward from the merged (here: the block's own) output and log-sum-exp
    grads = kernels.block_backward(
        dout, q, k, v, ref_out, ref_lse, causal=causal, scale=scale, impl=impl, **seg
    )
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape and max_err(got, want) <= TOL


@pytest.mark.parametrize("impl", ["cpu", "math"])
def test_two_varlen_blocks_merge_to_the_whole(impl):
    """Keys of every sequence split in two varlen blocks, merged by log-sum-exp: full attention and grads."""
    lens, firsts = [7, 12, 3], [3, 5, 1]
    scale = 8**-0.5
    q, k, v, dout = inputs(lens, lens)
    _, _, ref_grads = dense_grads(q, k, v, dout, lens, lens, False, scale)
    ref_out, _ = dense(q, k, v, lens, lens, False, scale)
    first = Rows.of([(a, a + f) for (a, _), f in zip(Segments.of(lens).bounds, firsts)])
    second = Rows.of([(a + f, b) for (a, b), f in zip(Segments.of(lens).bounds, firsts)])
    blocks = [(first, Segments.of(firsts)), (second, Segments.of([n - f for n, f in zip(lens, firsts)]))]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((4, sum(lens)), float("-inf"), dtype=torch.float64)
    for rows, seg in blocks:
        o, lb = kernels.block_forward(
            q,
            rows.take(k),
            rows.take(v),
            causal=False,
            scale=scale,
            impl=impl,
            q_seg=Segments.of(lens),
            k_seg=seg,
        )
        kernels.merge_into(out, lse, o, lb)
    assert max_err(out, ref_out) <= TOL
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, seg in blocks:
        a, b, c = kernels.block_backward(
            dout, q, rows.take(k), rows.take(v), out, lse, causal=False, scale=scale, impl=impl,
            q_seg=Segments.of(lens), k_seg=seg,
        )  # fmt: skip
        dq += a
        rows.add_(dk, b)
        rows.add_(dv, c)
    for got, want in zip((dq, dk, dv), ref_grads):
        assert max_err(got, want) <= TOL


def test_merge_rows_on_an_index_and_a_range():
    g = torch.Generator().manual_seed(3)
    out, lse = torch.randn(6, 2, 3, generator=g, dtype=torch.float64), torch.randn(2, 6, generator=g).double()
    blk_out, blk_lse = torch.randn(3, 2, 3, generator=g).double(), torch.randn(2, 3, generator=g).double()
    for rows in (Rows.of([(0, 1), (3, 5)]), Rows.of([(2, 5)])):
        got_out, got_lse = out.clone(), lse.clone()
        kernels.merge_rows(got_out, got_lse, rows, blk_out, blk_lse)
        idx = rows.index if rows.index is not None else torch.arange(rows.start, rows.stop)
        new = torch.logaddexp(lse[:, idx], blk_lse)
        want = out.clone()
        want[idx] = (
            out[idx] * torch.exp(lse[:, idx] - new).T[..., None]
            + blk_out * torch.exp(blk_lse - new).T[..., None]
        )
        assert max_err(got_out, want) <= 1e-14 and max_err(got_lse[:, idx], new) <= 1e-14
        untouched = torch.ones(6, dtype=torch.bool)
        untouched[idx] = False
        assert torch.equal(got_out[untouched], out[untouched])


def test_rows_and_segments():
    assert Rows.of([(2, 4), (4, 9)]).index is None  # contiguous runs merge into a view
    rows = Rows.of([(0, 2), (5, 6)])
    x = torch.arange(8.0)
    assert rows.take(x).tolist() == [0.0, 1.0, 5.0] and rows.count == 3
    rows.add_(x, torch.ones(3))
    assert x.tolist() == [1.0, 2.0, 2.0, 3.0, 4.0, 6.0, 6.0, 7.0]
    seg = Segments.of([3, 0, 2])
    cpu = torch.device("cpu")
    assert seg.cu_seqlens(cpu).tolist() == [0, 3, 3, 5] and seg.cu_seqlens(cpu).dtype == torch.int32
    assert seg.token_seq(cpu).tolist() == [0, 0, 0, 2, 2]
    assert seg.token_offset(cpu).tolist() == [0, 1, 2, 0, 1]
    assert seg.max_len == 3 and seg.bounds == [(0, 3), (3, 3), (3, 5)]


# ----------------------------------------------------------------------------- selection
def _cuda_kernels_available(monkeypatch, **available):
    for name, ok in available.items():
        monkeypatch.setitem(
            kernels.KERNELS, name, dataclasses.replace(kernels.KERNELS[name], available=lambda d, ok=ok: ok)
        )


@pytest.mark.parametrize(
    ("dtype", "head_dim", "available", "expected"),
    [
        (torch.bfloat16, 128, {"flash_attn": True, "flash": True, "efficient": True}, "flash_attn"),
        (torch.float16, 128, {"flash_attn": False, "flash": True, "efficient": True}, "flash"),
        (torch.bfloat16, 128, {"flash_attn": False, "flash": False, "efficient": True}, "efficient"),  # sm75
        (torch.bfloat16, 512, {"flash_attn": True, "flash": True, "efficient": True}, "efficient"),  # D > 256
        (torch.float32, 64, {"flash_attn": True, "flash": True, "efficient": True}, "efficient"),
        (torch.float64, 64, {"flash_attn": True, "flash": True, "efficient": True}, "math"),
    ],
)
def test_cuda_kernel_selection(monkeypatch, dtype, head_dim, available, expected):
    _cuda_kernels_available(monkeypatch, **available)
    assert select_kernel(torch.device("cuda", 0), dtype, head_dim) == expected
    assert select_kernel(torch.device("cpu"), dtype, head_dim) == "cpu"


def test_kernel_errors_name_the_cause():
    q = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="unknown attention kernel 'nope'"):
        kernels.resolve_kernel("nope", q)
    with pytest.raises(ValueError, match="runs on cuda, not cpu"):
        kernels.resolve_kernel("flash", q.half())
    with pytest.raises(ValueError, match="not float32"):
        kernels.resolve_kernel("flash", q.to("meta"))
    with pytest.raises(ValueError, match="head sizes up to 256"):
        kernels.resolve_kernel("flash_attn", torch.zeros(4, 2, 264, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ValueError, match="equal query and key lengths"):
        kernels.block_forward(
            q, q, q, causal=True, scale=1.0, q_seg=Segments.of([1, 3]), k_seg=Segments.of([2, 2])
        )
    assert local.local_kernel(q) == "sdpa"


# ----------------------------------------------------------------------------- CUDA adapters on meta
@pytest.mark.parametrize(("q_lens", "k_lens", "causal"), LAYOUTS)
def test_cuda_adapters_bind_to_the_real_ops_on_meta(q_lens, k_lens, causal):
    meta, dim = torch.device("meta"), 60  # not a multiple of 8: the adapters pad and cut
    q = torch.empty(sum(q_lens), 8, dim, device=meta, dtype=torch.bfloat16)
    k = torch.empty(sum(k_lens), 2, dim, device=meta, dtype=torch.bfloat16)
    seg = {"q_seg": Segments.of(q_lens), "k_seg": Segments.of(k_lens)}
    for impl in ("flash", "efficient"):
        out, lse = kernels.block_forward(q, k, k, causal=causal, scale=0.1, impl=impl, **seg)
        assert out.shape == q.shape and lse.shape == (8, q.shape[0]) and lse.dtype == torch.float32
    grads = kernels.block_backward(out, q, k, k, out, lse, causal=causal, scale=0.1, impl="flash", **seg)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
    # (torch 2.13's shape function of _efficient_attention_backward lacks the schema's `out`
    # argument, so that op cannot run on meta; the emulation below binds it to the schema)


# ----------------------------------------------------------------------------- CUDA adapters, emulated
def _bind(op, impl):
    """A stand-in for ``op`` that takes exactly its schema's arguments, then runs ``impl(**args)``."""
    schema = op.default._schema
    names = [a.name for a in schema.arguments]
    required = {a.name for a in schema.arguments if not a.has_default_value() and not a.kwarg_only}

    def fake(*args, **kwargs):
        unknown = set(kwargs) - set(names)
        assert not unknown, f"{schema.name} has no argument(s) {unknown}"
        bound = dict(zip(names, args))
        assert not set(bound) & set(kwargs), "an argument passed twice"
        bound.update(kwargs)
        missing = required - set(bound)
        assert not missing, f"{schema.name} misses {missing}"
        return impl(**bound)

    return fake


def _emulate_varlen(q, k, v, cu_q, cu_k, causal, scale, lse_rows=None):
    """Per-sequence dense attention in float64 on ``[T, H, D]``; lse ``[H, Tq]`` (or given rows)."""
    assert q.shape[-1] % 8 == 0, "fused kernels need head sizes padded to a multiple of 8"
    lq, lk = cu_q.diff().tolist(), cu_k.diff().tolist()
    out, lse = dense(q.double(), k.double(), v.double(), lq, lk, causal, scale)
    return out.to(q.dtype), lse.float()


def _emulate_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
    """Gradients from the *given* output and log-sum-exp, as a flash backward computes them."""
    g = q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v))
    for (qa, qb), (ka, kb) in zip(
        zip(cu_q[:-1].tolist(), cu_q[1:].tolist()), zip(cu_k[:-1].tolist(), cu_k[1:].tolist())
    ):
        qs, do, o = (x[qa:qb].double().transpose(0, 1) for x in (q, dout, out))
        ks, vs = (x[ka:kb].double().repeat_interleave(g, 1).transpose(0, 1) for x in (k, v))
        s = qs @ ks.transpose(-1, -2) * scale
        if causal:
            s = s.masked_fill(~torch.ones(qb - qa, kb - ka, dtype=torch.bool).tril(), float("-inf"))
        p = torch.exp(s - lse[:, qa:qb].double()[..., None])
        ds = p * (do @ vs.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
        dq[qa:qb] = (ds @ ks * scale).transpose(0, 1)
        h, lk, d = ks.shape
        dk[ka:kb] = (ds.transpose(-1, -2) @ qs * scale).view(h // g, g, lk, d).sum(1).transpose(0, 1)
        dv[ka:kb] = (p.transpose(-1, -2) @ do).view(h // g, g, lk, d).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _fake_flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, **kw):
    assert dropout_p == 0.0 and query.is_contiguous() and key.is_contiguous()
    assert max_q == int(cum_seq_q.diff().max()) and cum_seq_q.dtype == torch.int32
    out, lse = _emulate_varlen(query, key, value, cum_seq_q, cum_seq_k, is_causal, kw["scale"])
    return out, lse, torch.zeros(2, dtype=torch.uint64), torch.empty(0), torch.empty(0)


def _fake_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, **kw):
    assert logsumexp.shape == (query.shape[1], query.shape[0]) and logsumexp.dtype == torch.float32
    return _emulate_varlen_backward(
        grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, kw["is_causal"], kw["scale"]
    )


JUNK = 1e4  # in the padded log-sum-exp positions, which no real row may read


def _fake_efficient_forward(query, key, value, cu_seqlens_q, cu_seqlens_k, custom_mask_type, **kw):
    assert query.dim() == 4 and query.shape[0] == 1 and query.shape[2] == key.shape[2], (
        "[1, T, H, D], equal heads"
    )
    assert kw["compute_log_sumexp"] and custom_mask_type in (0, 1)
    out, lse = _emulate_varlen(
        query[0], key[0], value[0], cu_seqlens_q, cu_seqlens_k, custom_mask_type == 1, kw["scale"]
    )
    lens = cu_seqlens_q.diff().tolist()
    width = math.ceil(max(lens) / 32) * 32
    padded = torch.full((len(lens), query.shape[2], width), JUNK)
    for b, (a, n) in enumerate(zip(cu_seqlens_q[:-1].tolist(), lens)):
        padded[b, :, :n] = lse[:, a : a + n]
    return (
        out[None],
        padded,
        torch.empty((), dtype=torch.long),
        torch.empty((), dtype=torch.long),
        max(lens),
        0,
    )


def _fake_efficient_backward(grad_out_, query, key, value, out, cu_seqlens_q, cu_seqlens_k, logsumexp, **kw):
    assert query.shape[2] == key.shape[2] and kw["bias"] is None and not kw["bias_requires_grad"]
    lens = cu_seqlens_q.diff().tolist()
    assert logsumexp.shape == (len(lens), query.shape[2], math.ceil(max(lens) / 32) * 32)
    lse = torch.cat([logsumexp[b, :, :n] for b, n in enumerate(lens)], dim=1)
    dq, dk, dv = _emulate_varlen_backward(
        grad_out_[0], query[0], key[0], value[0], out[0], lse, cu_seqlens_q, cu_seqlens_k,
        kw["custom_mask_type"] == 1, kw["scale"],
    )  # fmt: skip
    return dq[None], dk[None], dv[None], torch.empty(())


@pytest.fixture
def emulated_ops(monkeypatch):
    aten = torch.ops.aten
    fakes = {
        "flash_forward": _bind(aten._flash_attention_forward, _fake_flash_forward),
        "flash_backward": _bind(aten._flash_attention_backward, _fake_flash_backward),
        "efficient_forward": _bind(aten._efficient_attention_forward, _fake_efficient_forward),
        "efficient_backward": _bind(aten._efficient_attention_backward, _fake_efficient_backward),
    }
    for name, fake in fakes.items():
        monkeypatch.setitem(cuda_kernels.OPS, name, fake)


@pytest.mark.parametrize("adapter", ["flash", "efficient"])
@pytest.mark.parametrize(("q_lens", "k_lens", "causal"), LAYOUTS)
@pytest.mark.parametrize(("heads", "dim"), [((4, 2), 12), ((4, 1), 16), ((2, 2), 8)])
def test_cuda_adapters_with_emulated_ops(emulated_ops, adapter, q_lens, k_lens, causal, heads, dim):
    forward = getattr(cuda_kernels, f"{adapter}_forward")
    backward = getattr(cuda_kernels, f"{adapter}_backward")
    scale, tol = 0.25, 1e-5  # float32 tensors: the adapters hand the kernels a float32 log-sum-exp
    q, k, v, dout = inputs(q_lens, k_lens, *heads, dim=dim, dtype=torch.float32)
    ref_out, ref_lse, ref_grads = dense_grads(
        *(x.double() for x in (q, k, v, dout)), q_lens, k_lens, causal, scale
    )
    qs, ks = Segments.of(q_lens), Segments.of(k_lens)
    out, lse = forward(q, k, v, qs, ks, causal, scale)
    assert out.shape == q.shape and lse.shape == (heads[0], q.shape[0])
    assert max_err(out, ref_out) <= tol and max_err(lse, ref_lse) <= tol
    grads = backward(dout, q, k, v, ref_out.float(), ref_lse.float(), qs, ks, causal, scale)
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape and max_err(got, want) <= tol


def test_padded_lse_round_trip():
    seg = Segments.of([3, 1, 5])
    lse = torch.randn(2, 9)
    padded = cuda_kernels.lse_to_padded(lse, seg, 32)
    assert padded.shape == (3, 2, 32) and torch.equal(padded[1, :, 0], lse[:, 3])
    assert torch.equal(cuda_kernels.lse_from_padded(padded, seg), lse)
