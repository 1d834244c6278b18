"""The plain longest-processing-time peer (``lpt``): minimal rings, longest first, least loaded."""

from __future__ import annotations

import pytest

from lightning_bytescale.planner import CostModel, PlanError, make_plan, ranks_without_offload

# T(s) = s^2 per layer, one layer, no communication: a local micro-batch costs the sum of s^2,
# a ring member of N costs s^2 / N (plus nothing: b = g = 0)
SQUARE = CostModel(a=1.0, b=0.0)


def _runs(plan):
    return [[(mb.ring, sorted(p.seq for p in mb.pieces)) for mb in mbs] for mbs in plan.ranks]


def test_by_hand_ring_first_then_packed_bins_on_the_least_loaded_rank():
    # 20 tokens at C = 10: a ring of 2 (member time 400 / 2 = 200) on both ranks first.  The
    # short ones are packed best-fit-decreasing into [6, 4] (time 52) and [5, 3] (time 34);
    # the longer bin goes to rank 0 (tie on load 200, lower rank), the other to rank 1.
    plan = make_plan([20, 6, 5, 4, 3], world_size=2, capacity=10, planner="lpt", cost_model=SQUARE)
    plan.validate()
    assert _runs(plan) == [[((0, 1), [0]), (None, [1, 3])], [((0, 1), [0]), (None, [2, 4])]]
    assert plan.finish_times() == [252.0, 234.0]


def test_least_loaded_ranks_take_the_next_item_and_members_start_together():
    # rings: 30 on 3 ranks (300 each), 16 on 2 ranks (128 each); locals 9 (81), 8 (64), 7 (49).
    # world 4: ring 30 -> ranks 0-2 (end 300); ring 16 -> rank 3 and rank 0 (start 300, end 428);
    # local 9 -> rank 1 (300 -> 381), 8 -> rank 2 (300 -> 364), 7 -> rank 2 (364 -> 413)
    plan = make_plan([30, 16, 9, 8, 7], world_size=4, capacity=10, planner="lpt", cost_model=SQUARE)
    plan.validate()
    assert _runs(plan) == [
        [((0, 1, 2), [0]), ((0, 3), [1])],
        [((0, 1, 2), [0]), (None, [2])],
        [((0, 1, 2), [0]), (None, [3]), (None, [4])],
        [((0, 3), [1])],
    ]
    assert plan.finish_times() == [428.0, 381.0, 413.0, 428.0]


@pytest.mark.parametrize("offload", [None, True, False])
def test_every_long_sequence_on_its_minimal_ring_whatever_the_offload_option(offload):
    lengths = [100, 33, 65, 9, 17, 4, 4, 4]
    plan = make_plan(lengths, world_size=8, capacity=16, planner="lpt", offload=offload).validate()
    holders: dict[int, set[int]] = {}
    for r, mbs in enumerate(plan.ranks):
        for mb in mbs:
            assert mb.offload_ratio == 0.0
            for p in mb.pieces:
                holders.setdefault(p.seq, set()).add(r)
    assert {q: len(h) for q, h in holders.items()} == {
        q: ranks_without_offload(s, 16) for q, s in enumerate(lengths)
    }


def test_ring_times_come_from_the_communication_aware_model():
    cm = CostModel(
        a=1e-9, b=1e-6, kv_bytes_per_token_per_layer=1000.0, bandwidth_inter=1e9, bandwidth_intra=1e10
    )
    plan = make_plan([2048], world_size=8, capacity=512, planner="lpt", cost_model=cm, ranks_per_node=2)
    ring = plan.ranks[0][0].ring
    assert ring == (0, 1, 2, 3)  # the 4 least-loaded ranks, blind to nodes
    t, exposed = cm.ring_member_time([2048], 4, intra=False)
    assert exposed > 0 and plan.ranks[0][0].est_time == pytest.approx(t)


def test_too_long_sequence_names_it_and_the_fix():
    with pytest.raises(
        PlanError, match=r"sequence 1 has length 90 and needs 9 ranks.*world_size is 4; add ranks"
    ):
        make_plan([5, 90], world_size=4, capacity=10, planner="lpt")
