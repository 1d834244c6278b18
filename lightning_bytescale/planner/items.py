"""Plan items: what the HDP planners place, and how placed items become micro-batches.

``naive`` and ``balance`` share them.  An :class:`Item` is one long sequence (with its feasible
ring sizes) or a set of short sequences for one rank; :func:`emit` turns a placement (item,
members, order key) into a validated-shape :class:`~.plan.Plan`, numbering ring items in
placement order (the deadlock-free global order) and packing each rank's run of short
sequences into ``C``-token micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_bytescale.planner.cost_model import (
    CostModel,
    OffloadConfig,
    max_offload_ratio,
    offload_options,
)
from lightning_bytescale.planner.errors import PlanError
from lightning_bytescale.planner.modes import RING_ONLY, ModeChoice, best_mode, group_layout, likely_layout
from lightning_bytescale.planner.packing import best_fit_decreasing
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan
from lightning_bytescale.planner.zigzag import all_member_ranges


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
class PlanContext:
    lengths: list[int]
    world: int
    cap: int
    cost: CostModel
    rpn: int | None
    offload: OffloadConfig | None
    modes: tuple[str, ...] = RING_ONLY  # attention modes a ring item may run in (.modes)

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


def local_mb(ctx: PlanContext, seqs: Sequence[int], ratio: float = 0.0) -> MicroBatch:
    lens = ctx.lengths
    return MicroBatch(
        pieces=[Piece(q, ((0, lens[q]),)) for q in seqs],
        offload_ratio=ratio,
        est_time=ctx.cost.local_time([lens[q] for q in seqs]),
    )


def ring_mode(ctx: PlanContext, lengths: Sequence[int], ring: Sequence[int], comm_aware: bool) -> ModeChoice:
    """The mode the members ``ring`` run an item of ``lengths`` in, and one member's time.

    Ring-only planning (``ctx.modes == ("ring",)``) is the ring's own formula, as before modes.
    """
    if ctx.modes == RING_ONLY:
        t, exposed = ctx.cost.ring_member_time(
            lengths, len(ring), intra=ctx.intra(ring), comm_aware=comm_aware
        )
        return ModeChoice("ring", t, exposed, t)
    return best_mode(ctx.cost, lengths, group_layout(ring, ctx.rpn), ctx.modes, comm_aware=comm_aware)


def ring_mbs(
    ctx: PlanContext, seqs: Sequence[int], ring: tuple[int, ...], item: int, ratio: float
) -> list[MicroBatch]:
    lens = ctx.lengths
    n = len(ring)
    sl = [lens[q] for q in seqs]
    choice = ring_mode(ctx, sl, ring, True)
    per_member: list[list[Piece]] = [[] for _ in range(n)]
    for q in seqs:
        for m, ranges in enumerate(all_member_ranges(lens[q], n)):
            per_member[m].append(Piece(q, ranges))
    timing = {"est_time": choice.time, "exposed_time": choice.exposed, "mode": choice.mode}
    return [MicroBatch(pieces, ring, item, ratio, **timing) for pieces in per_member]


def plan_options(ctx: PlanContext, **kw) -> dict:
    out = {
        "cost_model": ctx.cost.to_json_dict(),
        "offload": None if ctx.offload is None else ctx.offload.to_json_dict(),
        "ranks_per_node": ctx.rpn,
    }
    out.update(kw)
    return out


@dataclass
class Item:
    seqs: list[int]
    choices: list[tuple[int, float]]  # feasible (ring size, offload ratio), fewest ranks first
    pick: int = -1  # index into choices
    size: int = 0  # ring size of the pick
    ratio: float = 0.0  # offload ratio of the pick
    base: int = -1  # index of (D(s), 0): the fewest ranks without offload; later choices are larger rings

    def choose(self, j: int) -> None:
        self.pick = j
        self.size, self.ratio = self.choices[j]


def make_items(ctx: PlanContext, pack_short: bool = True) -> list[Item]:
    """Long sequences (each its own item, with its ring-size choices) and short ones.

    Short sequences come as best-fit-decreasing bins of ``C`` tokens (``pack_short``), or one
    item each, for a planner that places them one by one and packs each rank's share afterwards
    (:func:`emit` with ``repack_local``).
    """
    short: list[int] = []
    out: list[Item] = []
    for i, s in enumerate(ctx.lengths):
        if s <= ctx.cap:
            short.append(i)
            continue
        choices = [c for c in offload_options(s, ctx.cap, ctx.cost, ctx.offload) if c[0] <= ctx.world]
        if not choices:
            d_off = offload_options(s, ctx.cap, ctx.cost, ctx.offload)[0][0]
            raise ctx.too_long(i, d_off, "with offload" if ctx.offload else "without offload")
        out.append(Item([i], choices, base=len(choices) - 1))
    bins = best_fit_decreasing(ctx.lengths, ctx.cap, short) if pack_short else [[i] for i in short]
    for b in bins:
        out.append(Item(sorted(b), [(1, 0.0)], 0, 1, 0.0, 0))
    return out


def member_time(ctx: PlanContext, it: Item, size: int, intra: bool, comm_aware: bool) -> float:
    """One member's time for ``it`` on ``size`` ranks, before the members are known: inside one
    node when ``intra``, else across nodes (whole node groups for the hybrid mode)."""
    lens = [ctx.lengths[q] for q in it.seqs]
    if size == 1:
        return ctx.cost.local_time(lens)
    if ctx.modes == RING_ONLY:
        return ctx.cost.ring_member_time(lens, size, intra=intra, comm_aware=comm_aware)[0]
    layout = likely_layout(size, ctx.rpn, ctx.cost, intra)
    return best_mode(ctx.cost, lens, layout, ctx.modes, comm_aware=comm_aware).balance_time


def ring_time(ctx: PlanContext, it: Item, ring: Sequence[int], comm_aware: bool) -> float:
    """One member's time for ``it`` on the members ``ring`` (their nodes decide the modes)."""
    return ring_mode(ctx, [ctx.lengths[q] for q in it.seqs], ring, comm_aware).balance_time


def likely_intra(ctx: PlanContext, size: int) -> bool:
    return ctx.rpn is not None and size <= ctx.rpn


def emit(
    ctx: PlanContext,
    assignment: list[tuple[Item, tuple[int, ...], tuple]],
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
                keyed[members[0]].append((key, local_mb(ctx, it.seqs, it.ratio)))
            continue
        for r, mb in zip(members, ring_mbs(ctx, it.seqs, members, item_id, it.ratio)):
            keyed[r].append((key, mb))
        item_id += 1
    ranks = []
    for lst in keyed:
        lst.sort(key=lambda e: e[0])
        ranks.append(_pack_local_runs(ctx, [entry for _, entry in lst]))
    return Plan(ctx.world, ctx.cap, name, tuple(ctx.lengths), ranks, plan_options(ctx, **options))


def _pack_local_runs(ctx: PlanContext, entries: list[MicroBatch | list[int]]) -> list[MicroBatch]:
    """Pack every run of consecutive sequence lists into best-fit-decreasing bins of ``C`` tokens."""
    out: list[MicroBatch] = []
    run: list[int] = []

    def flush() -> None:
        if len(run) == 1:
            out.append(local_mb(ctx, run))
        elif run:
            out.extend(local_mb(ctx, sorted(b)) for b in best_fit_decreasing(ctx.lengths, ctx.cap, run))

    for entry in entries:
        if isinstance(entry, MicroBatch):
            flush()
            run = []
            out.append(entry)
        else:
            run.extend(entry)
    flush()
    return out
