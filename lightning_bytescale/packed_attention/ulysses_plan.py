"""One Ulysses member's set-up: which heads each member computes, and where the exchanged tokens land.

A Ulysses item is a ring item whose members split the attention *heads* instead of the keys:
every member holds the zigzag slots of a ring member (:mod:`.layout`), an all-to-all gives
each one every member's slots for its share of the heads, and the rows are put in sequence
order for the same local kernel a local micro-batch runs (:mod:`.ulysses` does the exchange).

* **Heads** (:func:`head_split`).  ``N`` members split ``H`` query heads into ``N`` blocks of
  ``H / N`` (refused with :class:`UlyssesHeadsError` when ``N`` does not divide ``H``).  The
  key/value heads are split the same way while ``N`` divides ``Hkv``; otherwise each member
  receives the key/value heads its query heads read (``h // (H / Hkv)``), so a head two members
  need travels to both and its gradients come back from both and are summed.  When a member's
  key/value heads do not form GQA groups of its query heads, it expands them to one per query
  head before the kernel.
* **Rows** (:func:`sequence_rows`).  The exchange stacks the members' slots member by member
  (``[N * T]``, ``T`` slots each); the set-up's index picks, for every token of every sequence
  in position order, its row there (padding slots are dropped, and get zero outputs and
  gradients).
* **Hybrid** (Ulysses inside each group of ``u`` consecutive members, the item's members on one
  node, and a zigzag ring across the ``R = N / u`` groups, the USP/LoongTrain layout).  Group
  ``r`` holds zigzag chunks ``r u .. r u + u - 1`` and their mirror images, which are two
  contiguous position ranges, the first ones in group order and the second ones in reverse
  group order: the shape of a zigzag ring of ``R`` members with other chunk sizes.  After the
  exchange inside the group (:func:`node_rows` orders the ``u T`` slots as: the first range's
  tokens, the second range's, then the padding), member ``k`` of every group runs the ring's
  blocks (:func:`.ring_plan.block_plans` with the groups' token counts) with member ``k`` of the
  other groups, on its head share.

Set-ups are cached by content (the layers of a model share one); everything here is host work
on the layout's host metadata, and the device index is copied once per set-up from pinned
memory without a host synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from lightning_bytescale.errors import ByteScaleError
from lightning_bytescale.packed_attention.layout import AttentionLayout
from lightning_bytescale.packed_attention.ring_plan import (
    RingSetup,
    block_plans,
    check_layout,
    chunk_starts,
    chunk_tokens,
    setup_key,
)
from lightning_bytescale.packed_attention.segments import to_device

# (sends [(dst, tensor)], receives [(src, buffer)], tag) -> an object whose wait() fills the buffers;
# None: P2P on the process group.  In-process tests replace the sends and receives here.
Transport = Callable[[list[tuple[int, torch.Tensor]], list[tuple[int, torch.Tensor]], int], Any]
RingTransport = Callable[[torch.Tensor, int, int, int], Any]

_LAST_SETUP: dict[tuple, UlyssesSetup] = {}


class UlyssesHeadsError(ByteScaleError, ValueError):
    """A Ulysses item's members cannot split the attention heads: their count does not divide the query heads."""


@dataclass(frozen=True)
class HeadSplit:
    """Which heads each member of a Ulysses group computes, by member: ``(start, stop)`` ranges."""

    q: tuple[tuple[int, int], ...]  # query heads, H / N each
    kv: tuple[tuple[int, int], ...]  # the key/value heads those query heads read
    # per member: the local key/value head of each local query head where they do not form GQA
    # groups the kernel takes (the member expands its key/value heads), else None
    expand: tuple[tuple[int, ...] | None, ...]


