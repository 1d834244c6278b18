"""Zigzag ring attention for sequences sharded over a ring of ranks.

Each member holds, for every sequence ``j`` of the ring item, ``2 c_j`` slots: zigzag chunk
``i`` (its own member index) then chunk ``2N - 1 - i``.  Forward passes the packed key/value
block around the ring (``N - 1`` transfers) and merges each step's partial result by
log-sum-exp in the accumulation dtype.  For query member ``i`` and the key/value block of
member ``r``, causality leaves per sequence:

* ``r == i``: the member's own slots, a causal block (its positions increase along the slots);
* ``r < i``: all query slots against the first key chunk (chunk ``r``), fully visible;
* ``r > i``: the second query chunk (chunk ``2N-1-i``) against all key slots, fully visible.

All other chunk pairs are fully masked and skipped, so every member does the same work on
every step.  Padding slots (positions ``>= s_j``, at the sequence end) are only visible to
padding queries by causality; their outputs are defined as zero and contribute no gradient.
Backward sends the key/value blocks around again and passes the key/value gradients along
one step behind, so after ``N`` hops each member holds the gradients of its own keys and
values.  The next block's transfer is posted before the current block is computed, so the
backend's asynchronous P2P (gloo runs it in its own threads) overlaps compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_bytescale.attention import kernels
from lightning_bytescale.attention.comm import Transfer
from lightning_bytescale.attention.layout import AttentionLayout
from lightning_bytescale.planner import zigzag

_TAG_KV = 7301
_TAG_DKV = 7302

_OVERLAP = True
_LAST_SETUP: dict[tuple, RingSetup] = {}


def set_overlap(enabled: bool) -> bool:
    """Post transfers before compute (default) or after it (for measuring the overlap).

    Returns the previous setting.
    """
    global _OVERLAP
    previous, _OVERLAP = _OVERLAP, bool(enabled)
    return previous


class RingLayoutError(ValueError):
    """The layout does not match the tensors or this rank's place in the ring."""


@dataclass(frozen=True)
class RingSetup:
    """What one member needs to run a ring item."""

    ranks: tuple[int, ...]
    member: int
    seqs: tuple[tuple[int, int], ...]  # (first slot, chunk size c_j) of every sequence
    valid: torch.Tensor  # bool [T], False on padding slots
    group: Any = None
    # (tensor, dst, src, tag) -> object with wait() returning the received tensor; None = gloo/NCCL P2P.
    # A hook for in-process tests that run every member in its own thread.
    transport: Callable[[torch.Tensor, int, int, int], Any] | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.member + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.member - 1) % self.size]


def ring_setup(
    layout: AttentionLayout,
    num_slots: int,
    device: torch.device,
    group: Any = None,
    transport: Callable[[torch.Tensor, int, int, int], Any] | None = None,
) -> RingSetup:
    """Check ``layout`` against the tensors and this rank, and precompute the block plan.

    The last set-up is cached by content, so the layers of a model share one.  With a
    ``transport`` (in-process tests), ranks are the transport's and torch.distributed is not used.
    """
    if transport is not None:
        return dataclasses.replace(
            _build_setup(layout, num_slots, device, group, check_rank=False), transport=transport
        )
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1
    key = (
        tuple(layout.cu_seqlens.tolist()), tuple(layout.seq_lens), layout.ring, layout.member,
        num_slots, str(device), id(group), rank,
    )  # fmt: skip
    cached = _LAST_SETUP.get(key)
    if cached is not None:
        return cached
    setup = _build_setup(layout, num_slots, device, group)
    _LAST_SETUP.clear()
    _LAST_SETUP[key] = setup
    return setup


