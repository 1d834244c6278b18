"""Ulysses and hybrid attention on fake CUDA: the kernels, the exchange's tensors, no host synchronisation.

On fake CUDA (``tests/_fake_cuda.py``: one sm90 GPU without flash-attn) with this process as one
member of a ring item and the exchange's P2P an echo that records every operation
(``fake_p2p``, ``EchoExchange``):

* a Ulysses item's forward runs the local path's kernel (``varlen_attn`` once for all sequences
  in float16/bfloat16, SDPA per sequence in float32), two exchanges of ``4 (N - 1)`` operations
  each, every one on a contiguous CUDA tensor of the kernel's dtype, and no host synchronisation;
  under bf16 autocast mixed q/k/v dtypes are exchanged in bfloat16;
* the exchanges' backward (the autograd functions' ``backward`` called directly: autograd
  cannot run on fake CUDA) issues the reverse exchanges on CUDA tensors without a host
  synchronisation, for key/value heads split and replicated;
* a hybrid item exchanges inside its node and runs PyTorch's flash kernel in the ring across
  nodes, without a host synchronisation.
"""

from __future__ import annotations

import pytest
import torch
from _fake_cuda import CUDA, EchoExchange, fake_cuda, fake_p2p

from lightning_bytescale.packed_attention import AttentionLayout, attention, attention_context
from lightning_bytescale.packed_attention.ulysses import _HeadsToTokens, _TokensToHeads
from lightning_bytescale.packed_attention.ulysses_plan import head_split, ulysses_setup
from lightning_bytescale.planner import zigzag

VARLEN = "torch_attn::_varlen_attn"
FLASH = ("aten::_flash_attention_forward", "aten::_flash_attention_backward")
MATH = "aten::_safe_softmax"  # SDPA's math path (what SDPA decomposes to on fake tensors)
LENGTHS = (37, 5, 64)
DIM = 16


def _layout(n: int, member: int, mode: str, u: int | None = None) -> AttentionLayout:
    slots = [zigzag.slots_per_member(s, n) for s in LENGTHS]
    cu = torch.tensor([0, *slots]).cumsum(0)
    return AttentionLayout(cu, LENGTHS, ring=tuple(range(n)), member=member, mode=mode, ulysses_size=u)


def _tensors(layout, heads, kv_heads, dtypes):
    return [
        torch.empty(layout.num_slots, h, DIM, dtype=d, device=CUDA)
        for h, d in zip((heads, kv_heads, kv_heads), dtypes)
    ]


def _check_ops(exchanges, n, dtype):
    assert all(op.device == CUDA and op.dtype == dtype and op.contiguous for ops in exchanges for op in ops)
    for ops in exchanges:  # one send to and one receive from every other member, per tensor
        assert sum(op.kind == "send" for op in ops) == sum(op.kind == "recv" for op in ops)
        assert {op.peer for op in ops} <= set(range(n))


@pytest.mark.parametrize(
    ("dtype", "kernel"), [(torch.bfloat16, VARLEN), (torch.float16, VARLEN), (torch.float32, MATH)]
)
@pytest.mark.parametrize(("n", "heads", "kv_heads"), [(4, 8, 4), (4, 8, 2), (2, 4, 1)])
def test_ulysses_forward_runs_the_local_kernel_on_cuda_exchanges_without_a_host_sync(
    dtype, kernel, n, heads, kv_heads
):
    layout = _layout(n, 1, "ulysses")
    with fake_cuda() as mode, fake_p2p(1, n):
        q, k, v = _tensors(layout, heads, kv_heads, (dtype,) * 3)
        mode.ops.clear()
        with attention_context(layout):
            out = attention(q, k, v)
        exchanges = list(EchoExchange.OPS)
    assert out.shape == q.shape and out.dtype == dtype and out.device == CUDA
    # the local path's kernel on all tokens of this member's heads: one varlen call, or SDPA per sequence
    assert mode.calls(kernel) == (1 if kernel == VARLEN else len(LENGTHS))
    assert mode.calls(*FLASH) == 0
    assert mode.syncs == []
    assert [len(ops) for ops in exchanges] == [6 * (n - 1), 2 * (n - 1)]  # q, k, v out; the output back
    _check_ops(exchanges, n, dtype)


