"""q, k and v meet the attention kernels in one dtype (``input_dtype.py``).

Under autocast every entry point (``attention``, ``ring_attention``, ``loopback_ring_attention``)
casts its floating inputs to the autocast dtype, float64 excepted, as autocast does for
``scaled_dot_product_attention``: the result equals SDPA under the same autocast, and gradients
return in the inputs' own dtypes.  Outside autocast mixed dtypes are refused with a message
naming the dtypes and the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_bytescale.packed_attention import (
    AttentionDtypeError,
    attention,
    attention_context,
    loopback_ring_attention,
)
from lightning_bytescale.packed_attention.input_dtype import kernel_inputs
from lightning_bytescale.packed_attention.layout import AttentionLayout
from lightning_bytescale.packed_attention.loopback import ring_layouts, zigzag_shard, zigzag_unshard


def _qkv(t=12, dtypes=(torch.float32, torch.float32, torch.bfloat16), requires_grad=False):
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(t, h, 8, generator=g).to(d).requires_grad_(requires_grad)
        for h, d in zip((4, 2, 2), dtypes)
    ]


def test_under_autocast_attention_equals_sdpa_under_autocast():
    q, k, v = _qkv(requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention(q, k, v)
        ref = F.scaled_dot_product_attention(
            *(x.transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, enable_gqa=True
        )[0].transpose(0, 1)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(out, ref)  # the same bf16 inputs through the same CPU kernel
    out.float().sum().backward()
    assert (q.grad.dtype, k.grad.dtype, v.grad.dtype) == (torch.float32, torch.float32, torch.bfloat16)


def test_kernel_inputs_follows_autocast_rules():
    f32, bf16, f64 = _qkv(dtypes=(torch.float32, torch.bfloat16, torch.float64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert [x.dtype for x in kernel_inputs(*_qkv())] == [torch.bfloat16] * 3
        doubles = _qkv(dtypes=(torch.float64,) * 3)
        assert [x.dtype for x in kernel_inputs(*doubles)] == [torch.float64] * 3  # float64 is not cast
        with pytest.raises(AttentionDtypeError, match="float64"):
            kernel_inputs(f32, bf16, f64)
    same = _qkv(dtypes=(torch.float32,) * 3)
    assert all(a is b for a, b in zip(kernel_inputs(*same), same))  # nothing to do: the same tensors


def test_mixed_dtypes_outside_autocast_are_refused():
    q, k, v = _qkv()
    with pytest.raises(
        AttentionDtypeError, match=r"q in torch.float32, k in torch.float32 and v in torch.bfloat16"
    ):
        attention(q, k, v)
    layouts = ring_layouts([12], 2)
    parts = [zigzag_shard(x, layouts) for x in (q, k, v)]
    with pytest.raises(AttentionDtypeError, match="torch.autocast"):
        loopback_ring_attention(*parts, layouts)


def test_a_ring_under_autocast_sends_and_computes_in_the_autocast_dtype():
    from lightning_bytescale.packed_attention.loopback import Mailboxes

    seq_lens = [12]
    q, k, v = _qkv()
    layouts = ring_layouts(seq_lens, 2)
    parts = [zigzag_shard(x, layouts) for x in (q, k, v)]
    mail = Mailboxes()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = loopback_ring_attention(*parts, layouts, mailboxes=mail)
        with attention_context(AttentionLayout((0, 12), (12,))):
            local = attention(q, k, v)
    assert all(o.dtype == torch.bfloat16 for o in outs)
    slots = sum(lay.num_slots for lay in layouts)
    assert mail.bytes_sent == 2 * slots * 2 * 8 * 2  # one [2, T_m, Hkv, D] bf16 block per member
    err = (zigzag_unshard(outs, layouts).float() - local.float()).abs().max()
    assert err <= 2e-2  # bf16 ring (merges in float32) against bf16 local attention
