"""The planners (``static``, ``naive``, ``balance``) behind one interface, :func:`make_plan`.

* ``static`` -- today's baseline: fixed CP groups of ``cp_size`` consecutive ranks
  (``world_size`` must divide by it); sequences packed best-fit-decreasing to the context length
  (every member's zigzag slots of the pack within ``C``); every pack sharded over its whole group;
  packs dealt round-robin over the DP groups in seeded random order (counts differ by at most one).
* ``naive`` -- paper Alg. 1: data-aware sharding (``D(s)`` ranks per long sequence, Eq. 3 with
  the largest hidden offload ratio when offload is on; short sequences best-fit packed on one
  rank), items in seeded random (data) order, each to the ranks with the *fewest* micro-batches:
  equal micro-batch counts, blind to time.
* ``balance`` -- paper Alg. 2 (DP-Balance; PP-Balance when ``pipeline_degree > 1``) on the
  communication-aware cost model.

Decisions where the paper is silent (bytescale-paper §4.5):

1. *First iteration / targets.*  Loads start at 0, so "no rank behind" means every rank is a
   target.  The targets of an item of ``D`` ranks are the ``D`` least-loaded ranks plus those
   within ``delta = max(slack * t, t_inter - t_intra)`` of them (``t``: the item's member time):
   any of them may take it, which gives room to place a ring inside one node.
2. *Long sequences.*  A ring of ``D`` goes to the ``D`` least-loaded targets, or to the ``D``
   least-loaded targets of one node (``ranks_per_node``) when that ends earlier (intra-node
   links are faster, so comm-bound rings gain most); ties go to the option that wastes less
   waiting.  Members start together (at the latest member's load).  All members get the item in
   the same slot of the global order: ring items are numbered in assignment order.
3. *Short sequences.*  DP-Balance places them one by one, longest first: each goes into the
   smallest *wait gap* it fits (time a ring member spends waiting for the others, recorded per
   rank before that ring item), else to the least-loaded rank; afterwards each rank's run of
   local sequences between two of its ring items is packed best-fit-decreasing into
   micro-batches of ``C`` tokens.  Placing single sequences balances far more finely than placing
   pre-packed bins (all-short data at 4 ranks: planned max/mean about 1.04 instead of 1.2).
   PP-Balance places best-fit-decreasing bins of ``C`` tokens, since its 1F1B load model prices
   whole micro-batches.  Gap filling is ours: the paper leaves ring waits implicit; without it
   ring-heavy batches lose several percent.
4. *Buckets and slack.*  Items sorted by per-member time, longest first, are cut into
   ``num_buckets`` (default 8) buckets of about equal total work (work = ranks x member time);
   ``slack`` defaults to 0.05 (Megatron's 5%).  DP-Balance always draws from the first non-empty
   bucket, i.e. longest-processing-time-first over ranks.
5. *PP-Balance.*  Both readings of "sequentially from all buckets" are implemented
   (``pp_reading``); the least-loaded pipeline draws next, and a pipeline's load is the 1F1B
   time ``sum(t)/p + (p-1) * max(t)/p``.  ``"sequential"`` (default): draw from the first
   non-empty bucket (longest level first).  ``"round_robin"``: pipeline ``i`` starts on bucket
   ``i mod num_buckets`` and keeps its length level until it runs out (Insight 1).  Measured on
   the simulator's 1F1B timelines (LLaMA-70B shape, PP = 4, 32 pipelines, 4M tokens, 256K
   context): github 8.08 s sequential vs 8.31 s round-robin (naive 10.14 s); byted 11.63 s for
   both (naive 16.53 s), so sequential is the default.
6. *Gradient accumulation.*  Every rank runs its own list; one gradient all-reduce per step.

Issue-9 additions (communication-aware planning):

* ``comm_aware=True`` (default) balances on ``linear + max(attention, transfer)``;
  ``comm_aware=False`` balances on the paper's compute-only model (ablation).  Either way the
  micro-batches' ``est_time``/``exposed_time`` come from the full model, so plans compare fairly.
* Ring size: never more ranks than memory requires (``D(s)``).  With offload, every size from
  Eq. 3's optimum up to ``D(s)`` is feasible; ``balance`` takes the fewest ranks whose member time
  stays within a load level ``T`` solving ``mean load(T) = T`` (fewer ranks mean bigger chunks,
  more hidden transfer and less total work, but an item longer than the mean load would set the
  step time).  A sequence whose member time cannot get under ``T`` (a comm-bound ring stops
  getting faster with more ranks) takes the fewest ranks within the step-time bound
  ``max(T, largest floor)``.  Under pipelines (``pipeline_degree > 1``) the ring sizes are the
  candidate (no shrinking, or one of ``PP_LEVELS`` load levels) with the lowest estimated step
  time in the 1F1B load model, and a shrinking must gain ``PP_MIN_GAIN``: a pipeline pays
  about ``(p - 1) / p`` of its longest micro-batch once more, so a shrunk ring pays only where
  it saves real work (see :func:`_choose_ring_sizes_pp`).  ``naive`` takes Eq. 3's optimum
  (``offload_policy="paper_min_ranks"``, default) or shrinks only where that saves work at
  about the same member time (``offload_policy="pays"``, see :func:`_naive_pays`).
* Placement: rings inside one node when that ends earlier (item 2 above); the exposed ring time
  of every micro-batch is in ``exposed_time`` and summed in ``Plan.stats()``.
* Offload default (``offload=None``): on for ``balance`` when the cost model has activation
  coefficients, off for ``naive`` and ``static``; ``True``/``False``/an :class:`OffloadConfig`
  force it.

Determinism: only lists, sorted keys and ``random.Random(seed)`` decide; no set or dict order,
no hashing of strings, so every process builds the same plan.
"""