def test_ulysses_under_autocast_exchanges_the_autocast_dtype():
    layout = _layout(2, 0, "ulysses")
    with fake_cuda() as mode, fake_p2p(0, 2), torch.autocast("cuda", dtype=torch.bfloat16):
        q, k, v = _tensors(layout, 4, 2, (torch.float32, torch.float32, torch.bfloat16))
        with attention_context(layout):
            out = attention(q, k, v)
        exchanges = list(EchoExchange.OPS)
    assert out.dtype == torch.bfloat16 and mode.calls(VARLEN) == 1 and mode.syncs == []
    _check_ops(exchanges, 2, torch.bfloat16)


class _Ctx:
    """A stand-in autograd context, to call the exchanges' forward and backward directly."""


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 4), (12, 3)], ids=["kv-split", "kv-replicated"])
def test_the_exchanges_backward_runs_on_cuda_without_a_host_sync(heads, kv_heads):
    n, member = 4, 2
    layout = _layout(n, member, "ulysses")
    with fake_cuda() as mode, fake_p2p(member, n):
        q, k, v = _tensors(layout, heads, kv_heads, (torch.bfloat16,) * 3)
        ex = ulysses_setup(layout, q.shape[0], q.device).exchange
        split = head_split(heads, kv_heads, n)
        ranges = (split.q, split.kv, split.kv)
        into, back = _Ctx(), _Ctx()
        qh, kh, vh = _TokensToHeads.forward(into, ex, ranges, q, k, v)
        out = _HeadsToTokens.forward(back, ex, split.q, q.shape, torch.empty_like(qh))
        EchoExchange.OPS.clear()
        mode.syncs.clear()
        (dout_h,) = _HeadsToTokens.backward(back, torch.empty_like(out))[3:]
        dq, dk, dv = _TokensToHeads.backward(
            into, torch.empty_like(qh), torch.empty_like(kh), torch.empty_like(vh)
        )[2:]
        exchanges = list(EchoExchange.OPS)
    assert dout_h.shape == qh.shape and dout_h.device == CUDA
    assert [x.shape for x in (dq, dk, dv)] == [q.shape, k.shape, v.shape]
    assert all(x.device == CUDA and x.dtype == torch.bfloat16 for x in (dq, dk, dv))
    assert [len(ops) for ops in exchanges] == [2 * (n - 1), 6 * (n - 1)]
    _check_ops(exchanges, n, torch.bfloat16)
    assert mode.syncs == []


def test_hybrid_forward_exchanges_in_the_node_and_rings_across_with_flash():
    n, u, member = 4, 2, 3
    layout = _layout(n, member, "hybrid", u)
    with fake_cuda() as mode, fake_p2p(member, n) as ring_sent:
        q, k, v = _tensors(layout, 4, 2, (torch.bfloat16,) * 3)
        mode.ops.clear()
        with attention_context(layout):
            out = attention(q, k, v)
        exchanges = list(EchoExchange.OPS)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and mode.syncs == []
    assert mode.calls(FLASH[0]) >= 2 and mode.calls(VARLEN) == 0 and mode.calls(MATH) == 0
    assert [len(ops) for ops in exchanges] == [6 * (u - 1), 2 * (u - 1)]
    assert {op.peer for ops in exchanges for op in ops} == {2}  # the other member of its node
    _check_ops(exchanges, n, torch.bfloat16)
    # one ring transfer across the two nodes: key/value blocks of the node's slots, this member's head
    assert ring_sent == [(torch.bfloat16, 2 * u * layout.num_slots * 1 * DIM * 2)]