def _build_setup(
    layout: AttentionLayout, num_slots: int, device: torch.device, group: Any, check_rank: bool = True
) -> RingSetup:
    if layout.ring is None:
        raise RingLayoutError("ring attention needs a layout with a ring; local layouts use varlen attention")
    ranks = tuple(int(r) for r in layout.ring)
    n = len(ranks)
    if len(set(ranks)) != n:
        raise RingLayoutError(f"ring {ranks} lists a rank twice; each member must be a distinct global rank")
    if not 0 <= layout.member < n:
        raise RingLayoutError(f"member {layout.member} is outside the ring {ranks}")
    if n > 1 and check_rank:
        if not dist.is_available() or not dist.is_initialized():
            raise RingLayoutError(
                f"ring {ranks} needs torch.distributed; call init_process_group before running a sharded micro-batch"
            )
        rank = dist.get_rank()
        if ranks[layout.member] != rank:
            raise RingLayoutError(
                f"this process is global rank {rank} but the layout says it is member {layout.member} "
                f"(rank {ranks[layout.member]}) of ring {ranks}; build the layout for this rank"
            )
        if max(ranks) >= dist.get_world_size():
            raise RingLayoutError(f"ring {ranks} names a rank outside the world of {dist.get_world_size()}")
    cu = [int(x) for x in layout.cu_seqlens.tolist()]
    if len(cu) != len(layout.seq_lens) + 1 or cu[0] != 0:
        raise RingLayoutError(
            f"cu_seqlens {cu} does not match {len(layout.seq_lens)} sequences; it needs n + 1 entries from 0"
        )
    if cu[-1] != num_slots:
        raise RingLayoutError(f"layout covers {cu[-1]} slots but the tensors have {num_slots}")
    seqs = []
    for j, s in enumerate(layout.seq_lens):
        c = zigzag.chunk_size(int(s), n)
        if cu[j + 1] - cu[j] != 2 * c:
            raise RingLayoutError(
                f"sequence {j} (length {s}) has {cu[j + 1] - cu[j]} slots on this member; a ring of {n} "
                f"needs 2 * chunk_size = {2 * c} (zigzag chunks {layout.member} and {2 * n - 1 - layout.member})"
            )
        seqs.append((cu[j], c))
    valid = layout.valid().to(device)
    return RingSetup(ranks, layout.member, tuple(seqs), valid, group)


def _blocks(setup: RingSetup, src: int) -> list[tuple[slice, slice, bool]]:
    """(query slots, key slots, causal) of every block member ``setup.member`` computes vs ``src``."""
    out = []
    for a, c in setup.seqs:
        if src == setup.member:
            out.append((slice(a, a + 2 * c), slice(a, a + 2 * c), True))
        elif src < setup.member:
            out.append((slice(a, a + 2 * c), slice(a, a + c), False))
        else:
            out.append((slice(a + c, a + 2 * c), slice(a, a + 2 * c), False))
    return out


def _post(setup: RingSetup, tensor: torch.Tensor, tag: int) -> Any:
    if setup.transport is not None:
        return setup.transport(tensor, setup.next_rank, setup.prev_rank, tag)
    return Transfer(tensor, setup.next_rank, setup.prev_rank, tag, setup.group)


class ZigzagRingAttention(torch.autograd.Function):
    """Causal attention over zigzag-sharded packed sequences; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, setup: RingSetup, scale: float, impl: str | None):  # type: ignore[override]
        n, i = setup.size, setup.member
        acc = kernels.acc_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for t in range(n):
            src = (i - t) % n
            pending = _post(setup, kv, _TAG_KV) if t < n - 1 and _OVERLAP else None
            for qs, ks, causal in _blocks(setup, src):
                o_b, l_b = kernels.block_forward(
                    q[qs], kv[0, ks], kv[1, ks], causal=causal, scale=scale, impl=impl
                )
                kernels.merge_into(out[qs], lse[:, qs], o_b, l_b)
            if t < n - 1:
                kv = (pending or _post(setup, kv, _TAG_KV)).wait()
        out[~setup.valid] = 0
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.setup, ctx.scale, ctx.impl = setup, scale, impl
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        setup: RingSetup = ctx.setup
        n, i = setup.size, setup.member
        acc = kernels.acc_dtype(q.dtype)
        dout = dout.to(acc).masked_fill(~setup.valid.view(-1, 1, 1), 0)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        in_flight: Any = None
        dkv = None
        for t in range(n):
            src = (i - t) % n
            pending = _post(setup, kv, _TAG_KV) if t < n - 1 and _OVERLAP else None
            dkv = torch.zeros((2, *k.shape), dtype=acc, device=k.device)
            for qs, ks, causal in _blocks(setup, src):
                dq_b, dk_b, dv_b = kernels.block_backward(
                    dout[qs], q[qs], kv[0, ks], kv[1, ks], out[qs], lse[:, qs],
                    causal=causal, scale=ctx.scale, impl=ctx.impl,
                )  # fmt: skip
                dq[qs] += dq_b
                dkv[0, ks] += dk_b
                dkv[1, ks] += dv_b
            if in_flight is not None:
                dkv += in_flight.wait()
            if n > 1:
                in_flight = _post(setup, dkv, _TAG_DKV)
                if not _OVERLAP:
                    in_flight.wait()
            if t < n - 1:
                kv = (pending or _post(setup, kv, _TAG_KV)).wait()
        final = in_flight.wait() if in_flight is not None else dkv
        return dq.to(q.dtype), final[0].to(k.dtype), final[1].to(v.dtype), None, None, None


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
    """Zigzag ring attention of this member's slots; peers are the global ranks in ``layout.ring``."""
    setup = ring_setup(layout, q.shape[0], q.device, group)
    return ZigzagRingAttention.apply(q, k, v, setup, scale, impl)
