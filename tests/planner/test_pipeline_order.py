"""Ring items across pipelines (``planner.pipeline_order``): the index rule and the 1F1B deadlock check.

Hand cases show each check fire; hypothesis draws random plans (P in 1..4 stages, 1..4
pipelines, random micro-batch counts and ring memberships, ring items placed anywhere in
increasing item order) and finds no ordered schedule that deadlocks; the same plans ordered
with the rule broken (as placed, ring items last, one member shifted by a micro-batch) give
schedules the check refuses.  The graph check is compared with a step-by-step run of every
stage written here on its own (a ring op runs when all its members stand at it), and the clock
of docs/pipelines.md (``2i + p`` forwards, ``2i + 2P - 1 - p`` backwards) is checked to grow
along every dependency of a single 1F1B pipeline.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from lightning_bytescale.planner import PlanError, PlanValidationError, make_plan
from lightning_bytescale.planner.pipeline_order import (
    PipelineOrder,
    check_pipeline_order,
    deadlock_cycle,
    index_rule_faults,
    order_pipelines,
    ring_order_conflicts,
    stage_ops,
    torch_1f1b_program,
)
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan
from lightning_bytescale.planner.zigzag import all_member_ranges

# ---------------------------------------------------------------- building plans


def _plan(stages: int, layout: list[list], rings: dict[int, tuple[int, ...]]) -> Plan:
    """A valid plan: ``layout[r]`` lists pipeline r's micro-batches, ``"L"`` a local one, an int a ring item."""
    lengths: list[int] = []
    seq_of: dict[int, int] = {}
    for item in sorted(rings):
        seq_of[item] = len(lengths)
        lengths.append(4 * len(rings[item]))
    ranks = []
    for r, row in enumerate(layout):
        mbs = []
        for x in row:
            if x == "L":
                mbs.append(MicroBatch([Piece(len(lengths), ((0, 3),))], est_time=1.0))
                lengths.append(3)
            else:
                ring = rings[x]
                share = all_member_ranges(lengths[seq_of[x]], len(ring))[ring.index(r)]
                mbs.append(MicroBatch([Piece(seq_of[x], share)], ring=ring, item=x, est_time=1.0))
        ranks.append(mbs)
    return Plan(len(layout), 64, "hand", tuple(lengths), ranks, {"pipeline_degree": stages}).validate()


@st.composite
def plans(draw) -> Plan:
    """Random plans: ring items on random member sets, each pipeline's items in increasing id among its locals."""
    stages = draw(st.integers(1, 4))
    n = draw(st.integers(1, 4))
    rings: dict[int, tuple[int, ...]] = {}
    if n >= 2:
        for item in range(draw(st.integers(0, 6))):
            members = draw(st.sets(st.integers(0, n - 1), min_size=2, max_size=n))
            rings[item] = tuple(draw(st.permutations(sorted(members))))
    layout = []
    for r in range(n):
        mine = [item for item in sorted(rings) if r in rings[item]]
        row: list = ["L"] * draw(st.integers(0, 6))
        for _ in mine:  # ring items at random places, in increasing item order
            row.insert(draw(st.integers(0, len(row))), None)
        it = iter(mine)
        layout.append([next(it) if x is None else x for x in row])
    return _plan(stages, layout, rings)


def _as_placed(plan: Plan) -> PipelineOrder:
    return PipelineOrder(int(plan.options["pipeline_degree"]), [list(mbs) for mbs in plan.ranks])


def _ring_last(plan: Plan) -> PipelineOrder:
    order = [
        [mb for mb in mbs if mb.ring is None] + [mb for mb in mbs if mb.ring is not None]
        for mbs in plan.ranks
    ]
    return PipelineOrder(int(plan.options["pipeline_degree"]), order)


def _shifted(plan: Plan) -> PipelineOrder:
    """The rule's order with one local (or padding) micro-batch moved to the front of pipeline 0."""
    order = order_pipelines(plan)
    slots = [list(s) for s in order.slots]
    first = slots[0] if slots else []
    locals_ = [j for j, mb in enumerate(first) if mb is None or mb.ring is None]
    if locals_:
        first.insert(0, first.pop(locals_[-1]))
    elif first:
        first.insert(0, None)
    return PipelineOrder(order.stages, slots)


