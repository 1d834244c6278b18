"""One ring member's set-up: the layout checked against the tensors and rank, and its block plans.

Member ``i`` of a ring of ``N`` holds, for every sequence ``j`` of the ring item, ``2 c_j``
slots: zigzag chunk ``i`` then chunk ``2N - 1 - i``.  Against the key/value block of member
``r``, causality leaves three kinds of block, the same for every ``r`` of a kind, so they are
planned once per layout (:class:`BlockPlan`, one varlen kernel call each):

* ``own`` (``r == i``): all query slots against all key slots, causal per sequence;
* ``earlier`` (``r < i``): all query slots against each sequence's first key chunk;
* ``later`` (``r > i``): each sequence's second query chunk against all key slots.

Set-ups are cached by content, so the layers of a model share one (and its device tensors).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_bytescale.errors import ByteScaleError
from lightning_bytescale.packed_attention.layout import AttentionLayout
from lightning_bytescale.packed_attention.segments import Rows, Segments, to_device
from lightning_bytescale.planner import zigzag

_LAST_SETUP: dict[tuple, RingSetup] = {}


class RingLayoutError(ByteScaleError, ValueError):
    """The layout does not match the tensors or this rank's place in the ring."""


@dataclass(frozen=True)
class BlockPlan:
    """The rows one kind of ring block reads, split into sequences for a varlen kernel."""

    q_rows: Rows
    k_rows: Rows
    q_seg: Segments
    k_seg: Segments
    causal: bool


@dataclass(frozen=True)
class RingSetup:
    """What one member needs to run a ring item."""

    ranks: tuple[int, ...]
    member: int
    seqs: tuple[tuple[int, int], ...]  # (first slot, chunk size c_j) of every sequence
    valid: torch.Tensor  # bool [T] on the tensors' device, False on padding slots
    group: Any = None
    # (tensor, dst, src, tag) -> object with wait() returning the received tensor; None = gloo/NCCL P2P.
    # In-process rings (threads, or the single-thread loopback) replace the sends and receives here.
    transport: Callable[[torch.Tensor, int, int, int], Any] | None = None
    own: BlockPlan | None = None
    earlier: BlockPlan | None = None
    later: BlockPlan | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.member + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.member - 1) % self.size]

    def block(self, src: int) -> BlockPlan:
        """The block this member computes against member ``src``'s keys and values."""
        plan = self.own if src == self.member else self.earlier if src < self.member else self.later
        assert plan is not None
        return plan


def ring_setup(
    layout: AttentionLayout,
    num_slots: int,
    device: torch.device,
    group: Any = None,
    transport: Callable[[torch.Tensor, int, int, int], Any] | None = None,
) -> RingSetup:
    """Check ``layout`` against the tensors and this rank, and precompute the block plans.

    The last set-up is cached by content, so the layers of a model share one.  With a
    ``transport`` (in-process rings), ranks are the transport's and torch.distributed is not used.
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


def _check_rank(ranks: tuple[int, ...], member: int) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RingLayoutError(
            f"ring {ranks} needs torch.distributed; call init_process_group before running a sharded micro-batch"
        )
    rank = dist.get_rank()
    if ranks[member] != rank:
        raise RingLayoutError(
            f"this process is global rank {rank} but the layout says it is member {member} "
            f"(rank {ranks[member]}) of ring {ranks}; build the layout for this rank"
        )
    if max(ranks) >= dist.get_world_size():
        raise RingLayoutError(f"ring {ranks} names a rank outside the world of {dist.get_world_size()}")


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
        _check_rank(ranks, layout.member)
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
    valid = to_device(layout.valid(), device)
    whole, both = Rows(0, num_slots), Segments.of([2 * c for _, c in seqs])
    halves = Segments.of([c for _, c in seqs])
    own = BlockPlan(whole, whole, both, both, causal=True)
    earlier = BlockPlan(whole, Rows.of([(a, a + c) for a, c in seqs]), both, halves, causal=False)
    later = BlockPlan(Rows.of([(a + c, a + 2 * c) for a, c in seqs]), whole, halves, both, causal=False)
    return RingSetup(ranks, layout.member, tuple(seqs), valid, group, None, own, earlier, later)
