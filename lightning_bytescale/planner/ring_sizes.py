"""Ring sizes for ``balance``: how many ranks each long sequence gets, chosen by load.

Memory fixes the fewest ranks a sequence needs (``D(s)``, fewer with offload); the planner may
give it more.  Every long item carries its feasible choices, fewest ranks first
(:attr:`~.items.Item.choices`): Eq. 3's offloaded sizes, ``D(s)``, then grown rings
(:func:`add_growth_choices`).  A *load level* ``T`` picks, for every item, the fewest ranks
whose member time is at most ``T`` (:func:`pick_at`); the data-parallel rule solves
``mean load(T) = T`` and the pipeline rule minimises an estimate of the 1F1B step time.
:func:`ring_size_candidates` returns one such choice per family (offload on/off, growth
on/off) for the planner to place and compare.
"""

from __future__ import annotations

import bisect
import math

from lightning_bytescale.planner.items import Item, PlanContext, likely_intra, member_time
from lightning_bytescale.planner.modes import HYBRID, ULYSSES

GROWTH_STEPS_PER_DOUBLING = 4  # ring sizes tried above D(s): D(s) x 2^(j/4)


def add_growth_choices(ctx: PlanContext, items: list[Item], cm: bool, pipeline_degree: int) -> None:
    """Offer every long item rings larger than ``D(s)`` where they shorten its member time.

    Memory needs ``D(s)`` ranks at least; more ranks cut an attention-bound member's time
    about in proportion (the item's work hardly changes), which pays when the item is longer
    than the step's mean load (data parallel: it would set the step time) or than the other
    micro-batches of its pipeline (1F1B pays a pipeline's longest micro-batch almost fully).
    Sizes grow geometrically (``GROWTH_STEPS_PER_DOUBLING`` a doubling, up to the world) while
    the member time still falls and is above a level below which no plan gains from it: the
    mean load per rank (data parallel) or the longest local micro-batch (pipelines).  Every
    long item is also offered :func:`tile_size` ranks, for the ``tile`` candidate.
    """
    world = ctx.world
    work, longest_local = 0.0, 0.0
    base_t: list[float] = []
    for it in items:
        d = it.choices[it.base][0]
        t = member_time(ctx, it, d, likely_intra(ctx, d), cm)
        base_t.append(t)
        work += d * t
        if d == 1:
            longest_local = max(longest_local, t)
    # data parallel: below the mean load an item no longer sets the step time; pipelines: below
    # the longest local micro-batch a ring no longer sets any pipeline's longest micro-batch
    stop = work / world if pipeline_degree <= 1 else longest_local
    for it, t_prev in zip(items, base_t):
        d0 = it.choices[it.base][0]
        if d0 == 1 or d0 >= world:
            continue
        sizes = []
        j, last = 1, d0
        while last < world and t_prev > stop:
            d = min(world, math.ceil(d0 * 2.0 ** (j / GROWTH_STEPS_PER_DOUBLING)))
            j += 1
            if d <= last:
                continue
            t = member_time(ctx, it, d, likely_intra(ctx, d), cm)
            if t >= t_prev:
                break
            sizes.append(d)
            last, t_prev = d, t
        tile = tile_size(d0)
        if tile <= world and tile not in sizes:
            sizes.append(tile)
        it.choices.extend((d, 0.0) for d in sorted(sizes))


