"""The simulator's timelines against timelines worked out by hand on tiny plans."""

from __future__ import annotations

import pytest

from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan
from lightning_bytescale.sim.timeline import (
    MicroBatchCost,
    SimulationError,
    one_f_one_b,
    ring_allreduce_seconds,
    simulate_pipelines,
    simulate_ranks,
)


def _local(seq: int, n: int) -> MicroBatch:
    return MicroBatch(pieces=[Piece(seq, ((0, n),))])


def _ring(seq: int, ring: tuple[int, ...], item: int, rng: tuple[int, int]) -> MicroBatch:
    return MicroBatch(pieces=[Piece(seq, (rng,))], ring=ring, item=item)


def _by_tokens(rank: int, mb: MicroBatch) -> MicroBatchCost:
    """Duration = tokens held (seconds); easy to add up by hand."""
    return MicroBatchCost(duration=float(mb.num_tokens), compute=float(mb.num_tokens))


def test_compute_only_two_ranks():
    plan = Plan(2, 8, "hand", (1, 2, 4), [[_local(0, 1), _local(1, 2)], [_local(2, 4)]])
    tl = simulate_ranks(plan, _by_tokens)
    assert [t.finish for t in tl] == [3.0, 4.0]
    assert [t.busy for t in tl] == [3.0, 4.0]
    assert tl[0].spans == [(0.0, 1.0), (1.0, 3.0)]


def test_ring_item_starts_when_last_member_arrives():
    # rank 0: local (1 s) then ring item 0; rank 1: ring item 0 then local (3 s); rank 2 idle.
    ring = (0, 1)
    plan = Plan(
        3,
        8,
        "hand",
        (1, 4, 3),
        [[_local(0, 1), _ring(1, ring, 0, (0, 2))], [_ring(1, ring, 0, (2, 4)), _local(2, 3)], []],
    )
    tl = simulate_ranks(plan, _by_tokens)
    assert tl[0].spans == [(0.0, 1.0), (1.0, 3.0)]
    assert tl[1].spans == [(1.0, 3.0), (3.0, 6.0)]  # waited 1 s for rank 0
    assert tl[1].finish - tl[1].busy == pytest.approx(1.0)
    assert tl[2].finish == 0.0 and tl[2].num_micro_batches == 0


def test_ring_lasts_slowest_member():
    ring = (0, 1)
    plan = Plan(2, 8, "hand", (5,), [[_ring(0, ring, 0, (0, 2))], [_ring(0, ring, 0, (2, 5))]])
    tl = simulate_ranks(plan, _by_tokens)
    assert [t.finish for t in tl] == [3.0, 3.0]


def test_crossed_ring_order_is_reported_not_hung():
    a, b = (0, 1), (0, 1)
    plan = Plan(
        2,
        8,
        "hand",
        (2, 2),
        [
            [_ring(0, a, 0, (0, 1)), _ring(1, b, 1, (0, 1))],
            [_ring(1, b, 1, (1, 2)), _ring(0, a, 0, (1, 2))],
        ],
    )
    with pytest.raises(SimulationError, match="never finish"):
        simulate_ranks(plan, _by_tokens)


def test_barrier_rounds_wait_for_slowest_rank():
    # round 0: rank 0 runs 5 s, rank 1 runs 1 s; round 1: both run 2 s -> both finish at 7.
    plan = Plan(
        2,
        8,
        "hand",
        (5, 1, 2, 2),
        [[_local(0, 5), _local(2, 2)], [_local(1, 1), _local(3, 2)]],
        options={"rounds": [[0, 1], [0, 1]]},
    )
    tl = simulate_ranks(plan, _by_tokens)
    assert [t.finish for t in tl] == [7.0, 7.0]
    assert tl[1].spans == [(0.0, 1.0), (5.0, 7.0)]
    no_barrier = Plan(2, 8, "hand", plan.lengths, plan.ranks)
    assert [t.finish for t in simulate_ranks(no_barrier, _by_tokens)] == [7.0, 3.0]


def test_one_f_one_b_two_stages_by_hand():
    # equal micro-batches: f = 1, b = 2 per stage -> (m + p - 1) (f + b) = 9
    assert one_f_one_b([6.0, 6.0], 2) == pytest.approx(9.0)
    # unequal: f0=1 b0=2, f1=2 b1=4 per stage.  S0: F0 0-1, F1 1-3, B0 4-6, B1 10-14;
    # S1: F0 1-2, B0 2-4, F1 4-6, B1 6-10  -> 14
    assert one_f_one_b([6.0, 12.0], 2) == pytest.approx(14.0)
    # one stage is a plain sum
    assert one_f_one_b([1.0, 2.0, 3.0], 1) == pytest.approx(6.0)


def test_pipelines_report_bubble():
    plan = Plan(2, 8, "hand", (6, 6, 6), [[_local(0, 6), _local(1, 6)], [_local(2, 6)]])
    tl = simulate_pipelines(plan, _by_tokens, stages=2)
    assert tl[0].finish == pytest.approx(9.0)  # bubble 1/3 inside the pipeline
    assert tl[0].busy == pytest.approx(6.0)
    assert tl[1].finish == pytest.approx(6.0)  # one micro-batch: f + f + b + b = 1+1+2+2


def test_ring_allreduce_formula():
    assert ring_allreduce_seconds(1e9, 4, 1e9) == pytest.approx(1.5)
    assert ring_allreduce_seconds(1e9, 1, 1e9) == 0.0
    assert ring_allreduce_seconds(1e9, 2, 1e9, latency=1e-3) == pytest.approx(1.0 + 2e-3)


def test_pipelines_with_barrier_rounds_run_in_lock_step():
    # round 0: pipeline 0 runs 6 s, pipeline 1 runs 3 s; round 1: pipeline 1 only (3 s).
    plan = Plan(
        2,
        8,
        "hand",
        (6, 3, 3),
        [[_local(0, 6)], [_local(1, 3), _local(2, 3)]],
        options={"rounds": [[0], [0, 1]]},
    )
    tl = simulate_pipelines(plan, _by_tokens, stages=2)
    # slots [6, 3] on 2 stages: f0=1 b0=2 f1=0.5 b1=1 -> S0 F0 0-1, F1 1-1.5, B0 4-6, B1 6-7;
    # S1 F0 1-2, B0 2-4, F1 4-4.5, B1 4.5-5.5 -> 7 for both pipelines (pipeline 0's empty
    # round-1 slot waits for pipeline 1's 3 s micro-batch)
    assert [t.finish for t in tl] == [pytest.approx(7.0), pytest.approx(7.0)]
    assert tl[0].busy == pytest.approx(3.0) and tl[1].busy == pytest.approx(3.0)
