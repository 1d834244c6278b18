"""Local and ring attention on fake CUDA: the kernel each dtype gets, no host synchronisation, one dtype.

On fake CUDA (``tests/_fake_cuda.py``: the CUDA ops' fake kernels on a CPU-only torch, answering
as one sm90 GPU without flash-attn):

* local attention runs ``varlen_attn`` once for the whole micro-batch in float16/bfloat16 and
  SDPA per sequence in float32, without a host synchronisation;
* the local path takes torch 2.11's ``varlen_attn`` (no ``enable_gqa``; a stand-in with exactly
  that signature) and a torch without the module (SDPA then), where the code once passed
  ``enable_gqa=`` to any torch;
* the loopback ring runs PyTorch's flash kernel in float16/bfloat16 and the memory-efficient
  one in float32, forward and backward (the backward called directly: autograd cannot run on
  fake CUDA), sends key/value blocks of the kernel's dtype, and synchronises nothing;
* under bf16 autocast, q and k in float32 with v in bfloat16 (what a float32 rotary table
  makes) still reach the half-precision kernels, and a ring sends bfloat16 blocks.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
import torch.nn.attention.varlen
from _fake_cuda import CUDA, fake_cuda

from lightning_bytescale.packed_attention import (
    AttentionLayout,
    attention,
    attention_context,
    loopback_ring_attention,
    select_kernel,
)
from lightning_bytescale.packed_attention.local import local_kernel
from lightning_bytescale.packed_attention.loopback import LoopbackRingAttention, Mailboxes, ring_layouts

VARLEN = "torch_attn::_varlen_attn"
FLASH = ("aten::_flash_attention_forward", "aten::_flash_attention_backward")
EFFICIENT = ("aten::_efficient_attention_forward", "aten::_efficient_attention_backward")
MATH = "aten::_safe_softmax"  # SDPA's math path (what SDPA decomposes to on fake tensors)
LENGTHS = (5, 8, 1, 13)
HEADS, KV_HEADS, DIM = 4, 2, 16


def _local(mode, dtypes, lengths=LENGTHS):
    q, k, v = (
        torch.empty(sum(lengths), h, DIM, dtype=d, device=CUDA)
        for h, d in zip((HEADS, KV_HEADS, KV_HEADS), dtypes)
    )
    layout = AttentionLayout(torch.tensor([0, *lengths]).cumsum(0), lengths)
    mode.ops.clear()
    with attention_context(layout):
        return attention(q, k, v)


@pytest.mark.parametrize(
    ("dtype", "kernel"), [(torch.float16, "varlen"), (torch.bfloat16, "varlen"), (torch.float32, "sdpa")]
)
def test_local_attention_picks_the_fused_kernel_without_a_host_sync(dtype, kernel):
    with fake_cuda() as mode:
        out = _local(mode, (dtype,) * 3)
        assert local_kernel(out) == kernel
    assert out.shape == (sum(LENGTHS), HEADS, DIM) and out.dtype == dtype and out.device == CUDA
    if kernel == "varlen":
        assert mode.calls(VARLEN) == 1 and mode.calls(MATH) == 0  # one call for all sequences
    else:
        assert mode.calls(VARLEN) == 0 and mode.calls(MATH) == len(LENGTHS)  # SDPA per sequence
    assert mode.syncs == []


def test_local_attention_under_autocast_casts_mixed_inputs_to_the_autocast_dtype():
    with fake_cuda() as mode, torch.autocast("cuda", dtype=torch.bfloat16):
        out = _local(mode, (torch.float32, torch.float32, torch.bfloat16))  # q, k from a float32 rotary table
    assert out.dtype == torch.bfloat16 and mode.calls(VARLEN) == 1 and mode.calls(MATH) == 0
    assert mode.syncs == []


REAL_VARLEN = torch.nn.attention.varlen.varlen_attn


def varlen_attn_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    """torch 2.11's ``varlen_attn`` signature; as 2.11, it hands grouped-query heads to the kernel as they are."""
    gqa = (
        {"enable_gqa": query.shape[1] != key.shape[1]}
        if "enable_gqa" in inspect.signature(REAL_VARLEN).parameters
        else {}
    )
    return REAL_VARLEN(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        return_aux=return_aux,
        scale=scale,
        window_size=window_size,
        **gqa,
    )


