"""Zigzag sharding: exact coverage, padding spread over the chunks, and the causal-area balance it buys.

"Chunk row" below is one full row of a sequence's ``s x s`` causal mask: ``s`` query-key pairs,
the keys the last query attends to across all ``2n`` chunks (the most one token can add to a
member's area).  The spread layout keeps every two members' areas within one chunk row.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_bytescale.planner import zigzag
from lightning_bytescale.planner.cost_model import CostModel


def _mask_area(positions: list[int], s: int) -> int:
    """Causal query-key pairs of the real queries among ``positions`` (keys are 0..q)."""
    return sum(p + 1 for p in positions if p < s)


def _areas(chunk_tokens: list[int]) -> list[int]:
    """Causal area of each member when chunk ``k`` holds ``chunk_tokens[k]`` real tokens in order."""
    n = len(chunk_tokens) // 2
    start, area = 0, []
    for t in chunk_tokens:
        area.append(t * start + t * (t + 1) // 2)
        start += t
    return [area[m] + area[2 * n - 1 - m] for m in range(n)]


def _end_padded(s: int, n: int) -> list[int]:
    """Tokens per chunk of the previous layout: ``c`` per chunk, the padding all at the sequence end."""
    c = zigzag.chunk_size(s, n)
    return [max(0, min(c, s - k * c)) for k in range(2 * n)]


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 16), k=st.integers(1, 20))
def test_divisible_lengths_split_tokens_and_mask_area_evenly(n, k):
    s = 2 * n * k
    total = s * (s + 1) // 2
    for m in range(n):
        pos = zigzag.member_positions(s, n, m)
        assert len(pos) == s // n
        assert _mask_area(pos, s) * n == total
        assert zigzag.padding(s, n) == 0
    assert zigzag.max_area_difference(s, n) == 0


@settings(max_examples=200, deadline=None)
@given(s=st.integers(1, 500), n=st.integers(1, 16))
def test_every_token_once_padding_spread_and_last_in_each_member(s, n):
    c = zigzag.chunk_size(s, n)
    assert c == -(-s // (2 * n))
    bounds = zigzag.chunk_bounds(s, n)
    q = s // (2 * n)
    assert [b - a for a, b in bounds].count(q + 1) == s % (2 * n)  # floor or ceil per chunk
    assert all(b - a in (q, q + 1) for a, b in bounds)
    assert bounds[0][0] == 0 and bounds[-1][1] == s
    assert all(bounds[k][1] == bounds[k + 1][0] for k in range(2 * n - 1))
    seen, counts = [], []
    for m in range(n):
        pos = zigzag.member_positions(s, n, m)
        assert len(pos) == zigzag.slots_per_member(s, n) == 2 * c
        real = [p for p in pos if p < s]
        assert pos[: len(real)] == real, "padding slots come after every real slot"
        assert real == sorted(real)  # slot order is position order
        ranges = zigzag.member_ranges(s, n, m)
        assert [p for a, b in ranges for p in range(a, b)] == real
        first, second = (bounds[k] for k in zigzag.member_chunks(n, m))
        assert zigzag.member_tokens(s, n, m) == (first[1] - first[0], second[1] - second[0])
        assert len(real) == sum(zigzag.member_tokens(s, n, m))
        assert 2 * c - len(real) <= 2
        seen.extend(real)
        counts.append(len(real))
    assert sorted(seen) == list(range(s))
    assert max(counts) - min(counts) <= 1
    pad = [p for m in range(n) for p in zigzag.member_positions(s, n, m) if p >= s]
    assert len(pad) == zigzag.padding(s, n) and sorted(pad) == list(range(s, 2 * n * c))
    assert [list(x) for x in zigzag.all_member_ranges(s, n)] == [
        zigzag.member_ranges(s, n, m) for m in range(n)
    ]


def test_hand_cases():
    # s = 10 on 2 ranks: c = 3, q = 2, r = 2 extra tokens on chunks 0 and 1:
    # chunks [0,3) [3,6) [6,8) [8,10); member 0 holds chunks 0 and 3, member 1 chunks 1 and 2
    assert zigzag.chunk_bounds(10, 2) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert zigzag.member_ranges(10, 2, 0) == [(0, 3), (8, 10)]
    assert zigzag.member_ranges(10, 2, 1) == [(3, 8)]  # chunks 1 and 2 touch: merged
    assert zigzag.member_positions(10, 2, 0) == [0, 1, 2, 8, 9, 10]
    assert zigzag.member_positions(10, 2, 1) == [3, 4, 5, 6, 7, 11]
    assert zigzag.padding(10, 2) == 2
    # s = 7 on 2 ranks: r = 3 > n, the extras go to the last three chunks
    assert zigzag.chunk_bounds(7, 2) == [(0, 1), (1, 3), (3, 5), (5, 7)]
    assert zigzag.member_positions(7, 2, 0) == [0, 5, 6, 7]
    assert zigzag.member_positions(7, 2, 1) == [1, 2, 3, 4]
    assert zigzag.member_ranges(1, 2, 1) == []  # only padding
    assert zigzag.member_ranges(3, 2, 0) == [(2, 3)]  # an empty first chunk, a real second one
    assert zigzag.member_ranges(7, 1, 0) == [(0, 7)]
    with pytest.raises(ValueError):
        zigzag.chunk_size(0, 2)
    with pytest.raises(ValueError):
        zigzag.member_chunks(2, 2)
    with pytest.raises(ValueError):
        zigzag.chunk_bounds(5, 0)


@settings(max_examples=200, deadline=None)
@given(s=st.integers(1, 3000), n=st.integers(1, 32))
def test_member_causal_area_counts_the_pairs_of_its_positions(s, n):
    areas = [zigzag.member_causal_area(s, n, m) for m in range(n)]
    assert areas == [_mask_area(zigzag.member_positions(s, n, m), s) for m in range(n)]
    assert sum(areas) == s * (s + 1) // 2
    assert areas == _areas([b - a for a, b in zigzag.chunk_bounds(s, n)])


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 64), data=st.data())
def test_no_two_members_differ_by_more_than_one_chunk_row(n, data):
    """(b): max - min member area <= s (one chunk row), and < s once s >= n (every member can hold
    a token); the closed form of the difference is exact."""
    s = data.draw(st.one_of(st.integers(1, 4 * n), st.integers(2 * n, 200 * n)))
    areas = [zigzag.member_causal_area(s, n, m) for m in range(n)]
    spread = max(areas) - min(areas)
    assert spread == zigzag.max_area_difference(s, n)
    assert spread <= s
    if s >= n and s >= 2:
        assert spread < s


@settings(max_examples=150, deadline=None)
@given(n=st.integers(2, 64), data=st.data())
def test_cost_model_per_member_area_matches_the_slowest_member(n, data):
    """The planner and simulator price a ring member at ``a s^2 / n`` (1/n of the area, padding
    ignored); the ring runs at its slowest member's pace, which the spread layout keeps within one
    chunk row of the mean: ``2 max(area) <= (s^2 / n) (1 + (2n + 1) / s)``."""
    s = data.draw(st.integers(2 * n, 200 * n))
    cm = CostModel(a=1.0, b=0.0, g=0.0)
    estimate = cm.ring_parts([s], n)[1]  # attention seconds per layer with a = 1: s^2 / n
    assert estimate == pytest.approx(s * s / n)
    slowest = 2 * max(zigzag.member_causal_area(s, n, m) for m in range(n))  # s^2 counts both triangles
    assert slowest <= estimate * (1 + (2 * n + 1) / s) + 1e-9


def test_907_tokens_on_16_ranks_member_zero_gets_the_others_area():
    """(c) issue 16: padding at the end gave member 0 28% of the largest member's area."""
    before = _areas(_end_padded(907, 16))
    assert before[0] == min(before) and before[0] / max(before) == pytest.approx(0.284, abs=0.001)
    areas = [zigzag.member_causal_area(907, 16, m) for m in range(16)]
    mean = sum(areas) / 16
    assert min(areas) / max(areas) == pytest.approx(0.978, abs=0.001)
    assert areas[0] / mean == pytest.approx(1.0, abs=0.025)
    assert max(areas) / mean == pytest.approx(1.011, abs=0.001)
    assert max(areas) - min(areas) < 907
    # the previous layout's slowest member is outside the cost model's bound, the new one inside
    assert 2 * max(before) > 907 * 907 / 16 * (1 + 33 / 907)
    assert 2 * max(areas) <= 907 * 907 / 16 * (1 + 33 / 907)
