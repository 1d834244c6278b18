"""Zigzag sharding of one sequence over a ring of N ranks, with its padding spread over the chunks.

A sequence of length ``s`` on a ring of ``n`` members is cut into ``2n`` chunks; member ``i``
holds chunks ``i`` and ``2n - 1 - i``, so with ``2n`` dividing ``s`` every member holds ``1/n`` of
the tokens and exactly ``1/n`` of the causal-mask area.  Every chunk has ``c = ceil(s / 2n)``
*slots*, so every member holds ``2c`` slots of the sequence and the ring stays homogeneous
(same shapes, same bytes on every ring step).

**Spread padding.**  With ``q, r = divmod(s, 2n)``, every chunk holds ``q`` or ``q + 1`` real
tokens, consecutive positions in chunk order (:func:`chunk_bounds`): the ``r`` extra tokens go
to the first ``r`` chunks when ``r <= n``, to the last ``r`` chunks when ``r > n``.  A chunk with
``q`` tokens when ``c = q + 1`` has one padding slot, so a member has 0, 1 or 2 padding slots
per sequence and its token count differs from any other member's by at most one.

**Slot order** of member ``i`` for one sequence: the real tokens of chunk ``i``, then those of
chunk ``2n - 1 - i`` (both in position order), then its padding slots.  Padding slots carry
positions ``>= s`` (all ``2n c - s`` of them distinct over the ring, so the ring's slots hold
every position of ``0 .. 2nc - 1`` once), hold no real token and are masked out of attention
and of the loss.  Padding is last in each sequence's slots, so a causal mask by slot order
never lets a real query see a padding key.

**Balance** (:func:`member_causal_area`).  Counting a member's causal-mask area as
``sum(p + 1)`` over the real positions ``p`` it holds, any two members differ by at most
``(2q + 1) (min(r, 2n - r) - 1)`` pairs for ``r > 1`` (by 1 for ``r = 1``, 0 for ``r = 0``), which
is at most ``s - 1`` for ``s >= 2``: less than **one chunk row**, meaning one full row of the
sequence's ``s x s`` causal mask, the ``s`` keys the last query attends to, across all ``2n``
chunks (so at most ``2n c`` pairs; one token can add no more to a member's area).  Padding at
the end, the layout before this one, left member 0 (which holds the last chunk) with 28% of
another member's area for 907 tokens on 16 ranks; spread, it gets 97.8%
(``benchmarks/zigzag_padding.py``).

Pure Python: the planner, the engine, the attention kernels' block plans and the simulator all
use these formulas.
"""

from __future__ import annotations

from lightning_bytescale.planner.errors import PlanError


