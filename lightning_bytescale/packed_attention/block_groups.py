"""Ring blocks on a CPU: the sequences of a varlen block that share a shape, in one batched call.

A varlen ring block pairs each sequence's query rows with the same sequence's key rows.  The
CPU flash kernel has no varlen form, so a block of ``n`` sequences used to cost ``n`` kernel
calls forward and ``n`` backward, per ring step and layer.  A ring that holds many short
sequences (a static CP ring packs hundreds of them, each sharded into a few rows a member) then
spends nearly all of its time in those calls' fixed cost, not in attention.

:func:`shape_groups` sorts the block's sequences by their ``(query rows, key rows)`` shape:
the sequences of one shape are gathered into one ``[G, H, Lq, D]`` batch and run as one call
(no padding, so no mask: the batch dimension keeps them apart exactly as separate calls do);
a shape held by one sequence keeps its own call on views of the rows, with no copy.  Zigzag
sharding makes shapes repeat: a sequence of ``s`` tokens over a ring of ``N`` gives each member
``2 * ceil(s / 2N)`` rows, so short sequences of many lengths share a few shapes.

The groups' gather indices are host tensors cached on the block's query :class:`~.segments.Segments`
(ring set-ups, and with them their segments, are cached per layout, so the layers of a model
share them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_bytescale.packed_attention.gqa import expand_kv
from lightning_bytescale.packed_attention.segments import Segments


@dataclass(frozen=True)
class ShapeGroup:
    """``count`` sequences whose query rows (``q_len`` each) and key rows (``k_len``) are gathered by index."""

    q_len: int
    k_len: int
    count: int
    q_index: torch.Tensor  # int64 [count * q_len]: the sequences' query rows, sequence by sequence
    k_index: torch.Tensor  # int64 [count * k_len]


@dataclass(frozen=True)
class BlockGroups:
    """A block's sequences as batched shape groups and single ``(query slice, key slice)`` pairs."""

    groups: tuple[ShapeGroup, ...]
    singles: tuple[tuple[slice, slice], ...]
    q_rows: int  # query rows the pairs cover

    @property
    def calls(self) -> int:
        """Kernel calls the block makes (one per group and per single sequence)."""
        return len(self.groups) + len(self.singles)


def shape_groups(q_seg: Segments, k_seg: Segments, causal: bool) -> BlockGroups:
    """The block's sequences with query rows, by shape; cached on ``q_seg`` for ``k_seg``'s lengths.

    Sequences without query rows are left out (they compute nothing).  A causal block needs
    equal query and key lengths per sequence (its own diagonal block).
    """
    check_block(q_seg, k_seg, causal)
    key = ("shape_groups", k_seg.lens)
    cached = q_seg._cache.get(key)
    if cached is None:
        cached = _build(q_seg, k_seg)
        q_seg._cache[key] = cached
    return cached


def check_block(q_seg: Segments, k_seg: Segments, causal: bool) -> None:
    """Refuse a block whose query and key sequences do not pair up (a causal block: equal lengths)."""
    if len(q_seg.lens) != len(k_seg.lens):
        raise ValueError(
            f"{len(q_seg.lens)} query sequences but {len(k_seg.lens)} key sequences in one block"
        )
    if causal and q_seg.lens != k_seg.lens:
        raise ValueError(
            f"a causal block needs equal query and key lengths, got {q_seg.lens} and {k_seg.lens}"
        )


def _build(q_seg: Segments, k_seg: Segments) -> BlockGroups:
    by_shape: dict[tuple[int, int], list[tuple[tuple[int, int], tuple[int, int]]]] = {}
    covered = 0
    for qb, kb in zip(q_seg.bounds, k_seg.bounds):
        if qb[1] <= qb[0]:
            continue
        by_shape.setdefault((qb[1] - qb[0], kb[1] - kb[0]), []).append((qb, kb))
        covered += qb[1] - qb[0]
    groups, singles = [], []
    for (lq, lk), members in by_shape.items():  # first-seen order: deterministic
        if len(members) == 1:
            (qa, qe), (ka, ke) = members[0]
            singles.append((slice(qa, qe), slice(ka, ke)))
            continue
        q_index = torch.cat([torch.arange(a, e) for (a, e), _ in members])
        k_index = torch.cat([torch.arange(a, e) for _, (a, e) in members])
        groups.append(ShapeGroup(lq, lk, len(members), q_index, k_index))
    return BlockGroups(tuple(groups), tuple(singles), covered)


def gather_batch(
    x: torch.Tensor, index: torch.Tensor, count: int, length: int, repeat_heads: int = 1
) -> torch.Tensor:
    """Rows ``index`` of ``x [T, H, D]`` as a ``[count, H * repeat_heads, length, D]`` batch.

    ``repeat_heads`` expands key/value heads for grouped-query attention after the gather, so
    only the gathered rows are copied, not the whole block.
    """
    rows = expand_kv(x.index_select(0, index), repeat_heads)
    return rows.view(count, length, *rows.shape[1:]).transpose(1, 2)


def batch_rows(batch: torch.Tensor) -> torch.Tensor:
    """``[G, H, L, D]`` -> packed rows ``[G * L, H, D]``, sequence by sequence."""
    return batch.transpose(1, 2).reshape(-1, batch.shape[1], batch.shape[3])


def scatter_batch(target: torch.Tensor, index: torch.Tensor, batch: torch.Tensor) -> None:
    """The inverse of :func:`gather_batch`: ``batch [G, H, L, D]`` into rows ``index`` of ``target``."""
    target.index_copy_(0, index, batch_rows(batch).to(target.dtype))


def scatter_lse(target: torch.Tensor, index: torch.Tensor, lse: torch.Tensor) -> None:
    """``lse [G, H, L]`` into columns ``index`` of ``target [H, T]``."""
    target.index_copy_(1, index, lse.transpose(0, 1).reshape(lse.shape[1], -1).to(target.dtype))


def gather_lse(lse: torch.Tensor, index: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """Columns ``index`` of ``lse [H, T]`` as ``[count, H, length]``."""
    return lse.index_select(1, index).view(lse.shape[0], count, length).transpose(0, 1)


__all__ = [
    "BlockGroups",
    "ShapeGroup",
    "batch_rows",
    "check_block",
    "gather_batch",
    "gather_lse",
    "scatter_batch",
    "scatter_lse",
    "shape_groups",
]