@lru_cache(maxsize=64)
def head_split(heads: int, kv_heads: int, n: int) -> HeadSplit:
    """The heads of ``n`` members: query heads in equal blocks, key/value heads split or replicated.

    Raises :class:`UlyssesHeadsError` when ``n`` does not divide ``heads``.
    """
    if heads % n:
        raise UlyssesHeadsError(
            f"a Ulysses item of {n} members (a hybrid item: its members on one node) splits the query heads "
            f"into {n} equal shares, but there are {heads} query heads (under tensor parallelism: the heads "
            f"of one lane). Run this item as a ring (the plan's mode 'ring'; planner option "
            f"modes=('ring',)), or use a head count divisible by {n}"
        )
    hq, group = heads // n, heads // kv_heads
    q = tuple((m * hq, (m + 1) * hq) for m in range(n))
    if kv_heads % n == 0:
        w = kv_heads // n
        kv = tuple((m * w, (m + 1) * w) for m in range(n))
    else:  # replicated: the key/value heads each member's query heads read
        kv = tuple((a // group, (b - 1) // group + 1) for a, b in q)
    expand = []
    for (a, b), (ka, kb) in zip(q, kv):
        local = tuple(h // group - ka for h in range(a, b))
        width = kb - ka
        native = hq % width == 0 and local == tuple(j // (hq // width) for j in range(hq))
        expand.append(None if native else local)
    return HeadSplit(q, kv, tuple(expand))


@dataclass(frozen=True)
class Exchange:
    """One all-to-all group: its members' global ranks, this member, and where the received rows go."""

    peers: tuple[int, ...]  # global ranks, in member order
    member: int  # this rank's index in ``peers``
    slots: int  # T: the slots every member holds (equal on all members)
    rows: (
        torch.Tensor
    )  # int64 [S] on the tensors' device: row of the stacked [N * T] slots of each output row
    group: Any = None
    transport: Transport | None = None

    @property
    def size(self) -> int:
        return len(self.peers)


@dataclass(frozen=True)
class UlyssesSetup:
    """What one member needs to run a Ulysses (or hybrid) item."""

    exchange: Exchange  # the whole item for "ulysses"; this member's node group for "hybrid"
    seq_lens: tuple[int, ...]  # the sequences the local kernel sees ("ulysses")
    ring: RingSetup | None = None  # "hybrid": the ring across the groups, on this member's head share


def _expand(lo: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``concat(range(lo_i, lo_i + lens_i))``, vectorised."""
    lo, lens = lo.reshape(-1), lens.reshape(-1)
    offsets = np.cumsum(lens) - lens
    return np.repeat(lo - offsets, lens) + np.arange(int(lens.sum()), dtype=np.int64)


def sequence_rows(seq_lens: Sequence[int], starts: Sequence[int], slots: int, n: int) -> np.ndarray:
    """For ``n`` members' zigzag slots stacked member by member, the row of every token in sequence order.

    ``starts[j]`` is sequence ``j``'s first slot on every member, ``slots`` the member's total.
    Returns int64 ``[sum(seq_lens)]``: sequences one after another, positions ``0 .. s_j - 1``.
    """
    lens = np.asarray(seq_lens, dtype=np.int64)
    f, g = chunk_tokens(lens, n)
    first, second = chunk_starts(lens, n)
    out0 = (np.cumsum(lens) - lens)[:, None]
    src0 = np.asarray(starts, dtype=np.int64)[:, None] + slots * np.arange(n, dtype=np.int64)[None, :]
    rows = np.empty(int(lens.sum()), dtype=np.int64)
    rows[_expand(out0 + first, f)] = _expand(src0, f)
    rows[_expand(out0 + second, g)] = _expand(src0 + f, g)
    return rows


def node_rows(
    seq_lens: Sequence[int], starts: Sequence[int], slots: int, n: int, u: int, node: int
) -> np.ndarray:
    """The hybrid order of node ``node``'s ``u`` members' slots, stacked member by member: a permutation.

    Sequence ``j`` gets ``u * (starts[j+1] - starts[j])`` slots from ``u * starts[j]`` on: the
    real tokens of the node's first range (its members' first chunks, in member order), then
    those of its second range (their second chunks, in reverse member order), both in
    position order, then every member's padding.
    """
    lens = np.asarray(seq_lens, dtype=np.int64)
    f, g = (x[:, node * u : (node + 1) * u] for x in chunk_tokens(lens, n))
    a = np.asarray(starts, dtype=np.int64)[:, None]
    pad = 2 * (-(-lens // (2 * n)))[:, None] - f - g
    base = u * a
    first = base + np.cumsum(f, axis=1) - f  # member k's first chunk after members < k's
    second = (
        base + f.sum(1, keepdims=True) + np.cumsum(g[:, ::-1], axis=1)[:, ::-1] - g
    )  # after members > k's
    padding = base + (f + g).sum(1, keepdims=True) + np.cumsum(pad, axis=1) - pad
    src = a + slots * np.arange(u, dtype=np.int64)[None, :]
    rows = np.empty(u * slots, dtype=np.int64)
    rows[_expand(first, f)] = _expand(src, f)
    rows[_expand(second, g)] = _expand(src + f, g)
    rows[_expand(padding, pad)] = _expand(src + f + g, pad)
    return rows


def _hybrid_ring(
    layout: AttentionLayout,
    ranks: tuple[int, ...],
    starts: Sequence[int],
    slots: int,
    u: int,
    device: torch.device,
    group: Any,
    transport: RingTransport | None,
) -> RingSetup:
    """The ring across the ``N / u`` node groups that member ``k`` of this member's node runs."""
    n = len(ranks)
    node, k = divmod(layout.member, u)
    f, g = (x.reshape(x.shape[0], n // u, u).sum(axis=2) for x in chunk_tokens(layout.seq_lens, n))
    a = u * np.asarray(starts, dtype=np.int64)
    per_seq = u * np.diff(np.append(np.asarray(starts, dtype=np.int64), slots))
    real = f[:, node] + g[:, node]
    valid = torch.from_numpy(_expand(np.zeros_like(per_seq), per_seq) < np.repeat(real, per_seq))
    blocks = block_plans(f, g, a.tolist(), node, u * slots)
    seqs = tuple((int(x), int(c) // 2) for x, c in zip(a, per_seq))
    ring = tuple(ranks[r * u + k] for r in range(n // u))
    return RingSetup(ring, node, seqs, to_device(valid, device), group, transport, blocks)


def ulysses_setup(
    layout: AttentionLayout,
    num_slots: int,
    device: torch.device,
    group: Any = None,
    transport: Transport | None = None,
    ring_transport: RingTransport | None = None,
) -> UlyssesSetup:
    """Check ``layout`` (a ``"ulysses"`` or ``"hybrid"`` ring item) and precompute the exchange's rows.

    The last set-up is cached by content, so the layers of a model share one.  With a
    ``transport`` (in-process members; ``ring_transport`` for a hybrid's ring), ranks are the
    transports' and torch.distributed is not used.
    """
    in_process = transport is not None
    key = None if in_process else setup_key(layout, num_slots, device, group)
    if key is not None and key in _LAST_SETUP:
        return _LAST_SETUP[key]
    ranks, seqs = check_layout(layout, num_slots, check_rank=not in_process)
    starts = [a for a, _ in seqs]
    n = len(ranks)
    u = n if layout.mode == "ulysses" else int(layout.ulysses_size or n)
    node, k = divmod(layout.member, u)
    peers = ranks[node * u : (node + 1) * u]
    if u == n:  # Ulysses over the whole item
        rows, ring = sequence_rows(layout.seq_lens, starts, num_slots, n), None
    else:
        rows = node_rows(layout.seq_lens, starts, num_slots, n, u, node)
        ring = _hybrid_ring(layout, ranks, starts, num_slots, u, device, group, ring_transport)
    exchange = Exchange(peers, k, num_slots, to_device(torch.from_numpy(rows), device), group, transport)
    setup = UlyssesSetup(exchange, layout.seq_lens, ring)
    if key is not None:
        _LAST_SETUP.clear()
        _LAST_SETUP[key] = setup
    return setup
