"""Varlen block attention kernels that return the log-sum-exp, the building block of ring attention.

A ring member computes attention of its queries against one key/value block at a time and
merges the partial results by log-sum-exp; backward recomputes each block from the merged
output and log-sum-exp.  A *varlen block* packs several sequences: query rows split by
``q_seg`` and key rows split by ``k_seg`` (:class:`~.segments.Segments`), sequence ``j``'s
queries attending to sequence ``j``'s keys only.  Every kernel has one interface:

* ``forward(q, k, v, q_seg, k_seg, causal, scale) -> (out [Tq, H, D], lse [H, Tq])``;
* ``backward(dout, q, k, v, out, lse, q_seg, k_seg, causal, scale) -> (dq, dk, dv)``, given the
  *merged* output and log-sum-exp of the query rows.

Kernels (see :data:`KERNELS`; ``docs/attention.md`` has the table):

* ``cpu``: PyTorch's fused CPU flash kernel, any float dtype (the CPU default): one call per
  group of sequences with the same query and key lengths (:mod:`.block_groups`), one call per
  sequence of a shape of its own;
* ``flash``: PyTorch's CUDA flash kernel, ``aten._flash_attention_forward/_backward`` in its
  varlen form, float16/bfloat16, sm80+, head size <= 256, one call per block;
* ``efficient``: PyTorch's CUDA memory-efficient kernel, ``aten._efficient_attention_forward/
  _backward`` in its varlen form, float16/bfloat16/float32, one call per block;
* ``flash_attn``: the flash-attn package (optional GPU extra), float16/bfloat16, one call per block;
* ``math``: matmul + softmax per sequence, any device and dtype.  It builds ``[H, Tq, Tk]``
  scores: it is the reference, and the CUDA kernel only for float64 (no fused CUDA kernel
  takes float64).

Tensors are packed ``[T, H, D]`` (queries) and ``[T, Hkv, D]`` (keys, values) with ``Hkv``
dividing ``H``; query head ``h`` reads key/value head ``h // (H // Hkv)``.  ``causal=True``
means each sequence's query rows and key rows cover the same positions (a diagonal block).
Every query row must see at least one key.  Log-sum-exps are ``[H, Tq]`` (the layout of
flash's varlen kernel; the others are converted to it).  Outputs may be in the input dtype;
merges run in the accumulation dtype: float64 for float64, float32 otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lightning_bytescale.errors import ConfigError
from lightning_bytescale.packed_attention import cuda_kernels
from lightning_bytescale.packed_attention.block_groups import (
    BlockGroups,
    batch_rows,
    check_block,
    gather_batch,
    gather_lse,
    scatter_batch,
    scatter_lse,
    shape_groups,
)
from lightning_bytescale.packed_attention.gqa import expand_kv, reduce_kv
from lightning_bytescale.packed_attention.segments import Rows, Segments

_CPU_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
HALF = frozenset({torch.float16, torch.bfloat16})


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for merges: float64 stays float64, everything else uses float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[T, H, D]`` -> ``[1, H, T, D]``."""
    return x.transpose(0, 1).unsqueeze(0)


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """``[1, H, T, D]`` -> ``[T, H, D]``."""
    return x.squeeze(0).transpose(0, 1)


def _pairs(q_seg: Segments, k_seg: Segments, causal: bool) -> list[tuple[slice, slice]]:
    check_block(q_seg, k_seg, causal)
    return [(slice(*a), slice(*b)) for a, b in zip(q_seg.bounds, k_seg.bounds) if a[1] > a[0]]


def _per_sequence_forward(one: Callable) -> Callable:
    """A varlen forward from a one-sequence forward: loop over the sequences, concatenate."""

    def forward(q, k, v, q_seg, k_seg, causal, scale):
        parts = [one(q[qs], k[ks], v[ks], causal, scale) for qs, ks in _pairs(q_seg, k_seg, causal)]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts], dim=1)

    return forward


def _per_sequence_backward(one: Callable) -> Callable:
    """A varlen backward from a one-sequence backward: key gradients land in their own rows."""

    def backward(dout, q, k, v, out, lse, q_seg, k_seg, causal, scale):
        pairs = _pairs(q_seg, k_seg, causal)
        if len(pairs) == 1 and pairs[0][0] == slice(0, q.shape[0]) and pairs[0][1] == slice(0, k.shape[0]):
            return one(dout, q, k, v, out, lse, causal, scale)
        dq = torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
        dk = torch.zeros(k.shape, dtype=dq.dtype, device=k.device)
        dv = torch.zeros(v.shape, dtype=dq.dtype, device=v.device)
        for qs, ks in pairs:
            a, b, c = one(dout[qs], q[qs], k[ks], v[ks], out[qs], lse[:, qs], causal, scale)
            dq[qs], dk[ks], dv[ks] = a, b, c
        return dq, dk, dv

    return backward


