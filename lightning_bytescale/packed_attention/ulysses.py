"""Ulysses attention for a ring item: an all-to-all over its members splits heads instead of keys.

Each member holds its zigzag slots of the item's sequences (the slots a ring member holds, so
the plan, the loss and the micro-batches are the same in every mode).  One all-to-all gives
every member all tokens of its share of the heads (:func:`.ulysses_plan.head_split`), in
sequence order; it runs the same local variable-length kernel as a local micro-batch
(:func:`.local.varlen_attention`: flash or SDPA), and a second all-to-all takes the output back
to the members' slots.  Both exchanges are autograd functions whose backward is the reverse
exchange of the gradients, so the backward is exact: the output's gradient goes to the heads'
members, the kernel's backward runs there, and the gradients of q, k and v come back (those of
a key/value head that several members read are summed).

A hybrid item (``layout.mode == "hybrid"``) exchanges inside each group of ``ulysses_size``
consecutive members (the item's members on one node) and runs zigzag ring attention
(:class:`.ring.ZigzagRingAttention`) across the groups on each member's head share.

Communication: every exchange is one ``batch_isend_irecv`` on the global process group (or the
context's group), peers named by global ranks, with one send to and one receive from every
other member per tensor (:func:`p2p_exchange`, the only call of torch.distributed here); no
process group is created.  A member posts the same exchanges in the same order as the other
members of its item (they run the same code on the same layout), so NCCL's issue-order matching
pairs them, and items run in the plan's item order like rings.  On CUDA an exchange runs on the
ring's communication stream and the compute stream waits for it (:mod:`.comm`): no host
synchronisation.  Per member and micro-batch of a Ulysses item of ``N``: forward ``8 (N - 1)``
P2P operations in 2 batches (q, k, v out and in; the output back), backward the same.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import groupby
from typing import Any

import torch
import torch.distributed as dist

from lightning_bytescale.packed_attention.comm import count_exchange, hand_over, post_on_comm_stream
from lightning_bytescale.packed_attention.input_dtype import kernel_inputs
from lightning_bytescale.packed_attention.layout import AttentionLayout
from lightning_bytescale.packed_attention.local import varlen_attention
from lightning_bytescale.packed_attention.ring import ZigzagRingAttention
from lightning_bytescale.packed_attention.ulysses_plan import (
    Exchange,
    RingTransport,
    Transport,
    UlyssesHeadsError,
    UlyssesSetup,
    head_split,
    ulysses_setup,
)

__all__ = ["UlyssesHeadsError", "p2p_exchange", "ulysses_attention"]

_TAG_HEADS = 7311  # tokens -> heads: q, k, v forward; the output's gradient backward
_TAG_TOKENS = 7312  # heads -> tokens: the output forward; q, k and v's gradients backward

Ranges = tuple[tuple[int, int], ...]


def p2p_exchange(
    sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]], tag: int, group: Any
) -> list:
    """One ``batch_isend_irecv`` of every send ``(dst, tensor)`` and receive ``(src, buffer)``: Ulysses' only P2P call."""
    ops = [dist.P2POp(dist.isend, t, peer, group=group, tag=tag) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group=group, tag=tag) for peer, t in recvs]
    return dist.batch_isend_irecv(ops)


def _run(
    ex: Exchange, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], tag: int
) -> None:
    """Post one exchange and wait for it; the receive buffers are then ready on the current stream."""
    if not sends and not recvs:
        return
    start = time.perf_counter()
    if ex.transport is not None:
        ex.transport(sends, recvs, tag).wait()
    else:
        works = post_on_comm_stream([t for _, t in sends], lambda: p2p_exchange(sends, recvs, tag, ex.group))
        hand_over([t for _, t in recvs], lambda: [w.wait() for w in works])
    count_exchange(
        len(sends) + len(recvs),
        sum(t.numel() * t.element_size() for _, t in sends),
        sum(t.numel() * t.element_size() for _, t in recvs),
        time.perf_counter() - start,
        ulysses=True,
    )


def _even(ranges: Ranges) -> bool:
    """True when the ranges cut the heads into equal consecutive blocks, member by member."""
    width = ranges[0][1] - ranges[0][0]
    return all(r == (m * width, (m + 1) * width) for m, r in enumerate(ranges))


def _pair(
    ex: Exchange, parts: Sequence[torch.Tensor], got: Sequence[torch.Tensor], sends: list, recvs: list
) -> None:
    """Member ``m``'s part goes to member ``m`` and its answer lands in ``got[m]``; this member's own part is a copy."""
    for m, peer in enumerate(ex.peers):
        if m == ex.member:
            got[m].copy_(parts[m])
        else:
            sends.append((peer, parts[m]))
            recvs.append((peer, got[m]))