def chunk_size(length: int, ring_size: int) -> int:
    """Slots per zigzag chunk: ``ceil(length / (2 * ring_size))``."""
    if length < 1:
        raise PlanError(f"sequence length must be >= 1, got {length}")
    if ring_size < 1:
        raise PlanError(f"ring size must be >= 1, got {ring_size}")
    return -(-length // (2 * ring_size))


def slots_per_member(length: int, ring_size: int) -> int:
    """Slots (real tokens plus padding) each member holds: ``2 * chunk_size``."""
    return 2 * chunk_size(length, ring_size)


def padding(length: int, ring_size: int) -> int:
    """Padding slots of the whole ring for one sequence: ``2n * c - length``."""
    return 2 * ring_size * chunk_size(length, ring_size) - length


def member_chunks(ring_size: int, member: int) -> tuple[int, int]:
    """The two chunk indices member ``member`` holds: ``(member, 2n - 1 - member)``."""
    if not 0 <= member < ring_size:
        raise PlanError(f"member {member} is outside a ring of {ring_size}")
    return member, 2 * ring_size - 1 - member


def _chunk(s: int, n: int, k: int) -> tuple[int, int]:
    """``(start, end)`` positions of the real tokens of chunk ``k`` (no argument checks)."""
    q, r = divmod(s, 2 * n)
    if r <= n:  # extras on chunks 0 .. r - 1
        start = k * q + min(k, r)
        return start, start + q + (k < r)
    lo = 2 * n - r  # extras on chunks lo .. 2n - 1
    start = k * q + max(0, k - lo)
    return start, start + q + (k >= lo)


def chunk_bounds(length: int, ring_size: int) -> list[tuple[int, int]]:
    """Half-open position range of the real tokens of each of the ``2n`` chunks, in chunk order.

    The ranges tile ``[0, length)``; each holds ``q = length // 2n`` or ``q + 1`` tokens.
    """
    chunk_size(length, ring_size)  # checks the arguments
    return [_chunk(length, ring_size, k) for k in range(2 * ring_size)]


def member_tokens(length: int, ring_size: int, member: int) -> tuple[int, int]:
    """Real tokens in ``member``'s first and second chunk (its slots hold them in this order)."""
    chunk_size(length, ring_size)
    a, b = member_chunks(ring_size, member)
    (a0, a1), (b0, b1) = _chunk(length, ring_size, a), _chunk(length, ring_size, b)
    return a1 - a0, b1 - b0


def _pad_offset(s: int, n: int, m: int) -> int:
    """Padding slots of members ``0 .. m - 1`` together (closed form of the sum)."""
    q, r = divmod(s, 2 * n)
    if r == 0:
        return 0
    if r <= n:  # members < r: one padding slot (their second chunk); the others two
        return m if m <= r else r + 2 * (m - r)
    return min(m, 2 * n - r)  # members < 2n - r: one (their first chunk); the others none


def member_ranges(length: int, ring_size: int, member: int) -> list[tuple[int, int]]:
    """Half-open ranges of *real* tokens that ``member`` holds, in slot order.

    Empty ranges (chunks without a real token) are left out; adjacent ranges are merged (the
    middle member's two chunks touch, and for a ring of one they form ``[(0, length)]``).
    """
    chunk_size(length, ring_size)
    out: list[tuple[int, int]] = []
    for chunk in member_chunks(ring_size, member):
        start, end = _chunk(length, ring_size, chunk)
        if start >= end:
            continue
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def member_positions(length: int, ring_size: int, member: int) -> list[int]:
    """Positions of the ``2c`` slots ``member`` holds, in slot order; values ``>= length`` are padding."""
    pos = [p for a, b in member_ranges(length, ring_size, member) for p in range(a, b)]
    first = length + _pad_offset(length, ring_size, member)
    return pos + list(range(first, first + slots_per_member(length, ring_size) - len(pos)))


def all_member_ranges(s: int, n: int) -> list[tuple[tuple[int, int], ...]]:
    """:func:`member_ranges` of every member (as tuples), computed at once.

    Inlined chunk bounds: a static-mesh plan calls this for every sequence of every item.
    """
    chunk_size(s, n)
    q, r = divmod(s, 2 * n)
    if r <= n:  # extras on chunks 0 .. r - 1
        ends = [k * q + (k if k < r else r) for k in range(1, 2 * n + 1)]
    else:  # extras on chunks lo .. 2n - 1
        lo = 2 * n - r
        ends = [k * q + (k - lo if k > lo else 0) for k in range(1, 2 * n + 1)]
    out = []
    last = 2 * n - 1
    for m in range(n):
        a0, a1 = (ends[m - 1] if m else 0), ends[m]
        b0, b1 = ends[last - m - 1], ends[last - m]
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
    ``1/n`` of ``length (length + 1) / 2``; otherwise two members differ by at most
    :func:`max_area_difference` (less than one row of the mask, see the module docstring).
    """
    return sum((b - a) * (a + b + 1) // 2 for a, b in member_ranges(length, ring_size, member))


def max_area_difference(length: int, ring_size: int) -> int:
    """The largest difference between two members' :func:`member_causal_area` (closed form).

    With ``q, r = divmod(length, 2n)``: 0 when ``r = 0``; ``(2q + 1) (2n - r - 1)`` when ``r > n``;
    ``(2q + 1) (n - 1)`` when ``r = n``; otherwise 1 when ``r = 1``, ``r`` when ``q = 0`` (members
    past the last token hold nothing) and ``(2q + 1) (r - 1)``.  Never more than ``length``, and
    less than ``length`` once the ring has no more members than the sequence has tokens.
    """
    chunk_size(length, ring_size)
    n = ring_size
    q, r = divmod(length, 2 * n)
    if n == 1 or r == 0:
        return 0
    if r > n:
        return (2 * q + 1) * (2 * n - r - 1)
    if r == n:
        return (2 * q + 1) * (n - 1)
    if r == 1:
        return 1
    return r if q == 0 else (2 * q + 1) * (r - 1)
