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
  communication-aware cost model (:mod:`.balance`).

Peers users would pick instead (``megatron_dcp``, ``verl_kk``, ``lpt``) live in :mod:`.peers`.

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
   When every sequence is local (no ring, no offload), moves and swaps between the slowest
   rank and the least-loaded ones, priced at each share's packed cost, then close most of what
   is left (``refine=True``, default; :mod:`.refine`): LPT priced each sequence alone, with
   its own micro-batch overhead.
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
* Ring size: at least what memory requires (``D(s)``, or Eq. 3's optimum with offload), and
  possibly more (issue 16, ``grow_rings=True``, default; :mod:`.ring_sizes`).  A *load level*
  ``T`` gives every sequence the fewest ranks whose member time is at most ``T``.  Data
  parallel: ``T`` solves ``mean load(T) = T`` (fewer ranks mean bigger chunks, more hidden
  transfer and less total work, but an item longer than the mean load would set the step
  time; more ranks than ``D(s)`` shorten an attention-bound item that would).  A sequence whose
  member time cannot get under ``T`` (a comm-bound ring stops getting faster with more ranks)
  takes the fewest ranks within ``max(T, largest floor)``.  Under pipelines
  (``pipeline_degree > 1``) the level is the one with the lowest estimated 1F1B step time: a
  pipeline pays about ``(p - 1) / p`` of its longest micro-batch once more, so grown rings pay
  there even at the mean load.  The planner places several candidate ring-size sets (offload
  on and off, grown rings or ``D(s)``, and ``D(s)`` rounded up to a power of two so that rings
  tile the ranks) and keeps the one whose placement ends first: with pipelines it times the
  slowest pipelines' exact 1F1B schedules (:mod:`.pipeline`, the simulator's function).
  ``naive`` takes Eq. 3's optimum (``offload_policy="paper_min_ranks"``, default) or shrinks
  only where that saves work at about the same member time (``offload_policy="pays"``, see
  :func:`_naive_pays`); it never grows a ring.
* Placement: rings inside one node when that ends earlier (item 2 above); the exposed ring time
  of every micro-batch is in ``exposed_time`` and summed in ``Plan.stats()``.
* Offload default (``offload=None``): on for ``balance`` when the cost model has activation
  coefficients, off for ``naive`` and ``static``; ``True``/``False``/an :class:`OffloadConfig`
  force it.