def _layout(order: PipelineOrder) -> list[list]:
    return [["-" if mb is None else "L" if mb.ring is None else mb.item for mb in s] for s in order.slots]


# ---------------------------------------------------------------- an independent run


def _runs_to_the_end(order: PipelineOrder) -> bool:
    """Step every stage through its 1F1B ops; a ring op runs once all its members stand at it with inputs ready."""
    p = order.stages
    programs = {(r, s): stage_ops(len(slots), p, s) for r, slots in enumerate(order.slots) for s in range(p)}
    at = dict.fromkeys(programs, 0)
    done: set[tuple[int, int, str, int]] = set()

    def current(dev):
        prog = programs[dev]
        return prog[at[dev]] if at[dev] < len(prog) else None

    def inputs_ready(r, s, kind, i) -> bool:
        if kind == "F":
            return s == 0 or (r, s - 1, "F", i) in done
        return (r, s, "F", i) in done if s == p - 1 else (r, s + 1, "B", i) in done

    moved = True
    while moved:
        moved = False
        for r, s in programs:
            op = current((r, s))
            if op is None or not inputs_ready(r, s, *op):
                continue
            mb = order.slots[r][op[1]]
            if mb is None or mb.ring is None:
                group = [(r, op[1])]
            else:
                group = []
                for q in mb.ring:
                    other = current((q, s))
                    if other is None or other[0] != op[0]:
                        break
                    omb = order.slots[q][other[1]]
                    if omb is None or omb.item != mb.item or not inputs_ready(q, s, *other):
                        break
                    group.append((q, other[1]))
                if len(group) != len(mb.ring):
                    continue
            for q, i in group:
                done.add((q, s, op[0], i))
                at[(q, s)] += 1
            moved = True
    return all(current(dev) is None for dev in programs)


# ---------------------------------------------------------------- the 1F1B op sequence and its clock


def test_stage_ops_is_1f1b():
    assert stage_ops(5, 4, 0) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4)] + [
        ("B", 1),
        ("B", 2),
        ("B", 3),
        ("B", 4),
    ]
    assert stage_ops(5, 4, 3) == [x for i in range(5) for x in (("F", i), ("B", i))]
    assert stage_ops(2, 4, 0) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]  # fewer than P - 1 micro-batches
    assert stage_ops(0, 3, 1) == []
    with pytest.raises(PlanError):
        stage_ops(3, 2, 2)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
def test_the_clock_grows_along_every_dependency_of_one_pipeline(stages):
    # docs/pipelines.md: forward i on stage p at 2i + p, backward at 2i + 2P - 1 - p, for any count
    def clock(stage, kind, i):
        return 2 * i + stage if kind == "F" else 2 * i + 2 * stages - 1 - stage

    for m in range(12):
        for s in range(stages):
            ops = stage_ops(m, stages, s)
            assert sorted(ops) == sorted([(k, i) for i in range(m) for k in "FB"])
            for a, b in zip(ops, ops[1:], strict=False):
                assert clock(s, *a) < clock(s, *b), (m, s, a, b)
            for i in range(m):
                if s > 0:
                    assert clock(s - 1, "F", i) < clock(s, "F", i)
                if s < stages - 1:
                    assert clock(s + 1, "B", i) < clock(s, "B", i)
            if s == stages - 1:
                assert all(clock(s, "F", i) < clock(s, "B", i) for i in range(m))


