"""Per-rank timelines of one step: when each micro-batch starts and ends on every rank.

The simulator needs more than a sum of per-rank costs: a ring item starts only when *all*
of its members have reached it (they exchange K/V blocks in lock step), a plan with
barriers (Megatron-style groups) makes every rank wait for the slowest one at each
barrier, and with pipeline parallelism each pipeline runs a 1F1B schedule whose bubbles
depend on the order and size of its micro-batches.  This module turns a plan plus a
duration for every micro-batch into those timelines; it knows nothing of the cost model
(see :mod:`.costs`), so it can be checked against timelines computed by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_bytescale.errors import ByteScaleError
from lightning_bytescale.planner.pipeline import one_f_one_b
from lightning_bytescale.planner.plan import MicroBatch, Plan

__all__ = [
    "CostFn",
    "MicroBatchCost",
    "RankTimeline",
    "SimulationError",
    "one_f_one_b",
    "ring_allreduce_seconds",
    "simulate_pipelines",
    "simulate_ranks",
]


class SimulationError(ByteScaleError, ValueError):
    """Simulator input that cannot be simulated.

    An unknown scenario or planner, a scenario whose degrees or lengths do not fit its GPUs, or a
    plan that cannot run as given (for example, ring items in an order that deadlocks).
    """


@dataclass(frozen=True)
class MicroBatchCost:
    """What one micro-batch costs one rank (seconds; bytes sent for ``ring_bytes``)."""

    duration: float
    compute: float = 0.0
    exposed_comm: float = 0.0
    exposed_offload: float = 0.0
    ring_bytes: float = 0.0
    mode: str = "ring"  # the attention mode whose communication ``exposed_comm`` and ``ring_bytes`` are


@dataclass
class RankTimeline:
    """One rank's (or, with pipelines, one pipeline's) step.

    ``busy`` is the time spent running micro-batches (compute plus exposed transfers),
    ``finish`` the moment its last micro-batch ends; ``finish - busy`` is waiting: for
    ring partners, at barriers, or in pipeline bubbles.  ``exposed_comm_by_mode`` splits
    ``exposed_comm`` by the attention mode of the micro-batches that paid it.
    """

    finish: float = 0.0
    busy: float = 0.0
    compute: float = 0.0
    exposed_comm: float = 0.0
    exposed_offload: float = 0.0
    ring_bytes: float = 0.0
    num_micro_batches: int = 0
    spans: list[tuple[float, float]] = field(default_factory=list)
    exposed_comm_by_mode: dict[str, float] = field(default_factory=dict)

    def add_exposed(self, mode: str, seconds: float) -> None:
        self.exposed_comm += seconds
        if seconds:
            self.exposed_comm_by_mode[mode] = self.exposed_comm_by_mode.get(mode, 0.0) + seconds


CostFn = Callable[[int, MicroBatch], MicroBatchCost]


def _add(tl: RankTimeline, cost: MicroBatchCost, start: float, duration: float) -> None:
    tl.busy += duration
    tl.compute += cost.compute
    tl.add_exposed(cost.mode, cost.exposed_comm)
    tl.exposed_offload += cost.exposed_offload
    tl.ring_bytes += cost.ring_bytes
    tl.num_micro_batches += 1
    tl.spans.append((start, start + duration))
    tl.finish = start + duration


def _rounds(plan: Plan) -> list[list[int]] | None:
    """Per rank, the barrier round of each micro-batch (``plan.options["rounds"]``), if any."""
    rounds = plan.options.get("rounds")
    if rounds is None:
        return None
    if len(rounds) != plan.world_size or any(
        len(r) != len(mbs) for r, mbs in zip(rounds, plan.ranks, strict=True)
    ):
        raise SimulationError(
            "plan.options['rounds'] must list one round index per micro-batch of every rank"
        )
    return [list(r) for r in rounds]


def simulate_ranks(plan: Plan, cost: CostFn) -> list[RankTimeline]:
    """Timelines of a plan without pipeline parallelism.

    Local micro-batches run back to back.  A ring item starts at the latest arrival of its
    members and lasts the longest member duration (members run in lock step).  When the
    plan carries barrier rounds, round ``k`` starts on every rank only after every rank
    finished round ``k - 1``.
    """
    world = plan.world_size
    rounds = _rounds(plan)
    if rounds is None:
        return _simulate_segment(plan, cost, [list(range(len(m))) for m in plan.ranks], [0.0] * world)
    num_rounds = 1 + max((max(r) for r in rounds if r), default=-1)
    timelines = [RankTimeline() for _ in range(world)]
    barrier = 0.0
    for k in range(num_rounds):
        idx = [[i for i, rk in enumerate(rounds[r]) if rk == k] for r in range(world)]
        seg = _simulate_segment(plan, cost, idx, [barrier] * world)
        for tl, part in zip(timelines, seg, strict=True):
            tl.busy += part.busy
            tl.compute += part.compute
            for mode, seconds in part.exposed_comm_by_mode.items():
                tl.add_exposed(mode, seconds)
            tl.exposed_offload += part.exposed_offload
            tl.ring_bytes += part.ring_bytes
            tl.num_micro_batches += part.num_micro_batches
            tl.spans.extend(part.spans)
            if part.num_micro_batches:
                tl.finish = part.finish
        barrier = max([barrier] + [p.finish for p in seg if p.num_micro_batches])
    return timelines


def _simulate_segment(
    plan: Plan, cost: CostFn, order: list[list[int]], start: list[float]
) -> list[RankTimeline]:
    world = plan.world_size
    tls = [RankTimeline(finish=start[r]) for r in range(world)]
    clock = list(start)
    pos = [0] * world
    waiting: dict[int, list[int]] = {}  # ring item -> members that reached it
    stack = list(range(world - 1, -1, -1))
    while stack:
        r = stack.pop()
        mbs = plan.ranks[r]
        while pos[r] < len(order[r]):
            mb = mbs[order[r][pos[r]]]
            if mb.ring is None:
                c = cost(r, mb)
                _add(tls[r], c, clock[r], c.duration)
                clock[r] += c.duration
                pos[r] += 1
                continue
            if mb.item is None:
                raise SimulationError(f"rank {r} has a ring micro-batch without an item id")
            arrived = waiting.setdefault(mb.item, [])
            arrived.append(r)
            if len(arrived) < len(mb.ring):
                break  # wait for the other members
            if sorted(arrived) != sorted(mb.ring):
                raise SimulationError(
                    f"ring item {mb.item} was reached by ranks {sorted(arrived)}, but its ring is "
                    f"{list(mb.ring)}"
                )
            del waiting[mb.item]
            costs = [cost(m, _current(plan, order, pos, m)) for m in mb.ring]
            duration = max(c.duration for c in costs)
            begin = max(clock[m] for m in mb.ring)
            for m, c in zip(mb.ring, costs, strict=True):
                _add(tls[m], c, begin, duration)
                clock[m] = begin + duration
                pos[m] += 1
                if m != r:
                    stack.append(m)
    stuck = [r for r in range(world) if pos[r] < len(order[r])]
    if stuck:
        items = sorted(waiting)[:5]
        raise SimulationError(
            f"ranks {stuck[:8]} never finish: ring items {items} wait for members that run other "
            "items first (members must run shared items in increasing item order)"
        )
    return tls


def _current(plan: Plan, order: list[list[int]], pos: list[int], rank: int) -> MicroBatch:
    return plan.ranks[rank][order[rank][pos[rank]]]


def simulate_pipelines(plan: Plan, cost: CostFn, stages: int) -> list[RankTimeline]:
    """Timelines when every HDP rank is a pipeline of ``stages`` stages running 1F1B.

    Each pipeline runs its own micro-batches (its own count); ``busy`` is one stage's
    share of the work, ``finish`` the pipeline's 1F1B makespan, so ``finish - busy``
    holds both the pipeline bubble and the wait for slower pipelines.  Ring partners are
    not synchronised across pipelines here: each pipeline is timed on its own.  A plan with
    barrier rounds runs in lock step instead: every pipeline has one slot per round, as
    long as that round's longest micro-batch anywhere (an empty slot waits for it too).
    """
    rounds = _rounds(plan)
    costs = [[cost(r, mb) for mb in mbs] for r, mbs in enumerate(plan.ranks)]
    slots = None
    if rounds is not None:
        num_rounds = 1 + max((max(r) for r in rounds if r), default=-1)
        longest = [0.0] * num_rounds
        for r, cs in enumerate(costs):
            for k, c in zip(rounds[r], cs):
                longest[k] = max(longest[k], c.duration)
        slots = longest
    tls = []
    for r, mbs in enumerate(plan.ranks):
        tl = RankTimeline()
        durations = [c.duration for c in costs[r]]
        for c in costs[r]:
            tl.compute += c.compute / stages
            tl.add_exposed(c.mode, c.exposed_comm / stages)
            tl.exposed_offload += c.exposed_offload / stages
            tl.ring_bytes += c.ring_bytes
        tl.num_micro_batches = len(mbs)
        tl.busy = sum(durations) / stages
        tl.finish = one_f_one_b(slots if slots is not None else durations, stages)
        tl.spans = [(0.0, tl.finish)] if mbs else []
        tls.append(tl)
    return tls


def ring_allreduce_seconds(num_bytes: float, ranks: int, bandwidth: float, latency: float = 0.0) -> float:
    """Time of a ring all-reduce: ``2 (N-1)/N * bytes / bandwidth`` plus ``2 (N-1)`` latencies."""
    if ranks <= 1 or num_bytes <= 0:
        return 0.0
    if bandwidth <= 0:
        raise SimulationError(f"all-reduce bandwidth must be > 0, got {bandwidth}")
    return 2.0 * (ranks - 1) / ranks * num_bytes / bandwidth + 2.0 * (ranks - 1) * latency
