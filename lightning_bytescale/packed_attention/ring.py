"""Zigzag ring attention for sequences sharded over a ring of ranks.

Each member holds, for every sequence of the ring item, its two zigzag chunks
(:mod:`.ring_plan` has the layout and the three kinds of block).  Forward passes the packed
key/value block around the ring (``N - 1`` transfers) and merges each step's partial result
by log-sum-exp in the accumulation dtype; the first step is the member's own causal block,
which covers every row, so it initialises the accumulators.  Padding slots (positions
``>= s_j``, last in each sequence's slots on every member) are only visible to padding queries,
in the own block by causality, in the other blocks because they read real key rows only; their
outputs are defined as zero and contribute no gradient.  Backward sends the key/value blocks
around again and passes the key/value gradients along one step behind, so after ``N`` hops
each member holds the gradients of its own keys and values.  The next block's transfer is
posted before the current block is computed, so communication overlaps compute (gloo runs
P2P in its own threads; on CUDA transfers run on their own stream, see :mod:`.comm`).

One member's work is a *generator* (:func:`forward_steps`, :func:`backward_steps`) that
yields just before each wait for a transfer.  Over P2P the generator is simply run to the
end (:func:`run_steps`), each wait blocking on the network; the in-process loopback ring
(:mod:`.loopback`) runs all members' generators in lockstep in one thread.  Both run the
same code: only the sends and receives differ.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch

from lightning_bytescale.packed_attention import kernels
from lightning_bytescale.packed_attention.comm import Transfer
from lightning_bytescale.packed_attention.input_dtype import kernel_inputs
from lightning_bytescale.packed_attention.layout import AttentionLayout
from lightning_bytescale.packed_attention.ring_plan import RingLayoutError, RingSetup, ring_setup

__all__ = [
    "RingLayoutError",
    "RingSetup",
    "ZigzagRingAttention",
    "backward_steps",
    "forward_steps",
    "ring_attention",
    "ring_setup",
    "run_steps",
    "set_overlap",
]

_TAG_KV = 7301
_TAG_DKV = 7302

_OVERLAP = True

Steps = Generator[Any, None, Any]


def set_overlap(enabled: bool) -> bool:
    """Post transfers before compute (default) or after it (for measuring the overlap).

    Returns the previous setting.
    """
    global _OVERLAP
    previous, _OVERLAP = _OVERLAP, bool(enabled)
    return previous


def _post(setup: RingSetup, tensor: torch.Tensor, tag: int) -> Any:
    if setup.transport is not None:
        return setup.transport(tensor, setup.next_rank, setup.prev_rank, tag)
    return Transfer(tensor, setup.next_rank, setup.prev_rank, tag, setup.group)


def _await(transfer: Any) -> Steps:
    """Yield (the member would block here), then wait; evaluates to the received tensor."""
    if not getattr(transfer, "done", False):
        yield transfer
    return transfer.wait()


def run_steps(steps: Steps) -> Any:
    """Run one member's generator to its end (P2P: every wait blocks on the transport)."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def forward_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    setup: RingSetup,
    scale: float,
    kernel: kernels.BlockKernel,
) -> Steps:
    """One member's forward; evaluates to ``(out [T, H, D], lse [H, T])`` in the accumulation dtype."""
    n, i = setup.size, setup.member
    acc = kernels.acc_dtype(q.dtype)
    kv = torch.stack([k, v])
    taken: dict[int, torch.Tensor] = {}  # query rows gathered once per distinct row set
    out = lse = None
    for t in range(n):
        src = (i - t) % n
        pending = _post(setup, kv, _TAG_KV) if t < n - 1 and _OVERLAP else None
        plan = setup.block(src)
        if plan is not None:
            rows = plan.q_rows
            if id(rows) not in taken:
                taken[id(rows)] = rows.take(q)
            o_b, l_b = kernel.forward(
                taken[id(rows)],
                plan.k_rows.take(kv[0]),
                plan.k_rows.take(kv[1]),
                plan.q_seg,
                plan.k_seg,
                plan.causal,
                scale,
            )
            if t == 0:  # the own causal block covers every row
                out, lse = o_b.to(acc).contiguous(), l_b.to(acc).contiguous()
            else:
                kernels.merge_rows(out, lse, rows, o_b, l_b)
        if t < n - 1:
            kv = yield from _await(pending or _post(setup, kv, _TAG_KV))
    assert out is not None and lse is not None
    out.masked_fill_(~setup.valid.view(-1, 1, 1), 0)
    return out, lse


