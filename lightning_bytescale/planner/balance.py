"""``balance``: paper Alg. 2 (DP-Balance, PP-Balance) on the communication-aware cost model.

The decisions the paper leaves open are in :mod:`.planners`' docstring.  The planner builds
the items (:mod:`.items`), offers rings larger than ``D(s)`` (:mod:`.ring_sizes`), and for
every candidate set of ring sizes runs the placement (:func:`_dp_balance` or
:func:`_pp_balance`); the candidate whose placement ends first under the cost model wins.

Attention modes (:mod:`.modes`): the plan above is the ring-only plan.  When the cost model
knows the heads and models communication, ``modes`` allows more than the ring and some
sequence needs a group, the planner plans once more with every item's time the least over its
allowed modes (each item then runs in that mode), and keeps that plan only when it ends
strictly earlier by the cost model: the planner with modes is never slower than ring-only by
its own estimate, and where nothing gains the plan is the ring-only one, bit for bit.
"""

from __future__ import annotations

import bisect
import heapq

from lightning_bytescale.planner.errors import PlanError
from lightning_bytescale.planner.items import (
    Item,
    PlanContext,
    emit,
    make_items,
    member_time,
    resolve_offload,
    ring_time,
)
from lightning_bytescale.planner.modes import HYBRID, RING_ONLY, check_modes
from lightning_bytescale.planner.pipeline import one_f_one_b
from lightning_bytescale.planner.plan import Plan
from lightning_bytescale.planner.refine import refine_local_shares
from lightning_bytescale.planner.ring_sizes import add_growth_choices, add_mode_sizes, ring_size_candidates


def plan_balance(
    lengths,
    *,
    world_size,
    capacity,
    cost_model,
    seed=0,
    offload=None,
    slack=0.05,
    num_buckets=8,
    pipeline_degree=1,
    max_micro_batches=None,
    ranks_per_node=None,
    comm_aware=True,
    pp_reading="sequential",
    grow_rings=True,
    refine=True,
    modes=None,
    **_,
) -> Plan:
    if pp_reading not in ("round_robin", "sequential"):
        raise PlanError(f"pp_reading must be 'round_robin' or 'sequential', got {pp_reading!r}")
    allowed = check_modes(modes, cost_model)
    off = resolve_offload(offload, cost_model, pipeline_degree, default_on=True)
    ctx = PlanContext(lengths, world_size, capacity, cost_model, ranks_per_node, off)
    options = {
        "seed": seed,
        "slack": slack,
        "num_buckets": num_buckets,
        "pipeline_degree": pipeline_degree,
        "comm_aware": bool(comm_aware),
        "pp_reading": pp_reading,
        "grow_rings": bool(grow_rings),
        "refine": bool(refine),
    }
    args = (slack, num_buckets, pipeline_degree, comm_aware, pp_reading == "round_robin", grow_rings, refine)
    ring_plan = _balance(ctx, options, *args, max_micro_batches=max_micro_batches)
    if (
        allowed == RING_ONLY
        or cost_model.attention_heads is None
        or not cost_model.models_comm
        or all(s <= capacity for s in lengths)
    ):
        return ring_plan
    ctx_modes = PlanContext(lengths, world_size, capacity, cost_model, ranks_per_node, off, allowed)
    mode_plan = _balance(ctx_modes, options, *args, max_micro_batches=max_micro_batches)
    return mode_plan if _plan_end(mode_plan) < _plan_end(ring_plan) else ring_plan


def _plan_end(plan: Plan) -> float:
    """When the plan's step ends by its estimates: the last rank's finish (ring members wait
    for each other), or with pipelines the slowest pipeline's exact 1F1B schedule."""
    p = int(plan.options.get("pipeline_degree", 1) or 1)
    if p <= 1:
        return max(plan.finish_times(), default=0.0)
    fwd = float(plan.options["cost_model"].get("forward_fraction", 1.0 / 3.0))
    return max((one_f_one_b([mb.est_time for mb in mbs], p, fwd) for mbs in plan.ranks if mbs), default=0.0)