def test_torch_1f1b_program_runs_1f1b_and_one_pipeline_never_waits_forever():
    # stage 0 of 2, two micro-batches: the last warm-up send is fused with the first backward's receive
    assert torch_1f1b_program(2, 2, 0) == [
        ("F", 0),
        ("fire", (("send", "F", 0, 0, 1),)),
        ("F", 1),
        ("wait", (("send", "F", 0, 0, 1),)),
        ("fire", (("send", "F", 1, 0, 1), ("recv", "B", 0, 1, 0))),
        ("wait", (("send", "F", 1, 0, 1), ("recv", "B", 0, 1, 0))),
        ("B", 0),
        ("fire", (("recv", "B", 1, 1, 0),)),
        ("wait", (("recv", "B", 1, 1, 0),)),
        ("B", 1),
    ]
    for stages in range(1, 7):
        for m in range(12):
            for s in range(stages):
                computes = [e for e in torch_1f1b_program(m, stages, s) if e[0] in ("F", "B")]
                assert computes == stage_ops(m, stages, s), (stages, m, s)
            one = PipelineOrder(stages, [[MicroBatch([Piece(0, ((0, 1),))]) for _ in range(m)]])
            assert deadlock_cycle(one, transfers="torch_1f1b") is None, (stages, m)
    with pytest.raises(PlanError, match="transfers"):
        deadlock_cycle(one, transfers="blocking")


# ---------------------------------------------------------------- hand cases


def test_items_two_apart_on_one_member_and_adjacent_on_the_other_deadlock():
    # P = 2, stage 0 has one warm-up forward: pipeline 0 runs F x, B x, F y; pipeline 1 F x, F y, B x
    plan = _plan(2, [[0, "L", 1, "L"], [0, 1, "L"]], {0: (0, 1), 1: (0, 1)})
    broken = _as_placed(plan)
    assert index_rule_faults(broken) == ["ring item 1 sits at different micro-batch indices {0: 2, 1: 1}"]
    assert ring_order_conflicts(broken) == [
        "stage 0: pipeline 0 reaches backward of ring item 0 before forward of ring item 1, pipeline 1 the "
        "other way round"
    ]
    assert deadlock_cycle(broken) is not None
    assert not _runs_to_the_end(broken)
    with pytest.raises(PlanValidationError, match="different orders"):
        check_pipeline_order(broken)
    order = check_pipeline_order(order_pipelines(plan))
    assert _layout(order) == [[0, 1, "L", "L"], [0, 1, "L"]]
    assert _runs_to_the_end(order)


def test_a_gap_is_filled_with_a_local_or_padded():
    # item 0 on pipelines 0 and 1, item 1 on 1 and 2: item 1 goes to index 1, pipeline 2 needs a filler
    rings = {0: (0, 1), 1: (1, 2)}
    order = order_pipelines(_plan(3, [[0, "L"], [0, 1], ["L", 1]], rings))
    assert _layout(order) == [[0, "L"], [0, 1], ["L", 1]] and order.pads == [0, 0, 0]
    order = order_pipelines(_plan(3, [[0, "L"], [0, 1], [1]], rings))
    assert _layout(order) == [[0, "L"], [0, 1], ["-", 1]] and order.pads == [0, 0, 1]
    assert check_pipeline_order(order) is order and _runs_to_the_end(order)
    with pytest.raises(PlanError, match="pipeline 2 has 0 local micro-batches .* 1 short"):
        order_pipelines(_plan(3, [[0, "L"], [0, 1], [1]], rings), strict=True)


def test_one_stage_keeps_the_plan_order():
    plan = _plan(1, [["L", 0, 1], [0, "L", "L", 1]], {0: (0, 1), 1: (1, 0)})
    order = order_pipelines(plan)
    assert _layout(order) == [["L", 0, 1], [0, "L", "L", 1]]
    assert check_pipeline_order(order) is order


def test_the_pairwise_check_misses_a_three_ring_cycle_the_graph_check_finds():
    # one stage, items x=0 on {0, 2}, y=1 on {0, 1}, z=2 on {1, 2}; pipeline 2 runs z before x.
    # Every two pipelines share one item only, so no pair disagrees, yet 0 waits for 2 at x,
    # 2 for 1 at z and 1 for 0 at y.  (Plan.validate refuses it: pipeline 2 breaks the item order.)
    mb = {
        k: MicroBatch([Piece(k, ((0, 1),))], ring=ring, item=k)
        for k, ring in enumerate([(0, 2), (0, 1), (1, 2)])
    }
    order = PipelineOrder(1, [[mb[0], mb[1]], [mb[1], mb[2]], [mb[2], mb[0]]])
    assert ring_order_conflicts(order) == []
    cycle = deadlock_cycle(order)
    assert cycle is not None and len(cycle) == 6  # each item's forward and backward
    assert not _runs_to_the_end(order)
    with pytest.raises(PlanValidationError, match="deadlocks"):
        check_pipeline_order(order)