def add_mode_sizes(ctx: PlanContext, items: list[Item]) -> None:
    """Offer every long item the ring sizes its other attention modes need.

    Ulysses needs a group size that divides the query heads, the hybrid layout whole node
    groups of a ``u`` that divides them (the largest ``u`` up to ``ranks_per_node``).  For every
    size an item already has from ``D(s)`` up (its ring sizes), the next size up that each of
    those modes can run is added; the planner's load levels then choose among them all.
    """
    heads, world = ctx.cost.attention_heads, ctx.world
    if heads is None:
        return
    divisors = [d for d in range(2, heads + 1) if heads % d == 0]
    per_node = max((u for u in divisors if ctx.rpn is not None and u <= ctx.rpn), default=None)
    for it in items:
        d0 = it.choices[it.base][0]
        if d0 == 1:
            continue
        have = {d for d, _ in it.choices[it.base :]}
        extra = set()
        for d in have:
            if ULYSSES in ctx.modes:
                extra.add(next((h for h in divisors if h >= d), 0))
            if HYBRID in ctx.modes and per_node is not None:
                extra.add(per_node * max(2, -(-d // per_node)))
        extra = {d for d in extra if d0 < d <= world} - have
        if extra:
            grown = sorted({d for d, _ in it.choices[it.base + 1 :]} | extra)
            it.choices[it.base + 1 :] = [(d, 0.0) for d in grown]


def tile_size(d: int) -> int:
    """The next power of two from ``d``: rings of these sizes tile a power-of-two world without
    leaving odd gaps (Megatron-DCP's sizing), which the ``tile`` candidate tries."""
    return 1 << max(0, (d - 1).bit_length())


def ring_choice_times(
    ctx: PlanContext, items: list[Item], cm: bool
) -> tuple[list[float], list[tuple[int, list[float], list[float]]], float]:
    """Fix single-choice items; list the member times of every choice of the others.

    Returns ``(cost_of, multi, floor)``: ``cost_of[k]`` is the member time of fixed item ``k``;
    ``multi`` holds ``(item index, member time of each choice, -prefix minimum)``; ``floor`` is
    the largest member time no ring size can go below.
    """
    floor = 0.0
    cost_of: list[float] = [0.0] * len(items)
    multi: list[tuple[int, list[float], list[float]]] = []
    for k, it in enumerate(items):
        if len(it.choices) == 1:
            it.choose(0)
            d = it.size
            cost_of[k] = member_time(ctx, it, d, likely_intra(ctx, d), cm)
            floor = max(floor, cost_of[k])
            continue
        ts = [member_time(ctx, it, d, likely_intra(ctx, d), cm) for d, _ in it.choices]
        neg_pm = neg_prefix_min(ts)
        floor = max(floor, -neg_pm[-1])
        multi.append((k, ts, neg_pm))
    return cost_of, multi, floor


def pick_at(multi, level: float, bound: float | None = None) -> list[int]:
    """Per multi-choice item: the fewest ranks whose member time is at most ``level`` (else
    at most ``bound``; with no bound, ``D(s)``)."""
    out = []
    for _, ts, neg_pm in multi:
        j = bisect.bisect_left(neg_pm, -level)  # first j with prefix-min <= level
        if j == len(ts):
            j = len(ts) - 1 if bound is None else bisect.bisect_left(neg_pm, -bound)
        out.append(min(j, len(ts) - 1))
    return out


def apply_picks(items: list[Item], multi, picks: list[int], cost_of: list[float]) -> list[float]:
    for (k, ts, _), j in zip(multi, picks):
        items[k].choose(j)
        cost_of[k] = ts[j]
    return cost_of


def neg_prefix_min(ts: list[float]) -> list[float]:
    out, m = [], math.inf
    for t in ts:
        m = min(m, t)
        out.append(-m)
    return out


def _restrict(multi, items: list[Item], offload: bool, grow: bool):
    """The choice table of one candidate family: without offload the choices below ``D(s)``
    are barred (infinite time), without growth the choices above ``D(s)`` are dropped."""
    if offload and grow:
        return multi
    out = []
    for k, ts, _ in multi:
        b = items[k].base
        t2 = list(ts) if grow else list(ts[: b + 1])
        if not offload:
            t2[:b] = [math.inf] * b
        out.append((k, t2, neg_prefix_min(t2)))
    return out


def _dp_level_picks(multi, items: list[Item], fixed_work: float, world: int, floor: float) -> list[int]:
    """Data parallel ring sizes: the load level ``T`` solving ``mean load(T) = T``.

    Every sequence takes the fewest ranks whose member time is at most ``T``: a larger ``T``
    means fewer ranks and less total work (the mean load ``M(T)`` falls) but coarser items.
    The crossing (bisection) minimises ``max(M(T), T)``, a lower bound on the step time.  A
    sequence that cannot get within ``T`` (a comm-bound ring's member time stops falling with
    more ranks) takes the fewest ranks within ``max(T, largest smallest-member-time)``.
    """

    def mean_load(picks: list[int]) -> float:
        work = fixed_work
        for (k, ts, _), j in zip(multi, picks):
            work += items[k].choices[j][0] * ts[j]
        return work / world

    lo, hi = 0.0, mean_load(pick_at(multi, 0.0))
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if mean_load(pick_at(multi, mid)) > mid:
            lo = mid
        else:
            hi = mid
    return pick_at(multi, hi, max(hi, floor))


PP_LEVELS = 48  # load levels tried by the pipeline ring-size choice, per range
PP_PLACED_LEVELS = 1  # the best levels by the estimate, placed and timed exactly


def _pp_level_picks(multi, items: list[Item], fixed, world: int, p: int, floor: float) -> list[list[int]]:
    """Ring sizes under pipelines: the load levels with the lowest estimated 1F1B step time.

    A pipeline's load is ``sum(t) / p + (p - 1) max(t) / p``: its longest micro-batch counts
    almost fully.  A shrunk ring (offload: longer member time) costs every pipeline it lands on
    a bigger bubble even when the total work ``W`` does not fall (attention-bound rings do the
    same work on any number of ranks); a grown ring (more ranks than ``D(s)``) shortens the
    longest micro-batch of every pipeline it lands on for about the same work.  For a set of
    ring sizes the planner estimates the step time as ``max(M, t_max)`` with the mean pipeline
    load ``M = W / (world p) + (p - 1) / p x mean of the world longest member-time slots``
    (balanced placement gives each pipeline one of the longest slots as its maximum; an item of
    ``D`` ranks fills ``D`` slots) and ``t_max`` the longest member time.  Candidates: ``D(s)``
    for every sequence, and the load levels of :func:`_levels` (every sequence on the fewest
    ranks whose member time is at most the level).  Returns the ``PP_PLACED_LEVELS`` distinct
    choices with the lowest estimates (ties: ``D(s)`` first, then lower levels); the planner
    places them and times them exactly, so the estimate only has to rank.
    """
    fixed_work, fixed_slots = fixed

    def estimate(picks: list[int]) -> float:
        work = fixed_work
        slots = []
        t_max = 0.0
        for (k, ts, _), j in zip(multi, picks):
            d = items[k].choices[j][0]
            work += d * ts[j]
            slots.append((ts[j], d))
            t_max = max(t_max, ts[j])
        slots.sort(reverse=True)
        # sum of the world longest slots: merge the two sorted lists
        need, top, a, b = world, 0.0, 0, 0
        while need > 0 and (a < len(slots) or b < len(fixed_slots)):
            if b >= len(fixed_slots) or (a < len(slots) and slots[a][0] >= fixed_slots[b][0]):
                t, n = slots[a]
                a += 1
            else:
                t, n = fixed_slots[b]
                b += 1
            n = min(n, need)
            top += t * n
            need -= n
        if fixed_slots:
            t_max = max(t_max, fixed_slots[0][0])
        mean = work / (world * p) + (p - 1) * top / (world * p)
        return max(mean, t_max)

    base = [items[k].base for k, _, _ in multi]  # D(s) for every sequence
    scored = [(estimate(base), 0, base)]
    for i, level in enumerate(_levels(multi, floor, base), 1):
        picks = pick_at(multi, level, max(level, floor))
        scored.append((estimate(picks), i, picks))
    scored.sort(key=lambda e: e[:2])
    out: list[list[int]] = []
    for _, _, picks in scored:
        if picks not in out:
            out.append(picks)
            if len(out) == PP_PLACED_LEVELS:
                break
    return out


def _levels(multi, floor: float, base: list[int]) -> list[float]:
    """Load levels to try: ``PP_LEVELS`` geometric steps from the floor up to the longest
    ``D(s)`` member time (grown rings), and as many from there up to the longest finite member
    time of any choice (offloaded, smaller rings)."""
    lo = max(floor, 1e-12)
    mid = max(lo, max(ts[j] for (_, ts, _), j in zip(multi, base)))
    hi = max(mid, max(max(t for t in ts if t < math.inf) for _, ts, _ in multi))
    out: list[float] = []
    for a, b in ((lo, mid), (mid, hi)):
        if b > a:
            ratio = (b / a) ** (1.0 / PP_LEVELS)
            out.extend(a * ratio**i for i in range(PP_LEVELS + 1))
    return out or [lo]


def ring_size_candidates(
    ctx: PlanContext, items: list[Item], cm: bool, pipeline_degree: int, grow: bool
) -> tuple[list[list[float]], list[list[int]]]:
    """Member times of every choice, and the candidate ring sizes (a choice index per item).

    Families of choices: offload with grown rings (when offload is on), no offload with grown
    rings (when ``grow``), and ``D(s)`` for every sequence (the paper's plan, always); each
    family's ring sizes come from the data-parallel crossing (:func:`_dp_level_picks`) or the
    pipeline estimate (:func:`_pp_level_picks`).  With ``grow``, one more: every ring on
    :func:`tile_size` ranks (Megatron-DCP's power-of-two sizes, which tile the ranks when the
    last rings of a step would otherwise leave odd gaps).  The planner places every distinct
    candidate and keeps the one whose placement ends first: a family that cannot help (offload
    on attention-bound rings, growth on communication-bound ones) never costs anything.
    """
    cost_of, multi, _ = ring_choice_times(ctx, items, cm)
    times = [[t] for t in cost_of]
    for k, ts, _ in multi:
        times[k] = ts
    if not multi:
        return times, [[0] * len(items)]
    multi_ks = {k for k, _, _ in multi}
    fixed = [k for k in range(len(items)) if k not in multi_ks]
    fixed_floor = max((cost_of[k] for k in fixed), default=0.0)
    fixed_work = sum(items[k].size * cost_of[k] for k in fixed)
    fixed_slots = sorted(((cost_of[k], items[k].size) for k in fixed), reverse=True)
    # offload with grown rings (when both are on), without offload with grown rings, and the
    # paper's D(s) rings without offload: the safe fallback every plan can take
    families = [(True, grow)] if ctx.offload is not None else []
    families += [(False, True)] if grow else []
    families.append((False, False))
    out: list[list[int]] = []
    for off, g in families:
        view = _restrict(multi, items, off, g)
        floor = max([fixed_floor] + [-neg[-1] for _, _, neg in view])
        if pipeline_degree <= 1:
            found = [_dp_level_picks(view, items, fixed_work, ctx.world, floor)]
        else:
            found = _pp_level_picks(view, items, (fixed_work, fixed_slots), ctx.world, pipeline_degree, floor)
        for picks in found:
            choice = [0] * len(items)
            for (k, _, _), j in zip(view, picks):
                choice[k] = j
            if choice not in out:
                out.append(choice)
    if grow:  # tile: every ring on the next power of two of D(s) ranks
        choice = [0] * len(items)
        for k in multi_ks:
            it = items[k]
            tile = tile_size(it.choices[it.base][0])
            choice[k] = next((j for j, c in enumerate(it.choices) if c == (tile, 0.0)), it.base)
        if choice not in out:
            out.append(choice)
    return times, out