# ----------------------------------------------------------------------------- cpu
def _cpu_forward_one(q, k, v, causal, scale):
    groups = q.shape[1] // k.shape[1]
    out, lse = _CPU_FWD(
        _heads_first(q),
        _heads_first(expand_kv(k, groups)),
        _heads_first(expand_kv(v, groups)),
        0.0,
        causal,
        scale=scale,
    )
    return _tokens_first(out), lse.squeeze(0)


def _cpu_backward_one(dout, q, k, v, out, lse, causal, scale):
    groups = q.shape[1] // k.shape[1]
    acc = acc_dtype(q.dtype)
    dq, dk, dv = _CPU_BWD(
        _heads_first(dout.to(q.dtype)).contiguous(),
        _heads_first(q),
        _heads_first(expand_kv(k, groups)),
        _heads_first(expand_kv(v, groups)),
        _heads_first(out.to(q.dtype)),
        lse.unsqueeze(0).to(acc).contiguous(),
        0.0,
        causal,
        scale=scale,
    )
    return (
        _tokens_first(dq).to(acc),
        reduce_kv(_tokens_first(dk).to(acc), groups),
        reduce_kv(_tokens_first(dv).to(acc), groups),
    )


def _cpu_forward(q, k, v, q_seg, k_seg, causal, scale):
    """The ``cpu`` varlen forward: one call per shape group (:mod:`.block_groups`), per single sequence."""
    blocks = shape_groups(q_seg, k_seg, causal)
    if not blocks.groups:
        return _per_sequence_cpu_forward(q, k, v, q_seg, k_seg, causal, scale)
    _check_covered(blocks, q)
    heads, groups = q.shape[1], q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((heads, q.shape[0]), dtype=acc_dtype(q.dtype), device=q.device)
    for qs, ks in blocks.singles:
        o, lb = _cpu_forward_one(q[qs], k[ks], v[ks], causal, scale)
        out[qs], lse[:, qs] = o, lb
    for g in blocks.groups:
        o, lb = _CPU_FWD(
            gather_batch(q, g.q_index, g.count, g.q_len),
            gather_batch(k, g.k_index, g.count, g.k_len, groups),
            gather_batch(v, g.k_index, g.count, g.k_len, groups),
            0.0,
            causal,
            scale=scale,
        )
        scatter_batch(out, g.q_index, o)
        scatter_lse(lse, g.q_index, lb)
    return out, lse


def _cpu_backward(dout, q, k, v, out, lse, q_seg, k_seg, causal, scale):
    """The ``cpu`` varlen backward, batched like :func:`_cpu_forward`."""
    blocks = shape_groups(q_seg, k_seg, causal)
    if not blocks.groups:
        return _per_sequence_cpu_backward(dout, q, k, v, out, lse, q_seg, k_seg, causal, scale)
    _check_covered(blocks, q)
    groups, acc = q.shape[1] // k.shape[1], acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for qs, ks in blocks.singles:
        a, b, c = _cpu_backward_one(dout[qs], q[qs], k[ks], v[ks], out[qs], lse[:, qs], causal, scale)
        dq[qs], dk[ks], dv[ks] = a, b, c
    for g in blocks.groups:
        dqb, dkb, dvb = _CPU_BWD(
            gather_batch(dout, g.q_index, g.count, g.q_len).to(q.dtype).contiguous(),
            gather_batch(q, g.q_index, g.count, g.q_len),
            gather_batch(k, g.k_index, g.count, g.k_len, groups),
            gather_batch(v, g.k_index, g.count, g.k_len, groups),
            gather_batch(out, g.q_index, g.count, g.q_len).to(q.dtype),
            gather_lse(lse, g.q_index, g.count, g.q_len).to(acc).contiguous(),
            0.0,
            causal,
            scale=scale,
        )
        scatter_batch(dq, g.q_index, dqb)
        for target, wide in ((dk, dkb), (dv, dvb)):  # summed back onto the key/value heads
            target.index_copy_(0, g.k_index, reduce_kv(batch_rows(wide).to(acc), groups))
    return dq, dk, dv