from __future__ import annotations

import bisect
import gc
import heapq
import importlib
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_bytescale.planner.cost_model import (
    CostModel,
    OffloadConfig,
    max_offload_ratio,
    member_slots,
    offload_options,
)
from lightning_bytescale.planner.errors import PlanError
from lightning_bytescale.planner.packing import best_fit_decreasing
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan
from lightning_bytescale.planner.zigzag import all_member_ranges

PlannerFn = Callable[..., Plan]

_REGISTRY: dict[str, PlannerFn | str] = {
    "megatron_dcp": "lightning_bytescale.planner.peers:plan_megatron_dcp",
    "verl_kk": "lightning_bytescale.planner.peers:plan_verl_kk",
}


def register_planner(name: str, fn: PlannerFn | None = None):
    """Register ``fn(lengths, *, world_size, capacity, **options) -> Plan`` under ``name``.

    Usable as a decorator (``@register_planner("mine")``).  The function receives every
    :func:`make_plan` option by keyword and should accept ``**kwargs`` for those it ignores.
    """

    def deco(f: PlannerFn) -> PlannerFn:
        _REGISTRY[name] = f
        return f

    return deco if fn is None else deco(fn)


def available_planners() -> list[str]:
    return sorted(_REGISTRY)


def get_planner(name: str) -> PlannerFn:
    fn = _REGISTRY.get(name)
    if fn is None:
        raise PlanError(f"unknown planner {name!r}; choose from {available_planners()}")
    if isinstance(fn, str):
        mod, attr = fn.split(":")
        fn = getattr(importlib.import_module(mod), attr)
        _REGISTRY[name] = fn
    return fn


# ====================================================================== common checks


def _check_int(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) and not (hasattr(v, "__index__")):
        raise PlanError(f"{name} must be an integer, got {v!r}")
    v = int(v)
    if v < lo:
        raise PlanError(f"{name} must be >= {lo}, got {v}")
    return v


def check_lengths(lengths: Sequence[int]) -> list[int]:
    """Lengths as Python ints; a :class:`PlanError` names the first bad index."""
    out: list[int] = []
    for i, s in enumerate(lengths):
        try:
            v = int(s)
        except (TypeError, ValueError) as err:
            raise PlanError(f"sequence {i} has non-integer length {s!r}") from err
        if v != s:
            raise PlanError(f"sequence {i} has non-integer length {s!r}")
        if v < 1:
            raise PlanError(
                f"sequence {i} has length {v}; every sequence needs at least one token "
                "(drop empty samples before planning)"
            )
        out.append(v)
    return out


