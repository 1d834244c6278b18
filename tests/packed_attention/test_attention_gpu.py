"""GPU tier: the CUDA block kernels against ``math``, the loopback ring and local attention on CUDA.

Marked ``gpu``: skipped where CUDA is not available (``tests/conftest.py``).  Each fused kernel
runs the varlen block shapes a ring uses (several sequences, causal diagonal blocks and full
blocks with unequal query/key lengths, GQA, a head size that needs padding) and is compared
with the ``math`` kernel in float64 on the same inputs.  The loopback ring runs on the GPU in
float64 (``math`` blocks, 1e-10 against the dense reference) and in bfloat16 / float32 with
the default fused kernels, and must not synchronise the host inside the ring loop
(``torch.cuda.set_sync_debug_mode("error")``).
"""

from __future__ import annotations

import pytest
import torch
from test_attention import TOL, make_inputs, max_err, reference_with_grads
from test_attention_kernels import LAYOUTS, inputs

from lightning_bytescale.packed_attention import (
    AttentionLayout,
    attention,
    attention_context,
    kernels,
    loopback_ring_attention,
    select_kernel,
)
from lightning_bytescale.packed_attention.loopback import ring_layouts, zigzag_shard, zigzag_unshard
from lightning_bytescale.packed_attention.segments import Segments

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
# errors relative to the reference's largest magnitude
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-3}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return max_err(a, b) / max(float(b.detach().abs().max()), 1e-300)


def _fused(dtype: torch.dtype) -> list[str]:
    return [
        n
        for n in ("flash", "efficient", "flash_attn")
        if kernels.KERNELS[n].unsupported(CUDA, dtype, 64) is None
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("q_lens", "k_lens", "causal"), LAYOUTS)
@pytest.mark.parametrize(("heads", "dim"), [((8, 2), 64), ((4, 1), 40), ((4, 4), 128)])
def test_fused_kernels_match_math(dtype, q_lens, k_lens, causal, heads, dim):
    names = _fused(dtype)
    if not names:
        pytest.skip(f"no fused kernel takes {dtype} on this device")
    scale = dim**-0.5
    seg = {"q_seg": Segments.of(q_lens), "k_seg": Segments.of(k_lens)}
    low = [x.to(CUDA, dtype) for x in inputs(q_lens, k_lens, *heads, dim=dim)]
    high = [x.double() for x in low]  # the reference sees the same (rounded) inputs
    ref_out, ref_lse = kernels.block_forward(*high[:3], causal=causal, scale=scale, impl="math", **seg)
    merged = ref_out.to(dtype)  # the output a ring hands to backward is in the input dtype
    ref_grads = kernels.block_backward(
        high[3], *high[:3], merged.double(), ref_lse, causal=causal, scale=scale, impl="math", **seg
    )
    for name in names:
        out, lse = kernels.block_forward(*low[:3], causal=causal, scale=scale, impl=name, **seg)
        assert out.shape == low[0].shape and lse.shape == (heads[0], low[0].shape[0]), name
        assert rel_err(out, ref_out) <= TOLERANCE[dtype], name
        assert rel_err(lse, ref_lse) <= TOLERANCE[dtype], name
        grads = kernels.block_backward(
            low[3], *low[:3], merged, ref_lse.float(), causal=causal, scale=scale, impl=name, **seg
        )
        for got, want in zip(grads, ref_grads):
            assert got.shape == want.shape, name
            assert rel_err(got, want) <= 2 * TOLERANCE[dtype], name


def test_default_kernels_on_this_gpu():
    assert select_kernel(CUDA, torch.float64, 64) == "math"
    assert select_kernel(CUDA, torch.float32, 64) in ("efficient", "math")
    assert select_kernel(CUDA, torch.bfloat16, 128) in ("flash_attn", "flash", "efficient")


def _loopback(seq_lens, n, heads, kv_heads, dtype, dim=8):
    q, k, v, dout = make_inputs(seq_lens, heads, kv_heads, dim=dim)
    ref = reference_with_grads(q, k, v, dout, seq_lens)
    layouts = ring_layouts(seq_lens, n)
    parts = [[p.to(CUDA, dtype).requires_grad_() for p in zigzag_shard(x, layouts)] for x in (q, k, v)]
    douts = [d.to(CUDA, dtype) for d in zigzag_shard(dout, layouts)]
    return ref, layouts, parts, douts


def _run(layouts, parts, douts):
    outs = loopback_ring_attention(*parts, layouts)
    torch.autograd.backward(outs, douts)
    return [zigzag_unshard(outs, layouts)] + [zigzag_unshard([p.grad for p in ps], layouts) for ps in parts]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_loopback_ring_float64_on_gpu_is_exact(n):
    seq_lens = [97, 13, 250, 5]
    ref, layouts, parts, douts = _loopback(seq_lens, n, 4, 2, torch.float64)
    for got, want in zip(_run(layouts, parts, douts), ref):
        assert max_err(got.cpu(), want) <= TOL


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 3e-2), (torch.float32, 1e-3)])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_loopback_ring_fused_kernels_on_gpu(dtype, tol, n):
    seq_lens = [300, 41, 1000]
    ref, layouts, parts, douts = _loopback(seq_lens, n, 8, 2, dtype, dim=64)
    for got, want in zip(_run(layouts, parts, douts), ref):
        assert got.dtype == dtype and rel_err(got.cpu(), want) <= tol


def test_ring_loop_does_not_synchronise_the_host():
    ref, layouts, parts, douts = _loopback([512, 77], 4, 8, 2, torch.bfloat16, dim=64)
    _run(layouts, parts, douts)  # warm-up: set-ups, offsets, streams
    for ps in parts:
        for p in ps:
            p.grad = None
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = loopback_ring_attention(*parts, layouts)
        torch.autograd.backward(outs, douts)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    got = zigzag_unshard(outs, layouts)
    assert rel_err(got.cpu(), ref[0]) <= 3e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_local_varlen_attention_on_gpu(dtype):
    seq_lens = [70, 3, 129, 64]
    q, k, v, dout = make_inputs(seq_lens, 8, 2, dim=64)
    ref = reference_with_grads(q, k, v, dout, seq_lens)
    qq, kk, vv = (x.to(CUDA, dtype).requires_grad_() for x in (q, k, v))
    layout = AttentionLayout(torch.tensor([0, *seq_lens]).cumsum(0), tuple(seq_lens))
    with attention_context(layout):
        out = attention(qq, kk, vv)
    out.backward(dout.to(CUDA, dtype))
    for got, want in zip((out, qq.grad, kk.grad, vv.grad), ref):
        if dtype == torch.float64:
            assert max_err(got.cpu(), want) <= TOL
        else:
            assert rel_err(got.cpu(), want) <= TOLERANCE[dtype]