def _check_covered(blocks: BlockGroups, q: torch.Tensor) -> None:
    if blocks.q_rows != q.shape[0]:
        raise ValueError(f"the block's query sequences cover {blocks.q_rows} rows but q has {q.shape[0]}")


_per_sequence_cpu_forward = _per_sequence_forward(_cpu_forward_one)
_per_sequence_cpu_backward = _per_sequence_backward(_cpu_backward_one)


# ----------------------------------------------------------------------------- math
def _scores(q, k, causal, scale):
    """``[H, Tq, Tk]`` scaled scores in the accumulation dtype, causally masked when asked."""
    acc = acc_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1).to(acc)
    kh = expand_kv(k, groups).transpose(0, 1).to(acc)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _math_forward_one(q, k, v, causal, scale):
    groups = q.shape[1] // k.shape[1]
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # [H, Tq]
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.matmul(p, expand_kv(v, groups).transpose(0, 1).to(s.dtype))  # [H, Tq, D]
    return out.transpose(0, 1), lse


def _math_backward_one(dout, q, k, v, out, lse, causal, scale):
    groups = q.shape[1] // k.shape[1]
    s = _scores(q, k, causal, scale)
    acc = s.dtype
    qh = q.transpose(0, 1).to(acc)
    kh = expand_kv(k, groups).transpose(0, 1).to(acc)
    vh = expand_kv(v, groups).transpose(0, 1).to(acc)
    doh = dout.transpose(0, 1).to(acc)
    oh = out.transpose(0, 1).to(acc)
    p = torch.exp(s - lse.to(acc).unsqueeze(-1))  # [H, Tq, Tk]
    dvh = torch.matmul(p.transpose(-1, -2), doh)
    dp = torch.matmul(doh, vh.transpose(-1, -2))
    delta = (doh * oh).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta)
    dqh = torch.matmul(ds, kh) * scale
    dkh = torch.matmul(ds.transpose(-1, -2), qh) * scale
    return (
        dqh.transpose(0, 1),
        reduce_kv(dkh.transpose(0, 1), groups),
        reduce_kv(dvh.transpose(0, 1), groups),
    )


# ----------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class BlockKernel:
    """One block kernel: its functions and what it runs on."""

    name: str
    forward: Callable
    backward: Callable
    device_types: frozenset[str]
    dtypes: frozenset[torch.dtype]
    max_head_dim: int | None = None
    # runtime check on a device of a supported type (build flags, compute capability, package)
    available: Callable[[torch.device], bool] = field(default=lambda device: True)

    def unsupported(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """Why this kernel cannot run these tensors, or None when it can.

        ``meta`` tensors pass every device check: they run the ops' shape functions only.
        """
        if device.type != "meta" and device.type not in self.device_types:
            return f"it runs on {'/'.join(sorted(self.device_types))}, not {device.type}"
        if dtype not in self.dtypes:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.dtypes))
            return f"it takes {names}, not {str(dtype).removeprefix('torch.')}"
        if self.max_head_dim is not None and head_dim > self.max_head_dim:
            return f"it takes head sizes up to {self.max_head_dim}, not {head_dim}"
        if device.type != "meta" and not self.available(device):
            return "it is not available here (" + cuda_kernels.why_unavailable(self.name, device) + ")"
        return None


KERNELS: dict[str, BlockKernel] = {
    "cpu": BlockKernel(
        "cpu",
        _cpu_forward,
        _cpu_backward,
        frozenset({"cpu"}),
        FLOATS,
    ),
    "math": BlockKernel(
        "math",
        _per_sequence_forward(_math_forward_one),
        _per_sequence_backward(_math_backward_one),
        frozenset({"cpu", "cuda"}),
        FLOATS,
    ),
    "flash": BlockKernel(
        "flash",
        cuda_kernels.flash_forward,
        cuda_kernels.flash_backward,
        frozenset({"cuda"}),
        HALF,
        max_head_dim=256,
        available=cuda_kernels.torch_flash_available,
    ),
    "efficient": BlockKernel(
        "efficient",
        cuda_kernels.efficient_forward,
        cuda_kernels.efficient_backward,
        frozenset({"cuda"}),
        HALF | {torch.float32},
        available=cuda_kernels.torch_efficient_available,
    ),
    "flash_attn": BlockKernel(
        "flash_attn",
        cuda_kernels.flash_attn_forward,
        cuda_kernels.flash_attn_backward,
        frozenset({"cuda"}),
        HALF,
        max_head_dim=256,
        available=cuda_kernels.flash_attn_available,
    ),
}