def parameters(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def test_the_stand_in_has_torch_2_11s_signature():
    """The stand-in's parameters, and the installed function's where this is torch 2.11 (the compat run)."""
    assert [name for name, _ in parameters(varlen_attn_2_11)] == [
        "query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "return_aux", "scale", "window_size",
    ]  # fmt: skip
    if torch.__version__.startswith("2.11."):
        assert parameters(REAL_VARLEN) == parameters(varlen_attn_2_11)


@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (4, 1)], ids=["gqa", "mha", "mqa"])
def test_local_attention_calls_torch_2_11s_varlen_attn(monkeypatch, heads):
    calls = []

    @functools.wraps(varlen_attn_2_11)  # its signature is 2.11's (inspect follows __wrapped__)
    def recorded(*args, **kwargs):
        calls.append(sorted(kwargs))
        return varlen_attn_2_11(*args, **kwargs)

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", recorded)
    with fake_cuda() as mode:
        q = torch.empty(27, heads[0], DIM, dtype=torch.bfloat16, device=CUDA)
        k = torch.empty(27, heads[1], DIM, dtype=torch.bfloat16, device=CUDA)
        with attention_context(AttentionLayout(torch.tensor([0, 14, 27]), (14, 13))):
            out = attention(q, k, k)
    assert out.shape == q.shape and calls == [["scale", "window_size"]] and mode.syncs == []


def test_local_attention_without_varlen_attn_takes_sdpa(monkeypatch):
    monkeypatch.delattr(torch.nn.attention.varlen, "varlen_attn")
    with fake_cuda() as mode:
        out = _local(mode, (torch.bfloat16,) * 3)
        assert local_kernel(out) == "sdpa"
    assert out.dtype == torch.bfloat16 and mode.calls(MATH) == len(LENGTHS) and mode.syncs == []


# ----------------------------------------------------------------------------- rings
class _Ctx:
    """A stand-in autograd context, to call the ring's forward and backward directly."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _loopback(monkeypatch, mode, n, dtypes, seq_lens=(37, 5, 64)):
    """``loopback_ring_attention`` forward, then the same Function's backward called directly."""
    ctx = _Ctx()
    monkeypatch.setattr(
        LoopbackRingAttention, "apply", staticmethod(lambda *args: LoopbackRingAttention.forward(ctx, *args))
    )
    layouts = ring_layouts(list(seq_lens), n)
    q, k, v = (
        [torch.empty(int(lay.cu_seqlens[-1]), h, DIM, dtype=d, device=CUDA) for lay in layouts]
        for h, d in zip((HEADS, KV_HEADS, KV_HEADS), dtypes)
    )
    mail = Mailboxes()
    mode.ops.clear()
    outs = loopback_ring_attention(q, k, v, layouts, mailboxes=mail)
    forward_bytes = mail.bytes_sent
    grads = LoopbackRingAttention.backward(ctx, *(torch.empty_like(o) for o in outs))
    blocks = sum(b is not None for s in ctx.setups for b in s.blocks)
    return layouts, outs, grads[1:], forward_bytes, blocks


@pytest.mark.parametrize(
    ("dtype", "ops"), [(torch.float16, FLASH), (torch.bfloat16, FLASH), (torch.float32, EFFICIENT)]
)
@pytest.mark.parametrize("n", [2, 4])
def test_loopback_ring_kernels_bytes_and_no_host_sync(monkeypatch, dtype, ops, n):
    with fake_cuda() as mode:
        assert select_kernel(CUDA, dtype, DIM) == ("flash" if ops == FLASH else "efficient")
        layouts, outs, grads, sent, blocks = _loopback(monkeypatch, mode, n, (dtype,) * 3)
    other = EFFICIENT if ops == FLASH else FLASH
    assert mode.calls(ops[0]) == blocks and mode.calls(ops[1]) == blocks  # one call per block, each way
    assert mode.calls(*other) == 0 and mode.calls(MATH) == 0
    # forward: N - 1 key/value blocks [2, T_m, Hkv, D] per member, in the kernel's dtype
    assert sent == sum(
        (n - 1) * 2 * int(lay.cu_seqlens[-1]) * KV_HEADS * DIM * dtype.itemsize for lay in layouts
    )
    for lay, out in zip(layouts, outs):
        assert (
            out.shape == (int(lay.cu_seqlens[-1]), HEADS, DIM) and out.dtype == dtype and out.device == CUDA
        )
    assert all(g.device == CUDA and g.dtype == dtype for g in grads)
    assert mode.syncs == []


def test_loopback_ring_under_autocast_sends_the_autocast_dtype(monkeypatch):
    with fake_cuda() as mode, torch.autocast("cuda", dtype=torch.bfloat16):
        layouts, outs, _, sent, blocks = _loopback(
            monkeypatch, mode, 2, (torch.float32, torch.float32, torch.bfloat16)
        )
    assert mode.calls(FLASH[0]) == blocks and mode.calls(*EFFICIENT) == 0
    assert sent == sum(
        2 * int(lay.cu_seqlens[-1]) * KV_HEADS * DIM * 2 for lay in layouts
    )  # bfloat16: 2 bytes
    assert all(o.dtype == torch.bfloat16 for o in outs) and mode.syncs == []
