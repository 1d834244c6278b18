"""Best-fit-decreasing bin packing of short sequences into the per-rank capacity.

Paper §2.2 / Alg. 1: sequences that fit one rank are packed into bins of ``C`` tokens.
Best-fit decreasing: take items longest first (ties by index, so the result is deterministic)
and put each into the open bin with the least room that still holds it, else open a new bin.
The open bins are kept in a sorted list keyed by ``(room, bin id)`` so each item costs one
binary search.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from lightning_bytescale.planner.errors import PlanError


def best_fit_decreasing(
    sizes: Sequence[int], capacity: int, items: Sequence[int] | None = None
) -> list[list[int]]:
    """Pack ``items`` (indices into ``sizes``; all by default) into bins of ``capacity``.

    Returns bins as lists of item indices, in the order the bins were opened (so the first
    bins hold the largest items); inside a bin, items are in the order they were placed.
    """
    if capacity < 1:
        raise PlanError(f"capacity must be >= 1, got {capacity}")
    idx = list(range(len(sizes))) if items is None else list(items)
    idx.sort(key=lambda i: (-sizes[i], i))
    bins: list[list[int]] = []
    open_keys: list[tuple[int, int]] = []  # (room, bin id), sorted
    for i in idx:
        size = sizes[i]
        if size > capacity:
            raise PlanError(f"item {i} of size {size} exceeds the bin capacity {capacity}")
        if size < 0:
            raise PlanError(f"item {i} has negative size {size}")
        pos = bisect.bisect_left(open_keys, (size, -1))
        if pos < len(open_keys):
            room, b = open_keys.pop(pos)
            bins[b].append(i)
            room -= size
        else:
            b = len(bins)
            bins.append([i])
            room = capacity - size
        if room > 0:
            bisect.insort(open_keys, (room, b))
    return bins