# preference order on CUDA; the first that supports the tensors wins
CUDA_PREFERENCE = ("flash_attn", "flash", "efficient", "math")


def select_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The kernel a ring block uses by default: ``cpu`` on CPU, the fastest fused kernel on CUDA.

    On CUDA: flash-attn when installed, else PyTorch's flash kernel for float16/bfloat16,
    the memory-efficient kernel for float32 (and half types where flash cannot run), and
    ``math`` for float64 (or where no fused kernel applies).
    """
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        return "math"
    for name in CUDA_PREFERENCE:
        if KERNELS[name].unsupported(device, dtype, head_dim) is None:
            return name
    return "math"


def resolve_kernel(impl: str | None, q: torch.Tensor) -> BlockKernel:
    """The kernel ``impl`` names (``None``: :func:`select_kernel`), checked against ``q``."""
    name = impl or select_kernel(q.device, q.dtype, q.shape[-1])
    kernel = KERNELS.get(name)
    if kernel is None:
        raise ConfigError(
            f"unknown attention kernel {name!r}; use one of {sorted(KERNELS)} or None (automatic)"
        )
    why = kernel.unsupported(q.device, q.dtype, q.shape[-1])
    if why is not None:
        raise ConfigError(
            f"attention kernel {name!r} cannot run {str(q.dtype).removeprefix('torch.')} tensors "
            f"with head size {q.shape[-1]} on {q.device}: {why}; pass impl=None to pick one that can"
        )
    return kernel


def _whole(x: torch.Tensor, seg: Segments | None) -> Segments:
    return Segments.of([x.shape[0]]) if seg is None else seg


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    impl: str | None = None,
    q_seg: Segments | None = None,
    k_seg: Segments | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` against one key/value block: ``(out [Tq, H, D], lse [H, Tq])``.

    ``q_seg`` / ``k_seg`` split the rows into sequences (default: one sequence each).
    ``out`` is in the input dtype or wider; ``lse`` is float32, or float64 for float64 input.
    """
    kernel = resolve_kernel(impl, q)
    return kernel.forward(q, k, v, _whole(q, q_seg), _whole(k, k_seg), causal, scale)


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    impl: str | None = None,
    q_seg: Segments | None = None,
    k_seg: Segments | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block, given the *merged* output and log-sum-exp of the query rows.

    Returns ``(dq [Tq, H, D], dk [Tk, Hkv, D], dv [Tk, Hkv, D])`` in the input dtype or wider;
    summing them over all blocks gives the gradients of the full attention.
    """
    kernel = resolve_kernel(impl, q)
    return kernel.backward(dout, q, k, v, out, lse, _whole(q, q_seg), _whole(k, k_seg), causal, scale)


def merge_into(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor
) -> None:
    """Merge a block result into running ``(out [T, H, D], lse [H, T])`` accumulators in place.

    ``out_acc`` becomes ``w * out_blk + (1 - w) * out_acc`` with ``w = exp(lse_blk - new_lse)``:
    one fused ``lerp`` over the output, the rest on ``[H, T]``.  ``lse_acc`` rows may be ``-inf``
    (nothing merged yet, ``out_acc`` finite); ``lse_blk`` rows must be finite.
    """
    new_lse = torch.logaddexp(lse_acc, lse_blk.to(lse_acc.dtype))
    weight = torch.exp(lse_blk.to(lse_acc.dtype) - new_lse).transpose(0, 1).unsqueeze(-1)  # [T, H, 1]
    out_acc.lerp_(out_blk.to(out_acc.dtype), weight)
    lse_acc.copy_(new_lse)


def merge_rows(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, rows: Rows, out_blk: torch.Tensor, lse_blk: torch.Tensor
) -> None:
    """:func:`merge_into` on ``rows`` of the accumulators (in place on a range, gather-scatter on an index)."""
    if rows.index is None:
        merge_into(rows.take(out_acc), rows.take(lse_acc, dim=1), out_blk, lse_blk)
        return
    sub_out, sub_lse = rows.take(out_acc), rows.take(lse_acc, dim=1)
    merge_into(sub_out, sub_lse, out_blk, lse_blk)
    rows.put_(out_acc, sub_out)
    rows.put_(lse_acc, sub_lse, dim=1)
