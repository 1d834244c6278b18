"""One ring member's set-up: the layout checked against the tensors and rank, and its block plans.

Member ``i`` of a ring of ``N`` holds, for every sequence ``j`` of the ring item, ``2 c_j``
slots: the real tokens of zigzag chunk ``i`` (``f_i`` of them), then those of chunk
``2N - 1 - i`` (``g_i``), then its padding (:mod:`lightning_bytescale.planner.zigzag`: every chunk
holds ``floor`` or ``ceil`` of ``s_j / 2N`` tokens, so ``f``, ``g`` and the padding depend on the
member).  Against the key/value block of member ``r``, causality leaves three kinds of block:

* ``own`` (``r == i``): all query slots against all key slots, causal per sequence by slot
  order (padding is last, so only padding queries see padding keys);
* ``earlier`` (``r < i``): the query slots of every sequence in which member ``i`` holds a real
  token against member ``r``'s first chunk, its first ``f_r`` slots;
* ``later`` (``r > i``): member ``i``'s second chunk, slots ``f_i .. f_i + g_i``, against member
  ``r``'s real slots, its first ``f_r + g_r``.

Only real key rows are read outside the own block, so no real query ever sees a padding key.
The plans of ``earlier`` and ``later`` blocks depend on the source member through ``f_r`` and
``g_r``; a set-up holds one per source (:class:`BlockPlan`, one varlen kernel call each), equal
plans shared, and sequences with no query or no key row left out of a block (a block with none
is ``None``: nothing to compute).  Set-ups are cached by content, so the layers of a model share
one (and its device tensors).  Everything here is host work on the layout's host metadata; the
device tensors (valid mask, offsets, gather indices) are copied once per set-up from pinned memory
without a host synchronisation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
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
    blocks: tuple[BlockPlan | None, ...] = ()  # by source member; blocks[member] is the own block

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.member + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.member - 1) % self.size]

    @property
    def own(self) -> BlockPlan:
        plan = self.blocks[self.member]
        assert plan is not None
        return plan

    def block(self, src: int) -> BlockPlan | None:
        """The block this member computes against member ``src``'s keys and values (``None``: nothing)."""
        return self.blocks[src]


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
    key = setup_key(layout, num_slots, device, group)
    cached = _LAST_SETUP.get(key)
    if cached is not None:
        return cached
    setup = _build_setup(layout, num_slots, device, group)
    _LAST_SETUP.clear()
    _LAST_SETUP[key] = setup
    return setup


def setup_key(layout: AttentionLayout, num_slots: int, device: torch.device, group: Any) -> tuple:
    """The content a member's set-up depends on: the layout, the tensors' slots and device, the group and rank.

    Host ints only (the layout holds no tensor), so the key costs no host-device synchronisation.
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1
    return (
        layout.cu_seqlens,
        layout.seq_lens,
        layout.ring,
        layout.member,
        layout.mode,
        layout.ulysses_size,
        num_slots,
        str(device),
        id(group),
        rank,
    )


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


def check_layout(
    layout: AttentionLayout, num_slots: int, check_rank: bool = True
) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    """Check a sharded layout against the tensors' ``num_slots`` and this process's global rank.

    Returns the ring's global ranks and ``(first slot, chunk size c)`` of every sequence.
    Shared by every mode of a ring item (:mod:`.ulysses` holds the same zigzag slots).
    """
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
    cu = list(layout.cu_seqlens)
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
    return ranks, seqs


def _build_setup(
    layout: AttentionLayout, num_slots: int, device: torch.device, group: Any, check_rank: bool = True
) -> RingSetup:
    ranks, seqs = check_layout(layout, num_slots, check_rank)
    n = len(ranks)
    valid = to_device(layout.valid(), device)
    f, g = chunk_tokens(layout.seq_lens, n)
    blocks = block_plans(f, g, [a for a, _ in seqs], layout.member, num_slots)
    return RingSetup(ranks, layout.member, tuple(seqs), valid, group, None, blocks)


def chunk_tokens(seq_lens: Sequence[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Real tokens of every member's first and second chunk: two int64 ``[len(seq_lens), n]`` arrays.

    The same counts as :func:`lightning_bytescale.planner.zigzag.member_tokens`, for all
    sequences and members at once (a static-mesh ring item holds thousands of sequences).
    """
    q, r = np.divmod(np.asarray(seq_lens, dtype=np.int64)[:, None], 2 * n)
    first = np.arange(n, dtype=np.int64)[None, :]
    second = 2 * n - 1 - first

    def count(k: np.ndarray) -> np.ndarray:  # extras on the first r chunks, or on the last r when r > n
        return q + np.where(r <= n, k < r, k >= 2 * n - r)

    return count(first), count(second)


