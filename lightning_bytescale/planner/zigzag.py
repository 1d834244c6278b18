"""Zigzag sharding of one sequence over a ring of N ranks.

A sequence of length ``s`` on a ring of ``n`` members is cut into ``2n`` chunks of
``c = ceil(s / 2n)`` slots; member ``i`` holds chunks ``i`` and ``2n - 1 - i``, so every
member holds ``1/n`` of the tokens and ``1/n`` of the causal-mask area when ``2n`` divides
``s``.  When it does not, the sequence is padded at its end to ``2n * c`` slots: padding
slots carry positions ``>= s``, hold no real token, and are masked out of attention and of
the loss.  Every member therefore holds exactly ``2c`` slots of the sequence, which keeps the
ring homogeneous (same shapes, same bytes on every ring step).

Padding at the end costs balance: the last chunks hold few real tokens, and member 0 holds
the very last one, so its share of the causal-mask area can fall far below ``1/n`` (907 tokens
on 16 ranks: member 0 gets 28% of the largest member's area).  :func:`member_causal_area`
measures it; docs/planner.md ("Zigzag padding") has the layout that spreads the padding,
which needs the attention kernels to mask padding keys inside a chunk before it can replace
this one.

Pure Python: the planner, the engine and the simulator all use these formulas.
"""

from __future__ import annotations


def chunk_size(length: int, ring_size: int) -> int:
    """Slots per zigzag chunk: ``ceil(length / (2 * ring_size))``."""
    if length < 1:
        raise ValueError(f"sequence length must be >= 1, got {length}")
    if ring_size < 1:
        raise ValueError(f"ring size must be >= 1, got {ring_size}")
    return -(-length // (2 * ring_size))


def slots_per_member(length: int, ring_size: int) -> int:
    """Slots (real tokens plus padding) each member holds: ``2 * chunk_size``."""
    return 2 * chunk_size(length, ring_size)


def padding(length: int, ring_size: int) -> int:
    """Padding slots added at the end of the sequence: ``2n * c - length``."""
    return 2 * ring_size * chunk_size(length, ring_size) - length


def member_chunks(ring_size: int, member: int) -> tuple[int, int]:
    """The two chunk indices member ``member`` holds: ``(member, 2n - 1 - member)``."""
    if not 0 <= member < ring_size:
        raise ValueError(f"member {member} is outside a ring of {ring_size}")
    return member, 2 * ring_size - 1 - member


def member_ranges(length: int, ring_size: int, member: int) -> list[tuple[int, int]]:
    """Half-open ranges of *real* tokens that ``member`` holds, in slot order.

    Empty ranges (chunks made only of padding) are left out; adjacent ranges are merged
    (for a ring of one the two chunks touch and form ``[(0, length)]``).
    """
    c = chunk_size(length, ring_size)
    out: list[tuple[int, int]] = []
    for chunk in member_chunks(ring_size, member):
        start, end = chunk * c, min((chunk + 1) * c, length)
        if start >= end:
            continue
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def member_positions(length: int, ring_size: int, member: int) -> list[int]:
    """Positions of the ``2c`` slots member ``member`` holds; values ``>= length`` are padding."""
    c = chunk_size(length, ring_size)
    pos: list[int] = []
    for chunk in member_chunks(ring_size, member):
        pos.extend(range(chunk * c, (chunk + 1) * c))
    return pos


def all_member_ranges(s: int, n: int) -> list[tuple[tuple[int, int], ...]]:
    """:func:`member_ranges` of every member (as tuples), computed at once (``n >= 2``)."""
    c = -(-s // (2 * n))
    out = []
    for m in range(n):
        a0, a1 = m * c, min((m + 1) * c, s)
        j = 2 * n - 1 - m
        b0, b1 = j * c, min((j + 1) * c, s)
        if a0 < a1:
            if b0 >= b1:
                out.append(((a0, a1),))
            elif a1 == b0:  # the middle member's chunks touch: one range
                out.append(((a0, b1),))
            else:
                out.append(((a0, a1), (b0, b1)))
        else:
            out.append(((b0, b1),) if b0 < b1 else ())
    return out


def member_causal_area(length: int, ring_size: int, member: int) -> int:
    """Causal query-key pairs of ``member``'s real tokens: ``sum(q + 1)`` over the positions it holds.

    Every real query at position ``q`` attends to the ``q + 1`` keys at or before it; padding
    queries and keys count nothing.  With ``2n`` dividing the length every member gets exactly
    ``1/n`` of ``length (length + 1) / 2``.
    """
    return sum((b - a) * (a + b + 1) // 2 for a, b in member_ranges(length, ring_size, member))
