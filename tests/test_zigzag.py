"""Zigzag sharding: equal tokens and mask area per member, padding at the end, exact coverage."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_bytescale.planner import zigzag


def _mask_area(positions: list[int], s: int) -> int:
    """Causal query-key pairs of the real queries among ``positions`` (keys are 0..q)."""
    return sum(p + 1 for p in positions if p < s)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 16), k=st.integers(1, 20))
def test_divisible_lengths_split_tokens_and_mask_area_evenly(n, k):
    s = 2 * n * k
    total = s * (s + 1) // 2
    for m in range(n):
        pos = zigzag.member_positions(s, n, m)
        assert len(pos) == s // n
        assert _mask_area(pos, s) * n == total
        assert zigzag.padding(s, n) == 0


@settings(max_examples=200, deadline=None)
@given(s=st.integers(1, 500), n=st.integers(1, 16))
def test_every_token_once_and_padding_at_the_end(s, n):
    c = zigzag.chunk_size(s, n)
    assert c == -(-s // (2 * n))
    seen = []
    for m in range(n):
        pos = zigzag.member_positions(s, n, m)
        assert len(pos) == zigzag.slots_per_member(s, n) == 2 * c
        real = [p for p in pos if p < s]
        ranges = zigzag.member_ranges(s, n, m)
        assert [p for a, b in ranges for p in range(a, b)] == real
        seen.extend(real)
    assert sorted(seen) == list(range(s))
    pad = [p for m in range(n) for p in zigzag.member_positions(s, n, m) if p >= s]
    assert len(pad) == zigzag.padding(s, n) and sorted(pad) == list(range(s, 2 * n * c))


def test_hand_cases():
    # s = 10 on 2 ranks: c = 3, chunks [0,3) [3,6) [6,9) [9,12); member 0 holds 0 and 3
    assert zigzag.member_ranges(10, 2, 0) == [(0, 3), (9, 10)]
    assert zigzag.member_ranges(10, 2, 1) == [(3, 9)]  # chunks 1 and 2 touch: merged
    assert zigzag.member_positions(10, 2, 0) == [0, 1, 2, 9, 10, 11]
    assert zigzag.padding(10, 2) == 2
    assert zigzag.member_ranges(1, 2, 1) == []  # only padding
    assert zigzag.member_ranges(7, 1, 0) == [(0, 7)]
    with pytest.raises(ValueError):
        zigzag.chunk_size(0, 2)
    with pytest.raises(ValueError):
        zigzag.member_chunks(2, 2)