def chunk_starts(seq_lens: Sequence[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    """First position of every member's first and second chunk: two int64 ``[len(seq_lens), n]`` arrays.

    :func:`lightning_bytescale.planner.zigzag.chunk_bounds`' starts, for all sequences and members at once.
    """
    q, r = np.divmod(np.asarray(seq_lens, dtype=np.int64)[:, None], 2 * n)
    first = np.arange(n, dtype=np.int64)[None, :]
    second = 2 * n - 1 - first

    def start(k: np.ndarray) -> np.ndarray:  # extras before chunk k: min(k, r), or max(0, k - (2n - r))
        return k * q + np.where(r <= n, np.minimum(k, r), np.maximum(0, k - (2 * n - r)))

    return start(first), start(second)


def block_plans(
    f: np.ndarray, g: np.ndarray, starts: Sequence[int], i: int, num_slots: int
) -> tuple[BlockPlan | None, ...]:
    """Member ``i``'s block plan against every source member (see the module docstring).

    ``f[j, r]`` and ``g[j, r]`` are the real tokens of member ``r``'s first and second range of
    sequence ``j`` (``[len(starts), N]``); ``starts[j]`` is the sequence's first slot.  Any
    layout in which member ``r``'s two ranges are contiguous positions, its first ranges in
    member order and its second ranges in reverse member order after them, has these blocks:
    the zigzag chunks of :func:`chunk_tokens`, and the node ranges of a hybrid item (:mod:`.ulysses`).
    """
    n = f.shape[1]
    a = np.asarray(starts, dtype=np.int64)
    c2 = np.diff(np.append(a, num_slots))  # 2 c_j slots per sequence
    shared: dict[bytes, Any] = {}  # equal row sets and plans are one object (one device index)

    def rows(lo: np.ndarray, hi: np.ndarray) -> Rows:
        key = b"rows" + lo.tobytes() + b"|" + hi.tobytes()
        if key not in shared:
            shared[key] = _rows(lo, hi)
        return shared[key]

    def plan(sel: np.ndarray, q_lo: np.ndarray, q_hi: np.ndarray, k_hi: np.ndarray) -> BlockPlan | None:
        if not sel.any():
            return None
        q_lo, q_hi, k_lo, k_hi = q_lo[sel], q_hi[sel], a[sel], k_hi[sel]
        key = b"plan" + b"|".join(x.tobytes() for x in (q_lo, q_hi, k_lo, k_hi))
        if key not in shared:
            shared[key] = BlockPlan(
                rows(q_lo, q_hi),
                rows(k_lo, k_hi),
                Segments(tuple((q_hi - q_lo).tolist())),
                Segments(tuple((k_hi - k_lo).tolist())),
                causal=False,
            )
        return shared[key]

    blocks: list[BlockPlan | None] = []
    f_i, g_i = f[:, i], g[:, i]
    for r in range(n):
        f_r, g_r = f[:, r], g[:, r]
        if r == i:
            whole, both = Rows(0, num_slots), Segments(tuple(c2.tolist()))
            blocks.append(BlockPlan(whole, whole, both, both, causal=True))
        elif r < i:  # every slot of i (padding rows too) against r's first chunk
            blocks.append(plan((f_i + g_i > 0) & (f_r > 0), a, a + c2, a + f_r))
        else:  # i's second chunk against all of r's real tokens
            blocks.append(plan((g_i > 0) & (f_r + g_r > 0), a + f_i, a + f_i + g_i, a + f_r + g_r))
    return tuple(blocks)


def _rows(lo: np.ndarray, hi: np.ndarray) -> Rows:
    """:meth:`Rows.of` for ``zip(lo, hi)`` (non-empty ranges), vectorised: a range when they form one run."""
    if lo.size == 1 or bool((lo[1:] == hi[:-1]).all()):
        return Rows(int(lo[0]), int(hi[-1]))
    lens = hi - lo
    offsets = np.cumsum(lens) - lens
    return Rows(index=torch.from_numpy(np.repeat(lo - offsets, lens) + np.arange(int(lens.sum()))))