Determinism: only lists, sorted keys and ``random.Random(seed)`` decide; no set or dict order,
no hashing of strings, so every process builds the same plan.
"""

from __future__ import annotations

import gc
import heapq
import random
from collections.abc import Callable, Sequence
from typing import Any

from lightning_bytescale.planner.config import PlannerConfig
from lightning_bytescale.planner.cost_model import CostModel, member_slots
from lightning_bytescale.planner.errors import PlanError
from lightning_bytescale.planner.items import (
    Item,
    PlanContext,
    emit,
    local_mb,
    make_items,
    plan_options,
    resolve_offload,
    ring_mbs,
)
from lightning_bytescale.planner.modes import group_layout, mode_time
from lightning_bytescale.planner.packing import best_fit_decreasing
from lightning_bytescale.planner.pipeline_order import check_micro_batch_limit
from lightning_bytescale.planner.plan import MicroBatch, Plan
from lightning_bytescale.planner.registry import (  # noqa: F401  (re-exported: the registry's old home)
    _REGISTRY,
    available_planners,
    get_planner,
    register_planner,
)
from lightning_bytescale.planner.ring_sizes import apply_picks, ring_choice_times
from lightning_bytescale.planner.sync_order import local_last

PlannerFn = Callable[..., Plan]

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
    ctx = PlanContext(lengths, world_size, capacity, cost_model, ranks_per_node, None)
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
            ranks[g].append(local_mb(ctx, seqs))
            continue
        ring = tuple(range(g * cp, (g + 1) * cp))
        for r, mb in zip(ring, ring_mbs(ctx, seqs, ring, item, 0.0)):
            ranks[r].append(mb)
        item += 1
    return Plan(
        world_size,
        capacity,
        "static",
        tuple(lengths),
        ranks,
        plan_options(ctx, cp_size=cp, dp_size=dp, seed=seed, pipeline_degree=pipeline_degree),
    )


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
    ctx = PlanContext(lengths, world_size, capacity, cost_model, ranks_per_node, off)
    items = make_items(ctx)
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
    return emit(ctx, assignment, "naive", opts)


def _naive_pays(ctx: PlanContext, items: list[Item], cm: bool, slack: float) -> None:
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
    cost_of, multi, _ = ring_choice_times(ctx, items, cm)
    picks = []
    for k, ts, _ in multi:
        base = items[k].base
        t0, d0 = ts[base], items[k].choices[base][0]
        j = base
        for i, t in enumerate(ts):
            if t <= (1.0 + slack) * t0 and items[k].choices[i][0] * t <= (1.0 - slack) * d0 * t0:
                j = i
                break
        picks.append(j)
    apply_picks(items, multi, picks, cost_of)


# ====================================================================== the one interface


def make_plan(
    lengths: Sequence[int],
    *,
    world_size: int,
    config: PlannerConfig | None = None,
    **options: Any,
) -> Plan:
    """Plan one global batch: for every rank, its ordered micro-batches.

    ``lengths``: token counts of the batch's sequences (``seq`` ids index this list).
    ``config``: the planning options (:class:`PlannerConfig`; default: its defaults);
    ``options``: keyword options on top of it, the same names as ``PlannerConfig``'s fields
    (``planner``, ``capacity``, ``cost_model``, ``seed``, ...) plus the chosen planner's own
    ones (``pp_reading``, ``offload_policy``, ...).  An unknown name raises
    :class:`~lightning_bytescale.planner.errors.PlannerConfigError` naming the closest valid one.
    Every planner receives every option by keyword.  Every micro-batch carries ``est_time``
    (and ``exposed_time``) from the cost model.  Last, a rank whose last micro-batch is a ring
    gets a local one last where that does not lengthen the plan's estimated step time
    (:func:`~.sync_order.local_last`: so its gradient sync can overlap that backward).
    """
    plan = local_last(_place(lengths, world_size=world_size, config=config, **options))
    limit = plan.options.get("max_micro_batches")
    if limit is not None:
        check_micro_batch_limit(plan, limit)
    return plan


def _place(
    lengths: Sequence[int],
    *,
    world_size: int,
    config: PlannerConfig | None = None,
    **options: Any,
) -> Plan:
    """:func:`make_plan` as the planner placed it, before :func:`~.sync_order.local_last`."""
    world_size = _check_int("world_size", world_size, 1)
    if config is None:
        cfg = PlannerConfig.from_options(**options)
    elif not isinstance(config, PlannerConfig):
        raise PlanError(f"config must be a PlannerConfig or None, got {type(config).__name__}")
    else:
        cfg = config.replace(**options) if options else config
    lens = check_lengths(lengths)
    cost = cfg.cost_model if cfg.cost_model is not None else CostModel.paper_preset()
    ranks_per_node = cfg.ranks_per_node if cfg.ranks_per_node is not None else cost.ranks_per_node
    fn = get_planner(cfg.planner)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # planning builds many small acyclic objects; collection passes only cost time
    try:
        plan = fn(
            lens,
            world_size=world_size,
            capacity=cfg.capacity,
            cost_model=cost,
            cp_size=cfg.cp_size,
            seed=0 if cfg.seed is None else cfg.seed,
            offload=cfg.offload,
            slack=cfg.slack,
            num_buckets=cfg.num_buckets,
            pipeline_degree=cfg.pipeline_degree,
            max_micro_batches=cfg.max_micro_batches,
            ranks_per_node=ranks_per_node,
            comm_aware=cfg.comm_aware,
            **cfg.planner_kwargs(),
        )
        _fill_costs(plan, cost, ranks_per_node)
        if cfg.max_micro_batches is not None:
            plan.options["max_micro_batches"] = cfg.max_micro_batches
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
    for mbs in plan.ranks:
        for mb in mbs:
            if mb.est_time:
                continue
            lens = [plan.lengths[p.seq] for p in mb.pieces]
            if mb.ring is None:
                mb.est_time = cost.local_time(lens)
            else:
                layout = group_layout(mb.ring, rpn)
                mb.est_time, mb.exposed_time = mode_time(cost, mb.mode, lens, layout)