def backward_steps(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    setup: RingSetup,
    scale: float,
    kernel: kernels.BlockKernel,
) -> Steps:
    """One member's backward; evaluates to ``(dq, dk, dv)`` in the dtypes of ``q, k, v``."""
    n, i = setup.size, setup.member
    acc = kernels.acc_dtype(q.dtype)
    dout = dout.to(q.dtype).masked_fill(~setup.valid.view(-1, 1, 1), 0)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    taken: dict[int, tuple[torch.Tensor, ...]] = {}  # query-side rows gathered once per row set
    in_flight: Any = None
    dkv = None
    for t in range(n):
        src = (i - t) % n
        pending = _post(setup, kv, _TAG_KV) if t < n - 1 and _OVERLAP else None
        plan = setup.block(src)
        dkv = torch.zeros((2, *k.shape), dtype=acc, device=k.device)
        if plan is not None:
            rows = plan.q_rows
            if id(rows) not in taken:
                taken[id(rows)] = (rows.take(dout), rows.take(q), rows.take(out), rows.take(lse, dim=1))
            d_b, q_b, o_b, l_b = taken[id(rows)]
            dq_b, dk_b, dv_b = kernel.backward(
                d_b, q_b, plan.k_rows.take(kv[0]), plan.k_rows.take(kv[1]), o_b, l_b,
                plan.q_seg, plan.k_seg, plan.causal, scale,
            )  # fmt: skip
            rows.add_(dq, dq_b)
            plan.k_rows.add_(dkv[0], dk_b)
            plan.k_rows.add_(dkv[1], dv_b)
        if in_flight is not None:
            dkv += yield from _await(in_flight)
        if n > 1:
            in_flight = _post(setup, dkv, _TAG_DKV)
            if not _OVERLAP:
                yield from _await(in_flight)
        if t < n - 1:
            kv = yield from _await(pending or _post(setup, kv, _TAG_KV))
    final = (yield from _await(in_flight)) if in_flight is not None else dkv
    assert final is not None
    return dq.to(q.dtype), final[0].to(k.dtype), final[1].to(v.dtype)


class ZigzagRingAttention(torch.autograd.Function):
    """Causal attention over zigzag-sharded packed sequences, one member per process."""

    @staticmethod
    def forward(ctx, q, k, v, setup: RingSetup, scale: float, impl: str | None):  # type: ignore[override]
        kernel = kernels.resolve_kernel(impl, q)
        out, lse = run_steps(forward_steps(q, k, v, setup, scale, kernel))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.setup, ctx.scale, ctx.kernel = setup, scale, kernel
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = run_steps(backward_steps(dout, q, k, v, out, lse, ctx.setup, ctx.scale, ctx.kernel))
        return dq, dk, dv, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: AttentionLayout,
    *,
    scale: float,
    group: Any = None,
    impl: str | None = None,
) -> torch.Tensor:
    """Zigzag ring attention of this member's slots; peers are the global ranks in ``layout.ring``.

    ``impl`` names the block kernel (:data:`.kernels.KERNELS`); ``None`` picks the fastest
    that can run these tensors (:func:`.kernels.select_kernel`).  q, k and v are brought to one
    dtype first (the autocast dtype under autocast, :func:`.input_dtype.kernel_inputs`), so the
    key/value blocks travel in the kernel's dtype.
    """
    q, k, v = kernel_inputs(q, k, v)
    setup = ring_setup(layout, q.shape[0], q.device, group)
    return ZigzagRingAttention.apply(q, k, v, setup, scale, impl)