def _balance(
    ctx: PlanContext,
    options: dict,
    slack: float,
    num_buckets: int,
    pipeline_degree: int,
    comm_aware: bool,
    round_robin: bool,
    grow_rings: bool,
    refine: bool,
    max_micro_batches: int | None = None,
) -> Plan:
    """Alg. 2 on ``ctx``: place every candidate ring sizing, keep the one that ends first, emit it."""
    # DP-Balance places short sequences one by one (LPT balances finely) and packs each rank's
    # share afterwards; PP-Balance keeps C-token bins (its 1F1B load model prices whole micro-batches)
    dp = pipeline_degree <= 1
    items = make_items(ctx, pack_short=not dp)
    cm = comm_aware and ctx.cost.models_comm
    if grow_rings:
        add_growth_choices(ctx, items, cm, pipeline_degree)
        if ctx.modes != RING_ONLY:
            add_mode_sizes(ctx, items)

    times, candidates = ring_size_candidates(ctx, items, cm, pipeline_degree, grow_rings)
    best = None
    for choice in candidates:
        for it, j in zip(items, choice):
            it.choose(j)
        cost_of = [ts[j] for ts, j in zip(times, choice)]
        order = sorted(range(len(items)), key=lambda k: (-cost_of[k], -items[k].size, items[k].seqs[0]))
        buckets = _buckets([(items[k], cost_of[k]) for k in order], num_buckets)
        if dp:
            assignment, end = _dp_balance(ctx, [x for b in buckets for x in b], slack, cm)
        else:
            assignment, end = _pp_balance(
                ctx, buckets, slack, cm, pipeline_degree, round_robin, max_micro_batches
            )
        if best is None or end < best[0]:
            best = (end, choice, assignment)
    _, choice, assignment = best
    for it, j in zip(items, choice):
        it.choose(j)
    if dp and refine and all(len(members) == 1 and it.ratio == 0.0 for it, members, _ in assignment):
        assignment = _refined(ctx, assignment)
    return emit(ctx, assignment, "balance", dict(options), repack_local=dp)


def _refined(ctx: PlanContext, assignment: list[tuple[Item, tuple[int, ...], tuple]]):
    """An all-local DP placement after :func:`~.refine.refine_local_shares` (one entry per sequence)."""
    shares: list[list[int]] = [[] for _ in range(ctx.world)]
    for it, (r,), _ in assignment:
        shares[r].extend(it.seqs)
    shares = refine_local_shares(ctx.lengths, ctx.cap, ctx.cost, shares)
    out = []
    for r, share in enumerate(shares):
        for q in share:
            out.append((Item([q], [(1, 0.0)], 0, 1, 0.0, 0), (r,), (len(out), 0)))
    return out


def _buckets(seq: list[tuple[Item, float]], num_buckets: int) -> list[list[tuple[Item, float]]]:
    """Cut the sorted items into ``num_buckets`` runs of about equal work (ranks x member time)."""
    total = sum(it.size * t for it, t in seq)
    per = total / num_buckets if num_buckets > 0 else total
    out: list[list[tuple[Item, float]]] = [[]]
    acc = 0.0
    for it, t in seq:
        if out[-1] and acc >= per * len(out) and len(out) < num_buckets:
            out.append([])
        out[-1].append((it, t))
        acc += it.size * t
    return [b for b in out if b]