# ---------------------------------------------------------------- random plans


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans())
def test_ordered_plans_never_deadlock(plan):
    order = order_pipelines(plan)
    p = order.stages
    for r, (mbs, slots) in enumerate(zip(plan.ranks, order.slots, strict=True)):
        real = [mb for mb in slots if mb is not None]
        assert sorted(map(id, real)) == sorted(map(id, mbs)), r  # the same micro-batches, once each
        for kind in (lambda mb: mb.ring is None, lambda mb: mb.ring is not None):
            assert [mb for mb in real if kind(mb)] == [
                mb for mb in mbs if kind(mb)
            ]  # each kind keeps its order
    assert p == 1 or index_rule_faults(order) == []  # one stage keeps the plan's order (item order suffices)
    assert ring_order_conflicts(order) == []
    assert deadlock_cycle(order) is None
    assert check_pipeline_order(order) is order
    assert _runs_to_the_end(order)
    torch_ready = order_pipelines(plan, min_micro_batches=p)  # torch's Schedule1F1B needs P or more
    assert min(torch_ready.micro_batch_counts, default=p) >= p
    assert check_pipeline_order(torch_ready, transfers="torch_1f1b") is torch_ready
    assert torch_ready.ring_indices() == order.ring_indices()
    if not any(order.pads):
        Plan(plan.world_size, plan.capacity, "x", plan.lengths, order.slots, dict(plan.options)).validate()
    if p == 1:
        assert order.slots == plan.ranks


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans(), st.sampled_from([_as_placed, _ring_last, _shifted]))
def test_the_graph_check_agrees_with_running_the_stages(plan, how):
    order = how(plan)
    cycle = deadlock_cycle(order)
    assert (cycle is None) == _runs_to_the_end(order), (_layout(order), cycle)
    if ring_order_conflicts(order):
        assert cycle is not None
    if cycle is None:
        check_pipeline_order(order)
    else:
        with pytest.raises(PlanValidationError):
            check_pipeline_order(order)


@pytest.mark.parametrize("transfers", ["buffered", "torch_1f1b"])
@pytest.mark.parametrize("broken", [_as_placed, _ring_last, _shifted])
def test_with_the_index_rule_broken_the_check_finds_a_deadlock(broken, transfers):
    found = find(
        plans(),
        lambda plan: deadlock_cycle(broken(plan), transfers=transfers) is not None,
        settings=settings(max_examples=3000, deadline=None, database=None, phases=[Phase.generate]),
    )
    order = broken(found)
    assert index_rule_faults(order)
    with pytest.raises(PlanValidationError):
        check_pipeline_order(order, transfers=transfers)
    assert deadlock_cycle(order_pipelines(found), transfers=transfers) is None  # ordered by the rule, it runs


@pytest.mark.parametrize(("stages", "world", "seed"), [(2, 4, 0), (4, 4, 1), (4, 8, 2), (8, 8, 3)])
def test_the_planners_pipeline_plans_ordered_by_the_rule_run(stages, world, seed):
    rng = random.Random(seed)
    lengths = [rng.choice([100, 200, 400, 3000, 6000, 12000]) for _ in range(12 * world)]
    plan = make_plan(lengths, world_size=world, capacity=4096, planner="balance", pipeline_degree=stages)
    assert any(mb.ring is not None for mbs in plan.ranks for mb in mbs)
    order = check_pipeline_order(order_pipelines(plan))
    assert index_rule_faults(order) == []
    assert _runs_to_the_end(order)
    check_pipeline_order(order_pipelines(plan, min_micro_batches=stages), transfers="torch_1f1b")
