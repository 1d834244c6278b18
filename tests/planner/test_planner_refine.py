"""``balance``'s refinement of all-local placements (:mod:`lightning_bytescale.planner.refine`).

The refinement prices each rank's share as it will run (packed best-fit-decreasing into ``C``
tokens, each micro-batch at ``local_time``); it must keep every sequence exactly once, never
make the slowest rank slower, be deterministic, and leave plans with rings alone.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_bytescale.planner import make_plan
from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.packing import best_fit_decreasing
from lightning_bytescale.planner.refine import refine_local_shares

# a model in which the per-micro-batch overhead g matters: what LPT on single sequences misprices
COST = CostModel(a=4.7e-8, b=5.7e-6, g=1.75e-3, c=0.0, d=0.0, num_layers=4, name="test-cpu")


def packed_time(lengths, cap, cost, share):
    """The reference: a share packed as ``emit`` packs it, each micro-batch at ``local_time``."""
    return sum(cost.local_time([lengths[i] for i in b]) for b in best_fit_decreasing(lengths, cap, share))


def _max_time(lengths, cap, shares):
    return max(packed_time(lengths, cap, COST, s) for s in shares)


def test_a_lopsided_placement_is_evened_out_exactly():
    lengths = [100] * 8
    shares = [list(range(8)), [], [], []]
    out = refine_local_shares(lengths, 200, COST, shares)
    assert sorted(q for s in out for q in s) == list(range(8))
    assert [len(s) for s in out] == [2, 2, 2, 2]  # one full micro-batch of 200 tokens each
    assert _max_time(lengths, 200, out) == packed_time(lengths, 200, COST, [0, 1])


def test_a_rank_one_micro_batch_over_the_others_is_fixed():
    """Equal token sums, but one share packs into one micro-batch more (it pays g once more)."""
    lengths = [300, 300, 300, 100, 100, 100, 100, 100, 100]
    cap = 400
    shares = [[0, 3], [1, 4], [2, 5, 6, 7, 8]]  # 400, 400, 700 tokens: rank 2 runs two packs
    before = _max_time(lengths, cap, shares)
    out = refine_local_shares(lengths, cap, COST, shares)
    assert _max_time(lengths, cap, out) < before


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 512), min_size=1, max_size=40),
    world=st.integers(1, 6),
    data=st.data(),
)
def test_refinement_keeps_every_sequence_and_never_slows_the_slowest_rank(lengths, world, data):
    cap = 512
    owner = data.draw(st.lists(st.integers(0, world - 1), min_size=len(lengths), max_size=len(lengths)))
    shares = [[i for i, r in enumerate(owner) if r == w] for w in range(world)]
    out = refine_local_shares(lengths, cap, COST, shares)
    assert len(out) == world
    assert sorted(q for s in out for q in s) == list(range(len(lengths)))
    assert _max_time(lengths, cap, out) <= _max_time(lengths, cap, shares) * (1 + 1e-12)
    assert out == refine_local_shares(lengths, cap, COST, shares)  # every rank derives the same plan


def test_the_work_is_bounded_and_many_sequences_per_rank_are_left_alone(monkeypatch):
    import lightning_bytescale.planner.refine as refine

    priced = []
    pack = refine.best_fit_decreasing
    monkeypatch.setattr(refine, "best_fit_decreasing", lambda *a: priced.append(len(a[2])) or pack(*a))
    lengths = [(37 * i) % 500 + 2 for i in range(400)]
    shares = [list(range(400)), [], [], []]
    assert refine.refine_local_shares(lengths, 512, COST, shares) == shares  # 100 a rank: left alone
    assert priced == []
    lengths = lengths[:60]
    shares = [list(range(60)), [], [], []]
    out = refine.refine_local_shares(lengths, 512, COST, shares, max_work=200)
    assert sorted(q for s in out for q in s) == list(range(60))
    assert sum(priced) <= 200 + 60  # the last share priced may cross the budget


def _plan_max(lengths, cap, **opts):
    plan = make_plan(tuple(lengths), world_size=4, capacity=cap, planner="balance", cost_model=COST, **opts)
    return max(plan.rank_times()), plan


def test_balance_plans_all_short_steps_no_slower_and_sometimes_faster_with_refinement():
    import random

    gains = []
    for seed in range(12):
        rng = random.Random(seed)
        lengths = [rng.randint(64, 512) for _ in range(16)]
        refined, plan = _plan_max(lengths, 512)
        plain, _ = _plan_max(lengths, 512, options={"refine": False})
        assert refined <= plain * (1 + 1e-12)
        assert all(len(mb.pieces) and mb.ring is None for mbs in plan.ranks for mb in mbs)
        gains.append(plain / refined)
    assert max(gains) > 1.01, gains  # the refinement changes something on this data


def test_plans_with_rings_are_left_alone():
    lengths = [3000, 200, 150, 400, 90, 60, 300]
    refined, a = _plan_max(lengths, 1024)
    plain, b = _plan_max(lengths, 1024, options={"refine": False})
    assert any(mb.ring is not None for mbs in a.ranks for mb in mbs)
    assert [[(mb.ring, [p.seq for p in mb.pieces]) for mb in mbs] for mbs in a.ranks] == [
        [(mb.ring, [p.seq for p in mb.pieces]) for mb in mbs] for mbs in b.ranks
    ]
