"""Each rank's micro-batch order for the gradient sync: a local micro-batch last where that costs nothing.

A step's gradient buckets are summed on a communicator of their own while ring attention
exchanges point-to-point on the global one.  So that the two never cross (docs/engine.md, the
cross-communicator rule), the engine launches buckets from the backward's hooks only in a last
backward *without* ring exchanges; after a ring micro-batch's backward every bucket is launched
once it has ended, and none of the sync hides behind it.  A rank whose last micro-batch is a
ring therefore loses the overlap DDP has.  Its local micro-batches depend on no other rank, so
one of them can run last instead: :func:`local_last` moves it to the end of the rank's list.

Ring items keep their places relative to each other on every rank, so the plan's item order
(promise 4 of :meth:`~.plan.Plan.validate`, which makes the rings deadlock-free) still holds,
and since every rank plans the same batch with the same function, every rank holds the same
reordered plan (the digest covers the order).  Moving a local micro-batch out of the gap
where it waited for a ring's peers can make the rank finish later, so a move is kept only when
the plan's estimated step time (the latest finish, :meth:`~.plan.Plan.finish_times`) does not
grow: the rank's new finish is computed with the other members' arrivals at each ring item from
the schedule before any move, an upper bound (a move only makes ring items start earlier or at
the same time), so an accepted move never lengthens the step even after later ones.  The sync's
own time is not in the cost model; the rule never trades estimated compute time for overlap.
Plans with pipelines (``pipeline_degree > 1``) are left as placed (their step time depends on
the 1F1B order, which ``order_pipelines`` sets for the pipeline executor), and so are plans with barrier rounds
(``options["rounds"]``, Megatron's dynamic-CP reading in :mod:`.peers`: a round is a list of
positions, and the simulator times the plan round by round).
"""

from __future__ import annotations

from lightning_bytescale.planner.plan import MicroBatch, Plan

__all__ = ["local_last", "ring_last_ranks"]

_REL_TOL = 1e-12


def ring_last_ranks(plan: Plan) -> list[int]:
    """The ranks whose last micro-batch is a ring member's share."""
    return [r for r, mbs in enumerate(plan.ranks) if mbs and mbs[-1].ring is not None]


def local_last(plan: Plan) -> Plan:
    """Move a local micro-batch to the end of each rank whose last one is a ring, where it costs nothing.

    For such a rank the candidates are its last local micro-batch, then its shortest one
    (estimated time); the first whose move keeps the plan's latest estimated finish is moved.
    Changes ``plan`` in place and returns it.
    """
    if int(plan.options.get("pipeline_degree", 1) or 1) > 1 or plan.options.get("rounds") is not None:
        return plan
    candidates = [r for r in ring_last_ranks(plan) if any(mb.ring is None for mb in plan.ranks[r])]
    if not candidates:
        return plan
    finish, arrivals = plan.schedule()
    makespan = max(finish)
    bound = makespan + _REL_TOL * max(abs(makespan), 1.0)
    for r in candidates:
        mbs = plan.ranks[r]
        others = {
            mb.item: max((t for q, t in arrivals[mb.item].items() if q != r), default=0.0)
            for mb in mbs
            if mb.item is not None
        }
        locals_ = [j for j, mb in enumerate(mbs) if mb.ring is None]
        shortest = min(locals_, key=lambda j: (mbs[j].est_time, -j))
        for j in dict.fromkeys((locals_[-1], shortest)):
            order = mbs[:j] + mbs[j + 1 :] + [mbs[j]]
            if _finish(order, others) <= bound:
                plan.ranks[r] = order
                break
    return plan


def _finish(order: list[MicroBatch], others: dict[int, float]) -> float:
    """When a rank running ``order`` finishes, each ring item starting no earlier than ``others[item]``."""
    clock = 0.0
    for mb in order:
        if mb.item is not None:
            clock = max(clock, others[mb.item])
        clock += mb.est_time
    return clock