def _pick_members(
    ctx: PlanContext, heap: list[tuple[float, int]], it: Item, slack: float, cm: bool
) -> tuple[list[tuple[float, int]], list[tuple[float, int]], float]:
    """Pop the members of a ring (or the one rank of a local item) off the load heap.

    Returns ``(chosen, to push back, member time)``.  Candidates are the ``d`` least-loaded
    ranks plus those within ``delta = max(slack * t, t_inter - t_intra)`` of the ``d``-th (at most
    ``d + 2 * ranks_per_node``; beyond that no candidate can finish earlier).  Options: the ``d``
    least loaded, or the ``d`` least loaded of one node; the one that ends first wins (then the
    one that wastes least waiting, then the lower node).  With the hybrid mode allowed, a group
    may also take ``u`` ranks on each of ``d / u`` nodes (:func:`_hybrid_degrees`), the nodes
    whose ``u``-th least-loaded rank is ready first; candidates then reach as far as what that
    layout saves over the ``d`` least loaded (at most ``2 d + 2 * ranks_per_node``).
    """
    d = it.size
    got = [heapq.heappop(heap) for _ in range(d)]
    if d == 1:
        return got, [], member_time(ctx, it, 1, False, cm)
    ring = tuple(r for _, r in got)
    t_got = ring_time(ctx, it, tuple(sorted(ring)), cm)
    node_degrees = _hybrid_degrees(ctx, d)
    if ctx.rpn is None or (d > ctx.rpn and not node_degrees):
        return got, [], t_got
    if d <= ctx.rpn:
        t_intra = member_time(ctx, it, d, True, cm)
        t_inter = member_time(ctx, it, d, False, cm)
        limit = got[-1][0] + max(slack * t_inter, t_inter - t_intra)
        cap = d + 2 * ctx.rpn
    else:
        t_nodes = member_time(ctx, it, d, False, cm)  # whole node groups (the likely layout)
        if t_got <= t_nodes:  # the d least loaded run as fast as whole node groups would
            return got, [], t_got
        limit = got[-1][0] + max(slack * t_got, t_got - t_nodes)
        cap = 2 * d + 2 * ctx.rpn
    while heap and len(got) < cap and heap[0][0] <= limit:
        got.append(heapq.heappop(heap))
    first = got[:d]
    best_end = max(x for x, _ in first) + t_got
    best = (best_end, sum(best_end - t_got - x for x, _ in first), -1)
    best_set, best_t = first, t_got
    by_node: dict[int, list[tuple[float, int]]] = {}
    for e in got:  # got is in (load, rank) order
        by_node.setdefault(ctx.node(e[1]), []).append(e)
    if d <= ctx.rpn:
        for nd in sorted(by_node):
            cand = by_node[nd][:d]
            if len(cand) < d:
                continue
            start = cand[-1][0]
            key = (start + t_intra, sum(start - x for x, _ in cand), nd)
            if key < best:
                best, best_set, best_t = key, cand, t_intra
    for u in node_degrees:
        ready = sorted((es[u - 1][0], nd) for nd, es in by_node.items() if len(es) >= u)
        if len(ready) < d // u:
            continue
        cand = sorted(e for _, nd in ready[: d // u] for e in by_node[nd][:u])
        start = max(x for x, _ in cand)
        t_h = ring_time(ctx, it, tuple(sorted(r for _, r in cand)), cm)
        key = (start + t_h, sum(start - x for x, _ in cand), -1 - u)
        if key < best:
            best, best_set, best_t = key, cand, t_h
    chosen_ranks = {r for _, r in best_set}
    return best_set, [e for e in got if e[1] not in chosen_ranks], best_t


def _hybrid_degrees(ctx: PlanContext, d: int) -> list[int]:
    """Members per node a group of ``d`` may take to run hybrid: ``u`` from 2 to ``ranks_per_node``
    dividing ``d`` (two nodes or more) and the query heads; none without the hybrid mode."""
    heads = ctx.cost.attention_heads
    if HYBRID not in ctx.modes or heads is None or ctx.rpn is None:
        return []
    return [u for u in range(2, min(ctx.rpn, d // 2) + 1) if d % u == 0 and heads % u == 0]


def _dp_balance(ctx: PlanContext, seq: list[tuple[Item, float]], slack: float, cm: bool):
    """LPT over ranks with ring members starting together; local items back-fill ring waits.

    A ring's members start when the latest is ready; the earlier ones wait.  Each wait is kept as
    a gap (before that ring item in the rank's order); a later local item that fits a gap
    (best fit) runs there for free instead of at the end of the least-loaded rank.
    """
    heap = [(0.0, r) for r in range(ctx.world)]
    gaps: list[tuple[float, int, int]] = []  # (length, rank, gap id), sorted
    gap_at: list[tuple[int, int]] = []  # gap id -> (assignment index of the ring after it, fills)
    assignment = []
    for it, t in seq:  # t: the item's member time (exact for local items)
        d = it.size
        k = len(assignment)
        if d == 1:
            pos = bisect.bisect_left(gaps, (t, -1, -1))
            if pos < len(gaps):
                length, r, gid = gaps.pop(pos)
                ring_k, fills = gap_at[gid]
                gap_at[gid] = (ring_k, fills + 1)
                assignment.append((it, (r,), (ring_k, -1, fills)))
                if length - t > 0:
                    bisect.insort(gaps, (length - t, r, gid))
                continue
            load, r = heap[0]
            heapq.heapreplace(heap, (load + t, r))
            assignment.append((it, (r,), (k, 0)))
            continue
        chosen, back, t = _pick_members(ctx, heap, it, slack, cm)
        members = tuple(sorted(r for _, r in chosen))
        start = max(load for load, _ in chosen)
        end = start + t
        for load, r in chosen:
            if start - load > 0:
                gap_at.append((k, 0))
                bisect.insort(gaps, (start - load, r, len(gap_at) - 1))
            heapq.heappush(heap, (end, r))
        for e in back:
            heapq.heappush(heap, e)
        assignment.append((it, members, (k, 0)))
    return assignment, max(load for load, _ in heap)


def _pp_balance(
    ctx: PlanContext, buckets, slack: float, cm: bool, p: int, round_robin: bool, limit: int | None = None
):
    """PP-Balance: the least-loaded pipeline draws next, from its own bucket (``round_robin``)
    or from the first non-empty bucket (``sequential``, the other reading of §4.5 item 5).

    A pipeline that holds ``limit`` micro-batches (``max_micro_batches``) draws no more; a ring
    item that finds fewer open pipelines than its size is a :class:`PlanError`."""
    nb = len(buckets)
    queues = [list(reversed(b)) for b in buckets]  # pop() from the end = next item of the bucket
    remaining = sum(len(b) for b in buckets)
    cur = [r % nb for r in range(ctx.world)] if nb else [0] * ctx.world
    tsum = [0.0] * ctx.world
    tmax = [0.0] * ctx.world
    durations: list[list[float]] = [[] for _ in range(ctx.world)]
    heap = [(0.0, r) for r in range(ctx.world)]
    full: list[tuple[float, int]] = []  # pipelines at the limit, out of the heap
    assignment = []
    while remaining:
        if not heap:
            raise _over_limit(limit, remaining, 1)
        load, r0 = heap[0]
        b = cur[r0] if round_robin else 0
        for step in range(nb):
            if queues[(b + step) % nb]:
                b = (b + step) % nb
                break
        it, _ = queues[b].pop()
        remaining -= 1
        if it.size > len(heap):
            raise _over_limit(limit, remaining + 1, it.size)
        chosen, back, t = _pick_members(ctx, heap, it, slack, cm)
        members = tuple(sorted(r for _, r in chosen))
        for e in back:
            heapq.heappush(heap, e)
        for _, r in chosen:
            tsum[r] += t
            tmax[r] = max(tmax[r], t)
            durations[r].append(t)
            cur[r] = b
            new = tsum[r] / p + (p - 1) * tmax[r] / p
            if limit is not None and len(durations[r]) >= limit:
                full.append((new, r))
            else:
                heapq.heappush(heap, (new, r))
        assignment.append((it, members, (len(assignment), 0)))
    return assignment, _pipelines_end(durations, heap + full, p, ctx.cost.forward_fraction)


def _over_limit(limit: int | None, remaining: int, size: int) -> PlanError:
    return PlanError(
        f"every pipeline already holds max_micro_batches={limit} micro-batches but {remaining} item(s) of the "
        f"global batch are left (the next needs {size} pipeline(s)): the batch does not fit the pipelines' "
        'receive-buffer limit. Raise max_micro_batches (docs/pipelines.md, "Receive buffers and reused stages") or the capacity, '
        "or lower the tokens per step"
    )


PP_EXACT_PIPELINES = 32  # pipelines timed by the exact 1F1B schedule when candidates are compared


def _pipelines_end(durations: list[list[float]], heap: list[tuple[float, int]], p: int, fwd: float) -> float:
    """When the slowest pipeline ends: the exact 1F1B makespan of the ``PP_EXACT_PIPELINES``
    pipelines with the largest load estimate (``sum/p + (p - 1) max/p`` ranks them)."""
    top = heapq.nlargest(PP_EXACT_PIPELINES, heap)
    return max(one_f_one_b(durations[r], p, fwd) for _, r in top)