def resolve_offload(
    offload, cost: CostModel, pipeline_degree: int, *, default_on: bool
) -> OffloadConfig | None:
    """``None`` -> planner default; ``True``/``False``; an :class:`OffloadConfig` or its dict."""
    if offload is None:
        offload = default_on and cost.c > 0
    if offload is False:
        return None
    if offload is True:
        return OffloadConfig(layers_per_rank=max(1, cost.num_layers // pipeline_degree))
    if isinstance(offload, OffloadConfig):
        return offload
    if isinstance(offload, dict):
        return OffloadConfig.from_json_dict(offload)
    raise PlanError(f"offload must be None, True, False, an OffloadConfig or its dict, got {offload!r}")


@dataclass
class _Ctx:
    lengths: list[int]
    world: int
    cap: int
    cost: CostModel
    rpn: int | None
    offload: OffloadConfig | None

    def node(self, r: int) -> int:
        return 0 if self.rpn is None else r // self.rpn

    def intra(self, ring: Sequence[int]) -> bool:
        if self.rpn is None:
            return False
        n0 = ring[0] // self.rpn
        return all(x // self.rpn == n0 for x in ring)

    def pool_limit(self, i: int) -> str:
        """The pool's size for sequence ``i``, offload-aware: what the error message quotes."""
        plain = self.world * self.cap
        if self.offload is None or self.offload.layers_per_rank <= 2:
            return f"the pool holds {plain} tokens"
        d_off, ratio = offload_options(self.lengths[i], self.cap, self.cost, self.offload)[0]
        if ratio == 0.0:  # Eq. 3's fallback: no hidden ratio saves a rank for this sequence
            r_star = max_offload_ratio(self.lengths[i], self.cost, self.offload)
            return (
                f"the pool holds {plain} tokens; offload cannot shrink this sequence: its hidden "
                f"ratio r* = {r_star:.3f} is below Eq. 3's lower bound"
            )
        r_star = max_offload_ratio(self.lengths[i], self.cost, self.offload)
        frac = self.offload.resident_fraction(r_star)
        return (
            f"with offload at this sequence's largest hidden ratio r* = {r_star:.3f} a rank holds "
            f"{self.cap / frac:.0f} of its tokens, so the pool holds about {plain / frac:.0f} tokens "
            f"of it; {plain} without offload"
        )

    def too_long(self, i: int, need: int, what: str) -> PlanError:
        s = self.lengths[i]
        fixes = "add ranks, raise capacity, " + ("" if self.offload else "enable offload, ")
        return PlanError(
            f"sequence {i} has length {s} and needs {need} ranks of capacity {self.cap} ({what}), but "
            f"world_size is {self.world} ({self.pool_limit(i)}); {fixes}"
            "or split/truncate documents to the context length"
        )


def _local_mb(ctx: _Ctx, seqs: Sequence[int], ratio: float = 0.0) -> MicroBatch:
    lens = ctx.lengths
    return MicroBatch(
        pieces=[Piece(q, ((0, lens[q]),)) for q in seqs],
        offload_ratio=ratio,
        est_time=ctx.cost.local_time([lens[q] for q in seqs]),
    )


def _ring_mbs(
    ctx: _Ctx, seqs: Sequence[int], ring: tuple[int, ...], item: int, ratio: float
) -> list[MicroBatch]:
    lens = ctx.lengths
    n = len(ring)
    sl = [lens[q] for q in seqs]
    t, exposed = ctx.cost.ring_member_time(sl, n, intra=ctx.intra(ring), comm_aware=True)
    per_member: list[list[Piece]] = [[] for _ in range(n)]
    for q in seqs:
        for m, ranges in enumerate(all_member_ranges(lens[q], n)):
            per_member[m].append(Piece(q, ranges))
    out = []
    for pieces in per_member:
        out.append(
            MicroBatch(
                pieces=pieces, ring=ring, item=item, offload_ratio=ratio, est_time=t, exposed_time=exposed
            )
        )
    return out


def _options(ctx: _Ctx, **kw) -> dict:
    out = {
        "cost_model": ctx.cost.to_json_dict(),
        "offload": None if ctx.offload is None else ctx.offload.to_json_dict(),
        "ranks_per_node": ctx.rpn,
    }
    out.update(kw)
    return out


# ====================================================================== static


def static_cp_size(lengths: Sequence[int], world_size: int, capacity: int) -> int:
    """Smallest divisor of ``world_size`` on which every sequence's zigzag share fits ``capacity``."""
    longest = max(lengths, default=1)
    for d in range(1, world_size + 1):
        if world_size % d == 0 and member_slots(longest, d) <= capacity:
            return d
    i = max(range(len(lengths)), key=lambda j: (lengths[j], -j))
    raise PlanError(
        f"sequence {i} has length {longest}, which no CP group of the {world_size} ranks holds at capacity "
        f"{capacity}; add ranks, raise capacity, or split/truncate documents to the context length"
    )


def plan_static(
    lengths,
    *,
    world_size,
    capacity,
    cost_model,
    cp_size=None,
    seed=0,
    ranks_per_node=None,
    pipeline_degree=1,
    **_,
) -> Plan:
    ctx = _Ctx(lengths, world_size, capacity, cost_model, ranks_per_node, None)
    if cp_size is None:
        cp = static_cp_size(lengths, world_size, capacity)
    else:
        cp = _check_int("cp_size", cp_size, 1)
        if world_size % cp:
            raise PlanError(
                f"cp_size {cp} does not divide world_size {world_size}; static CP groups need "
                f"world_size = dp x cp (divisors: {[d for d in range(1, world_size + 1) if world_size % d == 0]})"
            )
        for i, s in enumerate(lengths):
            if member_slots(s, cp) > capacity:
                need = static_cp_size([s], world_size, capacity) if s <= world_size * capacity else None
                fix = f"use cp_size >= {need}" if need else "add ranks or raise capacity"
                raise PlanError(
                    f"sequence {i} has length {s}, more than a CP group of {cp} ranks holds at capacity "
                    f"{capacity} (context length {cp * capacity}); {fix}, or split/truncate documents"
                )
    dp = world_size // cp
    sizes = [member_slots(s, cp) for s in lengths]
    bins = best_fit_decreasing(sizes, capacity)
    random.Random(seed).shuffle(bins)
    ranks: list[list[MicroBatch]] = [[] for _ in range(world_size)]
    item = 0
    for k, b in enumerate(bins):
        g = k % dp
        seqs = sorted(b)
        if cp == 1:
            ranks[g].append(_local_mb(ctx, seqs))
            continue
        ring = tuple(range(g * cp, (g + 1) * cp))
        for r, mb in zip(ring, _ring_mbs(ctx, seqs, ring, item, 0.0)):
            ranks[r].append(mb)
        item += 1
    return Plan(
        world_size,
        capacity,
        "static",
        tuple(lengths),
        ranks,
        _options(ctx, cp_size=cp, dp_size=dp, seed=seed, pipeline_degree=pipeline_degree),
    )


# ====================================================================== items shared by naive and balance


@dataclass
class _Item:
    seqs: list[int]
    choices: list[tuple[int, float]]  # feasible (ring size, offload ratio), fewest ranks first
    pick: int = -1  # index into choices
    size: int = 0  # ring size of the pick
    ratio: float = 0.0  # offload ratio of the pick

    def choose(self, j: int) -> None:
        self.pick = j
        self.size, self.ratio = self.choices[j]


def _items(ctx: _Ctx, pack_short: bool = True) -> list[_Item]:
    """Long sequences (each its own item, with its ring-size choices) and short ones.

    Short sequences come as best-fit-decreasing bins of ``C`` tokens (``pack_short``), or one
    item each, for a planner that places them one by one and packs each rank's share afterwards
    (:func:`_emit` with ``repack_local``).
    """
    short: list[int] = []
    out: list[_Item] = []
    for i, s in enumerate(ctx.lengths):
        if s <= ctx.cap:
            short.append(i)
            continue
        choices = [c for c in offload_options(s, ctx.cap, ctx.cost, ctx.offload) if c[0] <= ctx.world]
        if not choices:
            d_off = offload_options(s, ctx.cap, ctx.cost, ctx.offload)[0][0]
            raise ctx.too_long(i, d_off, "with offload" if ctx.offload else "without offload")
        out.append(_Item([i], choices))
    bins = best_fit_decreasing(ctx.lengths, ctx.cap, short) if pack_short else [[i] for i in short]
    for b in bins:
        out.append(_Item(sorted(b), [(1, 0.0)], 0, 1, 0.0))
    return out


def _emit(
    ctx: _Ctx,
    assignment: list[tuple[_Item, tuple[int, ...], tuple]],
    name: str,
    options: dict,
    repack_local: bool = False,
) -> Plan:
    """Build the plan; ``assignment`` entries are ``(item, members, order key)`` in global order.

    Ring items are numbered in assignment order; each rank runs its micro-batches sorted by
    order key (ring items keep assignment order; gap-filling local items sort before the ring
    item whose wait they fill).  With ``repack_local``, each run of consecutive local,
    non-offloaded micro-batches of a rank (between two of its ring items) is re-packed
    best-fit-decreasing into micro-batches of ``C`` tokens: sequences placed one by one balance
    finely, and packing them afterwards saves the per-micro-batch overhead.
    """
    keyed: list[list[tuple[tuple, MicroBatch]]] = [[] for _ in range(ctx.world)]
    item_id = 0
    for it, members, key in assignment:
        if len(members) == 1:
            if repack_local and it.ratio == 0.0:
                keyed[members[0]].append((key, it.seqs))  # packed per rank below
            else:
                keyed[members[0]].append((key, _local_mb(ctx, it.seqs, it.ratio)))
            continue
        for r, mb in zip(members, _ring_mbs(ctx, it.seqs, members, item_id, it.ratio)):
            keyed[r].append((key, mb))
        item_id += 1
    ranks = []
    for lst in keyed:
        lst.sort(key=lambda e: e[0])
        ranks.append(_pack_local_runs(ctx, [entry for _, entry in lst]))
    return Plan(ctx.world, ctx.cap, name, tuple(ctx.lengths), ranks, _options(ctx, **options))


def _pack_local_runs(ctx: _Ctx, entries: list[MicroBatch | list[int]]) -> list[MicroBatch]:
    """Pack every run of consecutive sequence lists into best-fit-decreasing bins of ``C`` tokens."""
    out: list[MicroBatch] = []
    run: list[int] = []

    def flush() -> None:
        if len(run) == 1:
            out.append(_local_mb(ctx, run))
        elif run:
            out.extend(_local_mb(ctx, sorted(b)) for b in best_fit_decreasing(ctx.lengths, ctx.cap, run))

    for entry in entries:
        if isinstance(entry, MicroBatch):
            flush()
            run = []
            out.append(entry)
        else:
            run.extend(entry)
    flush()
    return out


# ====================================================================== naive (Alg. 1)

#: How ``naive`` sizes rings with offload on.  ``"paper_min_ranks"`` (``make_plan``'s default,
#: Alg. 1 with Eq. 3 read literally): the fewest ranks (the largest hidden ratio) for every long
#: sequence.  ``"pays"`` (the simulator's ``naive_offload``, the ablation's "+offload" step): a
#: ring shrinks only where that saves work without lengthening the member's micro-batch by more
#: than ``slack`` (:func:`_naive_pays`).
OFFLOAD_POLICIES = ("pays", "paper_min_ranks")


def plan_naive(
    lengths,
    *,
    world_size,
    capacity,
    cost_model,
    seed=0,
    offload=None,
    ranks_per_node=None,
    pipeline_degree=1,
    comm_aware=True,
    offload_policy="paper_min_ranks",
    slack=0.05,
    **_,
) -> Plan:
    if offload_policy not in OFFLOAD_POLICIES:
        raise PlanError(f"offload_policy must be one of {OFFLOAD_POLICIES}, got {offload_policy!r}")
    off = resolve_offload(offload, cost_model, pipeline_degree, default_on=False)
    ctx = _Ctx(lengths, world_size, capacity, cost_model, ranks_per_node, off)
    items = _items(ctx)
    if offload_policy == "paper_min_ranks":
        for it in items:
            it.choose(0)  # Eq. 3's optimum (fewest ranks); D(s) without offload
    else:
        _naive_pays(ctx, items, comm_aware and cost_model.models_comm, slack)
    random.Random(seed).shuffle(items)
    heap = [(0, r) for r in range(world_size)]  # (micro-batch count, rank)
    assignment = []
    for it in items:
        d = it.size
        got = [heapq.heappop(heap) for _ in range(d)]
        members = tuple(sorted(r for _, r in got))
        for cnt, r in got:
            heapq.heappush(heap, (cnt + 1, r))
        assignment.append((it, members, (len(assignment), 0)))
    opts = {"seed": seed, "pipeline_degree": pipeline_degree}
    if off is not None:
        opts["offload_policy"] = offload_policy
    return _emit(ctx, assignment, "naive", opts)


def _naive_pays(ctx: _Ctx, items: list[_Item], cm: bool, slack: float) -> None:
    """``offload_policy="pays"``: shrink a ring only where it pays for a planner blind to time.

    ``naive`` gives every rank the same number of micro-batches whatever they cost, so a ring
    member whose micro-batch gets longer finishes later by that much.  Each long sequence
    therefore takes the fewest ranks Eq. 3 allows whose member time ``t(D)`` is within
    ``1 + slack`` of its time on ``D(s)`` ranks *and* whose work ``D t(D)`` is at least ``slack``
    below the work on ``D(s)`` ranks; with no such size it keeps ``D(s)`` without offload.
    Attention-bound rings do about the same work on any number of ranks (``a s^2`` split
    ``D`` ways) and stay as they are; communication-bound rings (a member's transfer hardly
    shrinks with more members) do much less work on fewer ranks and shrink.
    """
    cost_of, multi, _ = _ring_choice_times(ctx, items, cm)
    picks = []
    for k, ts, _ in multi:
        t0, d0 = ts[-1], items[k].choices[-1][0]
        j = len(ts) - 1
        for i, t in enumerate(ts):
            if t <= (1.0 + slack) * t0 and items[k].choices[i][0] * t <= (1.0 - slack) * d0 * t0:
                j = i
                break
        picks.append(j)
    _apply_picks(items, multi, picks, cost_of)


# ====================================================================== balance (Alg. 2)


def _member_time(ctx: _Ctx, it: _Item, size: int, intra: bool, comm_aware: bool) -> float:
    lens = [ctx.lengths[q] for q in it.seqs]
    if size == 1:
        return ctx.cost.local_time(lens)
    return ctx.cost.ring_member_time(lens, size, intra=intra, comm_aware=comm_aware)[0]


def _likely_intra(ctx: _Ctx, size: int) -> bool:
    return ctx.rpn is not None and size <= ctx.rpn


def _ring_choice_times(
    ctx: _Ctx, items: list[_Item], cm: bool
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
            cost_of[k] = _member_time(ctx, it, d, _likely_intra(ctx, d), cm)
            floor = max(floor, cost_of[k])
            continue
        ts = [_member_time(ctx, it, d, _likely_intra(ctx, d), cm) for d, _ in it.choices]
        neg_pm, m = [], math.inf
        for t in ts:
            m = min(m, t)
            neg_pm.append(-m)
        floor = max(floor, m)
        multi.append((k, ts, neg_pm))
    return cost_of, multi, floor


def _pick_at(multi, level: float, bound: float | None = None) -> list[int]:
    """Per multi-choice item: the fewest ranks whose member time is at most ``level`` (else
    at most ``bound``; with no bound, ``D(s)``)."""
    out = []
    for _, ts, neg_pm in multi:
        j = bisect.bisect_left(neg_pm, -level)  # first j with prefix-min <= level
        if j == len(ts):
            j = len(ts) - 1 if bound is None else bisect.bisect_left(neg_pm, -bound)
        out.append(min(j, len(ts) - 1))
    return out


def _apply_picks(items: list[_Item], multi, picks: list[int], cost_of: list[float]) -> list[float]:
    for (k, ts, _), j in zip(multi, picks):
        items[k].choose(j)
        cost_of[k] = ts[j]
    return cost_of


def _choose_ring_sizes(ctx: _Ctx, items: list[_Item], cm: bool, pipeline_degree: int = 1) -> list[float]:
    """Pick each item's ring size; return its planned member time.

    Without offload an item has one choice, ``D(s)``.  With offload, choose a load level ``T``
    and give every sequence the fewest ranks whose member time is at most ``T``: a larger ``T``
    means fewer ranks and less total work (the mean load ``M(T)`` falls) but coarser items.
    Data parallel (``pipeline_degree`` 1): ``T`` is the crossing ``M(T) = T`` (bisection), which
    minimises ``max(M(T), T)``, a lower bound on the step time.  A sequence that cannot get
    within ``T`` (a comm-bound ring's member time stops falling with more ranks) takes the
    fewest ranks whose member time is within the step-time bound ``max(T, largest
    smallest-member-time)``: beyond its own floor it cannot go, and fewer ranks cost less work.
    Pipelines: :func:`_choose_ring_sizes_pp`.
    """
    if pipeline_degree > 1:
        return _choose_ring_sizes_pp(ctx, items, cm, pipeline_degree)
    cost_of, multi, floor = _ring_choice_times(ctx, items, cm)
    if not multi:
        return cost_of
    multi_ks = {k for k, _, _ in multi}
    fixed = sum(items[k].size * cost_of[k] for k in range(len(items)) if k not in multi_ks)

    def mean_load(picks: list[int]) -> float:
        work = fixed
        for (k, ts, _), j in zip(multi, picks):
            work += items[k].choices[j][0] * ts[j]
        return work / ctx.world

    lo, hi = 0.0, mean_load(_pick_at(multi, 0.0))
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if mean_load(_pick_at(multi, mid)) > mid:
            lo = mid
        else:
            hi = mid
    return _apply_picks(items, multi, _pick_at(multi, hi, max(hi, floor)), cost_of)


PP_LEVELS = 48  # load levels tried by the pipeline ring-size choice
PP_MIN_GAIN = 0.01  # shrink rings under pipelines only for an estimated gain above 1%


def _choose_ring_sizes_pp(ctx: _Ctx, items: list[_Item], cm: bool, p: int) -> list[float]:
    """Ring sizes under pipelines: offload shrinks rings only where the 1F1B load model says it pays.

    A pipeline's load is ``sum(t) / p + (p - 1) max(t) / p``: its longest micro-batch counts
    almost fully, so a shrunk ring (longer member time) costs every pipeline it lands on a
    bigger bubble even when the total work ``W`` does not fall (attention-bound rings do the
    same work on any number of ranks).  For a set of ring sizes the planner estimates the step
    time as ``max(M, t_max)`` with the mean pipeline load
    ``M = W / (world p) + (p - 1) / p x mean of the world longest member-time slots``
    (balanced placement gives each pipeline one of the longest slots as its maximum; an item of
    ``D`` ranks fills ``D`` slots) and ``t_max`` the longest member time (an item costs its
    pipeline at least its own time).  Candidates: no shrinking at all (``D(s)`` for every
    sequence) and ``PP_LEVELS`` load levels ``T`` (every sequence on the fewest ranks whose
    member time is at most ``T``, as in the data-parallel rule) spaced geometrically between the
    floor and the longest fewest-ranks member time.  The lowest estimate wins, but a shrinking
    must beat no shrinking by ``PP_MIN_GAIN`` (1%, below the estimate's accuracy the larger
    rings are kept): offload is used only where it pays.
    """
    cost_of, multi, floor = _ring_choice_times(ctx, items, cm)
    if not multi:
        return cost_of
    multi_ks = {k for k, _, _ in multi}
    fixed_work = 0.0
    fixed_slots: list[tuple[float, int]] = []  # (member time, ranks) of the fixed items
    for k, it in enumerate(items):
        if k not in multi_ks:
            fixed_work += it.size * cost_of[k]
            fixed_slots.append((cost_of[k], it.size))
    fixed_slots.sort(reverse=True)
    world = ctx.world

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

    best_picks = [len(ts) - 1 for _, ts, _ in multi]  # D(s) for every sequence: no offload
    best = estimate(best_picks)
    lo = max(floor, 1e-12)
    hi = max(ts[0] for _, ts, _ in multi)
    if hi > lo:
        ratio = (hi / lo) ** (1.0 / PP_LEVELS)
        level = lo
        for _ in range(PP_LEVELS + 1):
            picks = _pick_at(multi, level, max(level, floor))
            e = estimate(picks)
            if e < best * (1.0 - PP_MIN_GAIN):
                best, best_picks = e, picks
            level *= ratio
    return _apply_picks(items, multi, best_picks, cost_of)


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
    ranks_per_node=None,
    comm_aware=True,
    pp_reading="sequential",
    **_,
) -> Plan:
    if pp_reading not in ("round_robin", "sequential"):
        raise PlanError(f"pp_reading must be 'round_robin' or 'sequential', got {pp_reading!r}")
    off = resolve_offload(offload, cost_model, pipeline_degree, default_on=True)
    ctx = _Ctx(lengths, world_size, capacity, cost_model, ranks_per_node, off)
    # DP-Balance places short sequences one by one (LPT balances finely) and packs each rank's
    # share afterwards; PP-Balance keeps C-token bins (its 1F1B load model prices whole micro-batches)
    dp = pipeline_degree <= 1
    items = _items(ctx, pack_short=not dp)
    cm = comm_aware and cost_model.models_comm

    cost_of = _choose_ring_sizes(ctx, items, cm, pipeline_degree)

    order = sorted(range(len(items)), key=lambda k: (-cost_of[k], -items[k].size, items[k].seqs[0]))
    buckets = _buckets([(items[k], cost_of[k]) for k in order], num_buckets)
    if pipeline_degree <= 1:
        assignment = _dp_balance(ctx, [x for b in buckets for x in b], slack, cm)
    else:
        assignment = _pp_balance(ctx, buckets, slack, cm, pipeline_degree, pp_reading == "round_robin")
    return _emit(
        ctx,
        assignment,
        "balance",
        {
            "seed": seed,
            "slack": slack,
            "num_buckets": num_buckets,
            "pipeline_degree": pipeline_degree,
            "comm_aware": bool(comm_aware),
            "pp_reading": pp_reading,
        },
        repack_local=dp,
    )


def _buckets(seq: list[tuple[_Item, float]], num_buckets: int) -> list[list[tuple[_Item, float]]]:
    """Cut the sorted items into ``num_buckets`` runs of about equal work (ranks x member time)."""
    total = sum(it.size * t for it, t in seq)
    per = total / num_buckets if num_buckets > 0 else total
    out: list[list[tuple[_Item, float]]] = [[]]
    acc = 0.0
    for it, t in seq:
        if out[-1] and acc >= per * len(out) and len(out) < num_buckets:
            out.append([])
        out[-1].append((it, t))
        acc += it.size * t
    return [b for b in out if b]


def _pick_members(
    ctx: _Ctx, heap: list[tuple[float, int]], it: _Item, slack: float, cm: bool
) -> tuple[list[tuple[float, int]], list[tuple[float, int]], float]:
    """Pop the members of a ring (or the one rank of a local item) off the load heap.

    Returns ``(chosen, to push back, member time)``.  Candidates are the ``d`` least-loaded
    ranks plus those within ``delta = max(slack * t, t_inter - t_intra)`` of the ``d``-th (at most
    ``d + 2 * ranks_per_node``; beyond that no candidate can finish earlier).  Options: the ``d``
    least loaded, or the ``d`` least loaded of one node; the one that ends first wins (then the
    one that wastes least waiting, then the lower node).
    """
    d = it.size
    got = [heapq.heappop(heap) for _ in range(d)]
    if d == 1:
        return got, [], _member_time(ctx, it, 1, False, cm)
    ring = tuple(r for _, r in got)
    t_got = _member_time(ctx, it, d, ctx.intra(ring), cm)
    if ctx.rpn is None or d > ctx.rpn:
        return got, [], t_got
    t_intra = _member_time(ctx, it, d, True, cm)
    t_inter = _member_time(ctx, it, d, False, cm)
    limit = got[-1][0] + max(slack * t_inter, t_inter - t_intra)
    cap = d + 2 * ctx.rpn
    while heap and len(got) < cap and heap[0][0] <= limit:
        got.append(heapq.heappop(heap))
    first = got[:d]
    best_end = max(x for x, _ in first) + t_got
    best = (best_end, sum(best_end - t_got - x for x, _ in first), -1)
    best_set, best_t = first, t_got
    by_node: dict[int, list[tuple[float, int]]] = {}
    for e in got:  # got is in (load, rank) order
        by_node.setdefault(ctx.node(e[1]), []).append(e)
    for nd in sorted(by_node):
        cand = by_node[nd][:d]
        if len(cand) < d:
            continue
        start = cand[-1][0]
        key = (start + t_intra, sum(start - x for x, _ in cand), nd)
        if key < best:
            best, best_set, best_t = key, cand, t_intra
    chosen_ranks = {r for _, r in best_set}
    return best_set, [e for e in got if e[1] not in chosen_ranks], best_t


def _dp_balance(ctx: _Ctx, seq: list[tuple[_Item, float]], slack: float, cm: bool):
    """LPT over ranks with ring members starting together; local items back-fill ring waits.

    A ring's members start when the latest is ready; the earlier ones wait.  Each wait is kept as
    a gap (before that ring item in the rank's order); a later local item that fits a gap
    (best fit) runs there for free instead of at the end of the least-loaded rank.
    """
    heap = [(0.0, r) for r in range(ctx.world)]
    gaps: list[tuple[float, int, int]] = []  # (length, rank, gap id), sorted
    gap_at: list[tuple[int, int]] = []  # gap id -> (assignment index of the ring after it, fills)
    assignment = []
    for it, _ in seq:
        d = it.size
        k = len(assignment)
        if d == 1:
            t = _member_time(ctx, it, 1, False, cm)
            pos = bisect.bisect_left(gaps, (t, -1, -1))
            if pos < len(gaps):
                length, r, gid = gaps.pop(pos)
                ring_k, fills = gap_at[gid]
                gap_at[gid] = (ring_k, fills + 1)
                assignment.append((it, (r,), (ring_k, -1, fills)))
                if length - t > 0:
                    bisect.insort(gaps, (length - t, r, gid))
                continue
            load, r = heapq.heappop(heap)
            heapq.heappush(heap, (load + t, r))
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
    return assignment


def _pp_balance(ctx: _Ctx, buckets, slack: float, cm: bool, p: int, round_robin: bool):
    """PP-Balance: the least-loaded pipeline draws next, from its own bucket (``round_robin``)
    or from the first non-empty bucket (``sequential``, the other reading of §4.5 item 5)."""
    nb = len(buckets)
    queues = [list(reversed(b)) for b in buckets]  # pop() from the end = next item of the bucket
    remaining = sum(len(b) for b in buckets)
    cur = [r % nb for r in range(ctx.world)] if nb else [0] * ctx.world
    tsum = [0.0] * ctx.world
    tmax = [0.0] * ctx.world
    heap = [(0.0, r) for r in range(ctx.world)]
    assignment = []
    while remaining:
        load, r0 = heap[0]
        b = cur[r0] if round_robin else 0
        for step in range(nb):
            if queues[(b + step) % nb]:
                b = (b + step) % nb
                break
        it, _ = queues[b].pop()
        remaining -= 1
        chosen, back, t = _pick_members(ctx, heap, it, slack, cm)
        members = tuple(sorted(r for _, r in chosen))
        for e in back:
            heapq.heappush(heap, e)
        for _, r in chosen:
            tsum[r] += t
            tmax[r] = max(tmax[r], t)
            cur[r] = b
            new = tsum[r] / p + (p - 1) * tmax[r] / p
            heapq.heappush(heap, (new, r))
        assignment.append((it, members, (len(assignment), 0)))
    return assignment


register_planner("static", plan_static)
register_planner("naive", plan_naive)
register_planner("balance", plan_balance)


# ====================================================================== the one interface


def make_plan(
    lengths: Sequence[int],
    *,
    world_size: int,
    capacity: int,
    planner: str = "balance",
    cost_model: CostModel | dict | None = None,
    cp_size: int | None = None,
    seed: int = 0,
    offload: OffloadConfig | dict | bool | None = None,
    slack: float = 0.05,
    num_buckets: int = 8,
    pipeline_degree: int = 1,
    ranks_per_node: int | None = None,
    comm_aware: bool = True,
    **extra,
) -> Plan:
    """Plan one global batch: for every rank, its ordered micro-batches.

    ``lengths``: token counts of the batch's sequences (``seq`` ids index this list).
    ``capacity``: tokens a rank holds in one micro-batch (>= 2).  ``cost_model`` defaults to
    :meth:`CostModel.paper_preset`; ``ranks_per_node`` overrides the cost model's topology.
    ``cp_size`` is the static planner's CP degree (default: the smallest that fits).  Other
    planners (``available_planners()``) receive every option by keyword, plus ``extra``.
    Every micro-batch carries ``est_time`` (and ``exposed_time``) from the cost model.
    """
    world_size = _check_int("world_size", world_size, 1)
    capacity = _check_int("capacity", capacity, 2)
    if isinstance(seed, bool) or not hasattr(seed, "__index__"):
        raise PlanError(f"seed must be an integer, got {seed!r}")
    seed = int(seed)
    lens = check_lengths(lengths)
    if cost_model is None:
        cost = CostModel.paper_preset()
    elif isinstance(cost_model, dict):
        cost = CostModel.from_json_dict(cost_model)
    elif isinstance(cost_model, CostModel):
        cost = cost_model
    else:
        raise PlanError(f"cost_model must be a CostModel, its dict or None, got {type(cost_model).__name__}")
    if ranks_per_node is None:
        ranks_per_node = cost.ranks_per_node
    else:
        ranks_per_node = _check_int("ranks_per_node", ranks_per_node, 1)
    pipeline_degree = _check_int("pipeline_degree", pipeline_degree, 1)
    num_buckets = _check_int("num_buckets", num_buckets, 1)
    if not (isinstance(slack, (int, float)) and math.isfinite(slack) and slack >= 0):
        raise PlanError(f"slack must be a finite number >= 0, got {slack!r}")
    fn = get_planner(planner)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # planning builds many small acyclic objects; collection passes only cost time
    try:
        plan = fn(
            lens,
            world_size=world_size,
            capacity=capacity,
            cost_model=cost,
            cp_size=cp_size,
            seed=seed,
            offload=offload,
            slack=float(slack),
            num_buckets=num_buckets,
            pipeline_degree=pipeline_degree,
            ranks_per_node=ranks_per_node,
            comm_aware=bool(comm_aware),
            **extra,
        )
        _fill_costs(plan, cost, ranks_per_node)
    finally:
        if gc_was_enabled:
            gc.enable()
    return plan


def _fill_costs(plan: Plan, cost: CostModel, rpn: int | None) -> None:
    """Give micro-batches of registered planners that left ``est_time`` at 0 the model's estimate."""
    opts = plan.options
    if "cost_model" not in opts:
        opts["cost_model"] = cost.to_json_dict()
    opts.setdefault("ranks_per_node", rpn)
    ctx = _Ctx(list(plan.lengths), plan.world_size, plan.capacity, cost, rpn, None)
    for mbs in plan.ranks:
        for mb in mbs:
            if mb.est_time:
                continue
            lens = [plan.lengths[p.seq] for p in mb.pieces]
            if mb.ring is None:
                mb.est_time = cost.local_time(lens)
            else:
                mb.est_time, mb.exposed_time = cost.ring_member_time(
                    lens, len(mb.ring), intra=ctx.intra(mb.ring), comm_aware=True
                )
