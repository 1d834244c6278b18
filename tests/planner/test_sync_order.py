"""A local micro-batch last where it costs nothing (``planner.sync_order.local_last``).

Hand plans, times worked out by hand: a move that keeps the step time is made, one that would
lengthen it (the local sat in a ring's wait gap) is not.  On plans of the real planners
(hypothesis over data, worlds and planners): the reordered plan is valid, every rank keeps its
micro-batches and its ring items' order, the estimated step time does not grow, and fewer
ranks (never more) end on a ring than as placed.
"""

from __future__ import annotations

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lightning_bytescale.planner import PlanError, distributions, make_plan
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan
from lightning_bytescale.planner.planners import _place
from lightning_bytescale.planner.sync_order import local_last, ring_last_ranks


def _local(seq: int, length: int, t: float) -> MicroBatch:
    return MicroBatch([Piece(seq, ((0, length),))], est_time=t)


def _ring(seq: int, member: int, item: int, t: float) -> MicroBatch:
    ranges = (((0, 2), (6, 8)), ((2, 6),))[member]  # a length-8 sequence on a ring of 2 ranks
    return MicroBatch([Piece(seq, ranges)], ring=(0, 1), item=item, est_time=t)


def test_a_local_before_the_ring_moves_last_when_the_step_does_not_get_longer():
    # rank 0: local (1 s), ring item 0 (2 s); rank 1: ring item 0.  Before: the ring starts at 1,
    # both finish at 3.  After: the ring starts at 0 and ends at 2, rank 0's local ends at 3.
    plan = Plan(2, 8, "hand", (4, 8), [[_local(0, 4, 1.0), _ring(1, 0, 0, 2.0)], [_ring(1, 1, 0, 2.0)]])
    assert plan.validate().finish_times() == [3.0, 3.0]
    local_last(plan).validate()
    assert [mb.ring for mb in plan.ranks[0]] == [(0, 1), None]
    assert plan.finish_times() == [3.0, 2.0]
    assert ring_last_ranks(plan) == [1]  # rank 1 has no local micro-batch to move


def test_a_local_that_fills_a_rings_wait_gap_stays_where_it_is():
    # rank 0 waits 4 s for rank 1 before the ring and runs its 1 s local in that gap: moving the
    # local last would end rank 0 at 5 + 2 + 1 = 8 instead of 7; rank 1's 5 s local likewise
    ranks = [[_local(0, 4, 1.0), _ring(1, 0, 0, 2.0)], [_local(2, 4, 5.0), _ring(1, 1, 0, 2.0)]]
    plan = Plan(2, 8, "hand", (4, 8, 4), ranks).validate()
    assert plan.finish_times() == [7.0, 7.0]
    before = plan.digest()
    local_last(plan)
    assert plan.digest() == before


def test_the_shortest_local_is_tried_when_the_last_one_does_not_fit():
    # rank 0: locals of 1 s and 3 s, then ring item 0 (2 s); rank 1: a 6 s local, the ring, a 2 s
    # local.  The ring runs 6..8 (rank 1 arrives last); rank 0 ends at 8, rank 1 at 10.  Moving
    # rank 0's last local (3 s) last ends it at 8 + 3 = 11 > 10: refused; its shortest (1 s) ends
    # it at 9: kept.  Rank 1 ends on a local already.
    ranks = [
        [_local(0, 4, 1.0), _local(2, 4, 3.0), _ring(1, 0, 0, 2.0)],
        [_local(3, 4, 6.0), _ring(1, 1, 0, 2.0), _local(4, 4, 2.0)],
    ]
    plan = Plan(2, 8, "hand", (4, 8, 4, 4, 4), ranks).validate()
    assert plan.finish_times() == [8.0, 10.0]
    local_last(plan).validate()
    assert [mb.est_time for mb in plan.ranks[0]] == [3.0, 2.0, 1.0]
    assert plan.finish_times() == [9.0, 10.0]


def test_plans_with_pipelines_or_barrier_rounds_are_left_as_placed():
    for options in ({"pipeline_degree": 2}, {"rounds": [[0, 0], [0]]}):
        ranks = [[_local(0, 4, 1.0), _ring(1, 0, 0, 2.0)], [_ring(1, 1, 0, 2.0)]]
        plan = Plan(2, 8, "hand", (4, 8), ranks, dict(options))
        before = plan.digest()
        assert local_last(plan).digest() == before


@st.composite
def _cases(draw):
    data = draw(st.sampled_from(["byted", "github", "short"]))
    world = draw(st.sampled_from([2, 3, 4, 8, 16]))
    planner = draw(st.sampled_from(["balance", "naive", "static", "lpt", "verl_kk"]))
    seed = draw(st.integers(0, 10_000))
    capacity = 2048
    if data == "short":
        lengths = [int(x) for x in distributions.sample_lengths("github", 40 * world, seed=seed) % 2000 + 16]
    else:
        lengths = distributions.sample_global_batch(
            data, tokens=capacity * world * 3, context_length=8 * capacity, seed=seed
        )
    cp = 2 if world % 2 == 0 else 1
    return lengths, world, planner, capacity, seed, cp


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_on_real_plans_the_order_keeps_every_promise_and_never_lengthens_the_step(case):
    lengths, world, planner, capacity, seed, cp = case
    options = dict(world_size=world, capacity=capacity, planner=planner, seed=seed)
    if planner == "static":
        options["cp_size"] = cp
    try:
        placed = _place(lengths, **options)
    except PlanError:  # a batch this planner cannot place (a sequence longer than its rings hold)
        assume(False)
    ordered = make_plan(lengths, **options).validate()
    assert ordered.world_size == placed.world_size
    for before, after in zip(placed.ranks, ordered.ranks, strict=True):
        assert sorted(map(repr, before)) == sorted(map(repr, after))  # the same micro-batches
        assert [mb.item for mb in before if mb.ring] == [mb.item for mb in after if mb.ring]
    assert max(ordered.finish_times()) <= max(placed.finish_times()) * (1 + 1e-9) + 1e-12
    assert set(ring_last_ranks(ordered)) <= set(ring_last_ranks(placed))
    assert ordered.digest() == make_plan(lengths, **options).digest()  # every rank plans the same


def test_on_long_tailed_data_fewer_ranks_end_on_a_ring():
    placed_ring_last = ordered_ring_last = 0
    for seed in range(5):
        lengths = distributions.sample_global_batch(
            "byted", tokens=8 * 8192 * 2, context_length=4 * 8192, seed=seed
        )
        options = dict(world_size=8, capacity=8192, planner="naive", seed=seed)
        placed_ring_last += len(ring_last_ranks(_place(lengths, **options)))
        ordered_ring_last += len(ring_last_ranks(make_plan(lengths, **options)))
    assert ordered_ring_last < placed_ring_last