def to_heads(
    ex: Exchange, tensors: Sequence[torch.Tensor], ranges: Sequence[Ranges], tag: int
) -> list[torch.Tensor]:
    """Tokens to heads: member ``m`` receives heads ``ranges[t][m]`` of every member's slots of ``tensors[t]``.

    Returns one ``[S, w, D]`` tensor per input (``w`` this member's heads of it), the rows in
    sequence order (``ex.rows``).
    """
    n, me, slots = ex.size, ex.member, ex.slots
    sends, recvs, stacked = [], [], []
    for x, rng in zip(tensors, ranges):
        a, b = rng[me]
        got = x.new_empty((n, slots, b - a, x.shape[-1]))
        if _even(rng):  # one copy, member-major: [N, T, w, D]
            parts = x.unflatten(1, (n, b - a)).transpose(0, 1).contiguous()
        else:  # each member's (possibly overlapping) key/value heads
            parts = [x[:, lo:hi].contiguous() for lo, hi in rng]
        _pair(ex, parts, got, sends, recvs)
        stacked.append(got)
    _run(ex, sends, recvs, tag)
    return [got.view(n * slots, *got.shape[2:]).index_select(0, ex.rows) for got in stacked]


def to_tokens(
    ex: Exchange,
    tensors: Sequence[torch.Tensor],
    ranges: Sequence[Ranges],
    shapes: Sequence[torch.Size],
    tag: int,
) -> list[torch.Tensor]:
    """Heads to tokens, the adjoint of :func:`to_heads`: ``[S, w, D]`` per tensor back to ``shapes`` ``[T, H, D]``.

    Rows the exchange does not reach (padding slots) are zero; heads that several members hold
    (replicated key/value heads) are summed over them.
    """
    n, slots = ex.size, ex.slots
    sends, recvs, pending = [], [], []
    for y, rng, shape in zip(tensors, ranges, shapes):
        width, dim = y.shape[1], y.shape[-1]
        mine = y.new_zeros((n * slots, width, dim)).index_copy_(0, ex.rows, y).view(n, slots, width, dim)
        even = _even(rng)
        got = (
            y.new_empty((n, slots, width, dim))
            if even
            else [y.new_empty((slots, hi - lo, dim)) for lo, hi in rng]
        )
        _pair(ex, mine, got, sends, recvs)
        pending.append((got, rng, shape, even))
    _run(ex, sends, recvs, tag)
    out = []
    for got, rng, shape, even in pending:
        if even:
            out.append(got.transpose(0, 1).reshape(shape))
            continue
        x = got[0].new_zeros(shape)
        for (lo, hi), part in zip(rng, got):
            x.narrow(1, lo, hi - lo).add_(part)
        out.append(x)
    return out


class _TokensToHeads(torch.autograd.Function):
    """:func:`to_heads` of q, k and v; its backward is :func:`to_tokens` of their gradients."""

    @staticmethod
    def forward(ctx, ex: Exchange, ranges: tuple[Ranges, ...], *tensors: torch.Tensor):  # type: ignore[override]
        ctx.ex, ctx.ranges, ctx.shapes = ex, ranges, [x.shape for x in tensors]
        return tuple(to_heads(ex, tensors, ranges, _TAG_HEADS))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        return (None, None, *to_tokens(ctx.ex, grads, ctx.ranges, ctx.shapes, _TAG_TOKENS))


class _HeadsToTokens(torch.autograd.Function):
    """:func:`to_tokens` of the output; its backward is :func:`to_heads` of the output's gradient."""

    @staticmethod
    def forward(ctx, ex: Exchange, ranges: Ranges, shape: torch.Size, y: torch.Tensor):  # type: ignore[override]
        ctx.ex, ctx.ranges = ex, ranges
        return to_tokens(ex, [y], [ranges], [shape], _TAG_TOKENS)[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return None, None, None, to_heads(ctx.ex, [grad], [ctx.ranges], _TAG_HEADS)[0]


def _expand_kv(x: torch.Tensor, heads: tuple[int, ...]) -> torch.Tensor:
    """``x[:, heads]`` for a non-decreasing head list, from expanded views (no index tensor on the device)."""
    runs = [(h, len(list(run))) for h, run in groupby(heads)]
    return torch.cat([x[:, h : h + 1].expand(-1, count, -1) for h, count in runs], dim=1)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: AttentionLayout,
    *,
    scale: float,
    group: Any = None,
    transport: Transport | None = None,
    ring_transport: RingTransport | None = None,
) -> torch.Tensor:
    """Ulysses (or hybrid) attention of this member's zigzag slots; peers are the global ranks in ``layout.ring``.

    ``transport`` / ``ring_transport`` replace the P2P exchanges (in-process members, tests).
    Raises :class:`UlyssesHeadsError`, before any exchange, when the members cannot split the heads.
    """
    q, k, v = kernel_inputs(q, k, v)
    setup: UlyssesSetup = ulysses_setup(layout, q.shape[0], q.device, group, transport, ring_transport)
    ex = setup.exchange
    split = head_split(q.shape[1], k.shape[1], ex.size)
    qh, kh, vh = _TokensToHeads.apply(ex, (split.q, split.kv, split.kv), q, k, v)
    expand = split.expand[ex.member]
    if expand is not None:
        kh, vh = _expand_kv(kh, expand), _expand_kv(vh, expand)
    if setup.ring is None:
        out = varlen_attention(qh, kh, vh, setup.seq_lens, scale=scale)
    else:
        out = ZigzagRingAttention.apply(qh, kh, vh, setup.ring, scale, None)
    return _HeadsToTokens.apply(ex, split.q, q.shape, out)
