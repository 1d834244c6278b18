"""Planners of the systems users would pick instead, so that a comparison is one run.

* ``megatron_dcp``: Megatron-Core Dynamic Context Parallelism (peers.md §1.2).  Each
  sequence gets ``cp = next power of two of ceil(L / C)`` ranks (1 when it fits one rank);
  its workload is ``L**2 / cp`` (Megatron's own relative intensity, no linear term).
  Sequences, longest first, are placed greedily into *groups*: one group is one
  barrier-synchronised round in which every rank runs at most one micro-batch.  A
  sequence joins the least-loaded existing sub-group of the same ``cp`` while that keeps
  the round within ``slack`` (5%) of its largest load, or opens a new sub-group on free
  ranks; otherwise it waits for the next round.  Ranks left free at the end of a round
  double the ``cp`` of the most loaded sub-groups that fit.  Rounds are recorded in
  ``plan.options["rounds"]`` so the simulator puts a barrier between them.
* ``verl_kk``: veRL's dynamic batch size with ``balance_batch`` (peers.md §3.1).  veRL has
  no per-sequence CP: sequences longer than one rank's capacity need a static CP/SP group
  sized for the longest sequence, so the pool is cut into ``dp = world / cp`` fixed groups
  of ``cp`` ranks.  Sequences are spread over the DP groups by Karmarkar-Karp on token
  counts; every group runs the same number of micro-batches (veRL all-reduces the MAX
  count), and inside a group Karmarkar-Karp splits the sequences into micro-batches on
  veRL's workload ``24576 s + s**2``.  A micro-batch over ``cp > 1`` ranks is one ring item
  sharding every sequence zigzag over the group, as in the static mesh.
* ``lpt``: a plain longest-processing-time greedy, the textbook baseline.  Each long
  sequence is one ring item on its minimal ring ``D(s) = ceil(s / C)`` (zigzag slots within
  ``C``); short sequences are packed best-fit-decreasing into ``C``-token micro-batches.
  Items, longest member time first (the communication-aware cost model), go to the ``D``
  least-loaded ranks, which start the item together when the last of them is free.  No
  node awareness, no ring sizing, no gap filling: what ``balance`` must beat.

All three produce ordinary :class:`~.plan.Plan` objects (``plan.validate()`` holds), so the
engine and the simulator run them unchanged.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from lightning_bytescale.planner.cost_model import CostModel, ranks_without_offload
from lightning_bytescale.planner.errors import PlanError
from lightning_bytescale.planner.packing import best_fit_decreasing
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan
from lightning_bytescale.planner.planners import static_cp_size
from lightning_bytescale.planner.zigzag import all_member_ranges, slots_per_member


def _check(lengths: Sequence[int], world_size: int, capacity: int) -> list[int]:
    if world_size < 1:
        raise PlanError(f"world_size must be >= 1, got {world_size}")
    if capacity < 2:
        raise PlanError(f"capacity must be >= 2 tokens, got {capacity}")
    out = [int(x) for x in lengths]
    bad = [x for x in out if x < 1]
    if bad:
        raise PlanError(f"sequence lengths must be >= 1, got {bad[0]}; drop empty samples first")
    return out


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _ring_item(lengths: Sequence[int], seqs: Sequence[int], ring: tuple[int, ...], item: int) -> list:
    """One MicroBatch per member: every sequence zigzag-sharded over ``ring``.

    Same ranges as :func:`.zigzag.member_ranges`, all members of a sequence at once (a static
    mesh item holds thousands of sequences on hundreds of members).
    """
    n = len(ring)
    pieces: list[list[Piece]] = [[] for _ in range(n)]
    for s in seqs:
        for member, ranges in enumerate(all_member_ranges(lengths[s], n)):
            pieces[member].append(Piece(s, ranges))  # every member lists every sequence
    return [MicroBatch(pieces=pieces[m], ring=ring, item=item) for m in range(n)]


def _local(seqs: Sequence[int], lengths: Sequence[int]) -> MicroBatch:
    return MicroBatch(pieces=[Piece(s, ((0, lengths[s]),)) for s in seqs])


def _place(
    ranks: list[list[MicroBatch]],
    lengths: Sequence[int],
    seqs: list[int],
    members: tuple[int, ...],
    item: int,
) -> int:
    """Append one item to its members' lists: local on one rank, else ring item number ``item``.

    Returns the next ring item number (ring items are numbered in placement order).
    """
    if len(members) == 1:
        ranks[members[0]].append(_local(seqs, lengths))
        return item
    for r, mb in zip(members, _ring_item(lengths, seqs, members, item), strict=True):
        ranks[r].append(mb)
    return item + 1


def _ring_slots(lengths: Sequence[int], seqs: Sequence[int], n: int) -> int:
    return sum(slots_per_member(lengths[s], n) for s in seqs)


# --------------------------------------------------------------------------- megatron_dcp

_PROBES = 64  # groups probed for room before a sequence is deferred to the next round


def _least_loaded_with_room(
    heap: list[tuple[float, int]], groups: list[dict], need: int, capacity: int
) -> int | None:
    """Pop the least-loaded group of ``heap`` with room for ``need`` slots (others are pushed back)."""
    skipped = []
    found = None
    while heap and len(skipped) < _PROBES:
        load, g = heapq.heappop(heap)
        if load != groups[g]["load"]:
            continue  # stale entry
        if groups[g]["slots"] + need <= capacity:
            found = g
            break
        skipped.append((load, g))
    for entry in skipped:
        heapq.heappush(heap, entry)
    return found


def megatron_cp_size(length: int, capacity: int) -> int:
    """Megatron DCP's CP size: 1 when the sequence fits a rank, else the next power of two of ceil(L/C)."""
    return 1 if length <= capacity else _next_pow2(-(-length // capacity))


def plan_megatron_dcp(
    lengths: Sequence[int],
    *,
    world_size: int,
    capacity: int,
    slack: float = 0.05,
    **_: object,
) -> Plan:
    """Megatron-Core Dynamic CP reading (module docstring); rounds separated by barriers."""
    lens = _check(lengths, world_size, capacity)
    cps = [megatron_cp_size(x, capacity) for x in lens]
    too_big = [i for i, c in enumerate(cps) if c > world_size]
    if too_big:
        i = too_big[0]
        raise PlanError(
            f"sequence {i} of {lens[i]} tokens needs a CP group of {cps[i]} ranks (a power of two), "
            f"more than world_size={world_size}; raise capacity or the number of ranks"
        )
    work = [x * x / c for x, c in zip(lens, cps)]
    remaining = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    ranks: list[list[MicroBatch]] = [[] for _ in range(world_size)]
    rounds: list[list[int]] = [[] for _ in range(world_size)]
    item = 0
    rnd = 0
    while remaining:
        groups: list[dict] = []  # cp, ranks, seqs, load, slots
        heaps: dict[int, list[tuple[float, int]]] = {}
        free = list(range(world_size - 1, -1, -1))  # pop() hands out the lowest rank first
        round_max = 0.0
        deferred = []
        for i in remaining:
            cp, w, length = cps[i], work[i], lens[i]
            need = slots_per_member(length, cp) if cp > 1 else length
            placed = False
            heap = heaps.setdefault(cp, [])
            if len(free) < cp:  # no free ranks: join the least-loaded same-size group with room
                g = _least_loaded_with_room(heap, groups, need, capacity)
                if g is not None and groups[g]["load"] + w <= max(round_max, w) * (1.0 + slack):
                    grp = groups[g]
                    grp["seqs"].append(i)
                    grp["load"] += w
                    grp["slots"] += need
                    round_max = max(round_max, grp["load"])
                    placed = True
                if g is not None:
                    heapq.heappush(heap, (groups[g]["load"], g))
            if not placed and len(free) >= cp:
                members = [free.pop() for _ in range(cp)]
                groups.append({"cp": cp, "ranks": members, "seqs": [i], "load": w, "slots": need})
                heapq.heappush(heap, (w, len(groups) - 1))
                round_max = max(round_max, w)
                placed = True
            if not placed:
                deferred.append(i)
        if not groups:  # cannot happen: the longest remaining sequence always fits an empty round
            raise PlanError("megatron_dcp made no progress; this is a bug")
        # fill empty ranks by doubling the CP size of the most loaded groups that fit
        for g in sorted(range(len(groups)), key=lambda g: -groups[g]["load"]):
            grp = groups[g]
            while len(free) >= grp["cp"] and grp["cp"] * 2 <= world_size:
                extra = [free.pop() for _ in range(grp["cp"])]
                grp["ranks"] = grp["ranks"] + extra
                grp["cp"] *= 2
                grp["load"] /= 2
        for grp in groups:
            members = tuple(sorted(grp["ranks"]))
            if len(members) == 1:
                ranks[members[0]].append(_local(grp["seqs"], lens))
                rounds[members[0]].append(rnd)
                continue
            for r, mb in zip(members, _ring_item(lens, grp["seqs"], members, item), strict=True):
                ranks[r].append(mb)
                rounds[r].append(rnd)
            item += 1
        remaining = deferred
        rnd += 1
    return Plan(
        world_size=world_size,
        capacity=capacity,
        planner="megatron_dcp",
        lengths=tuple(lens),
        ranks=ranks,
        options={"slack": slack, "rounds": rounds, "num_rounds": rnd},
    )


# --------------------------------------------------------------------------- verl_kk


def karmarkar_karp(weights: Sequence[float], k: int) -> list[list[int]]:
    """k-way largest differencing method: indices of ``weights`` split into ``k`` parts of near-equal sum."""
    if k < 1:
        raise PlanError(f"number of partitions must be >= 1, got {k}")
    if not weights:
        return [[] for _ in range(k)]
    counter = itertools.count()
    heap = []
    for i, w in enumerate(weights):
        sums = [float(w)] + [0.0] * (k - 1)
        parts = [[i]] + [[] for _ in range(k - 1)]
        heapq.heappush(heap, (-float(w), next(counter), sums, parts))
    while len(heap) > 1:
        _, _, s1, p1 = heapq.heappop(heap)
        _, _, s2, p2 = heapq.heappop(heap)
        # pair the largest sums of one with the smallest of the other (both kept sorted desc)
        sums = [a + b for a, b in zip(s1, reversed(s2))]
        for a, b in zip(p1, reversed(p2)):
            a.extend(b)  # both states are consumed; reuse p1's lists
        parts = p1
        order = sorted(range(k), key=lambda j: -sums[j])
        sums = [sums[j] for j in order]
        parts = [parts[j] for j in order]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), next(counter), sums, parts))
    return heap[0][3]


def verl_workload(length: int) -> float:
    """veRL's per-sequence workload estimate (linear + quadratic, for hidden size 4096)."""
    return 24576.0 * length + float(length) * length


def plan_verl_kk(
    lengths: Sequence[int],
    *,
    world_size: int,
    capacity: int,
    cp_size: int | None = None,
    **_: object,
) -> Plan:
    """veRL dynamic-batch reading (module docstring): static CP groups, KK across DP and micro-batches."""
    lens = _check(lengths, world_size, capacity)
    cp = static_cp_size(lens, world_size, capacity) if cp_size is None else int(cp_size)
    if cp < 1 or world_size % cp:
        raise PlanError(f"cp_size {cp} must be >= 1 and divide world_size {world_size} (static DP x CP mesh)")
    too_long = [i for i, x in enumerate(lens) if slots_per_member(x, cp) > capacity]
    if too_long:
        i = too_long[0]
        raise PlanError(
            f"sequence {i} of {lens[i]} tokens does not fit a CP group of {cp} ranks at capacity "
            f"{capacity}; raise cp_size or capacity"
        )
    dp = world_size // cp
    groups = karmarkar_karp([float(x) for x in lens], dp)

    def split(seqs: list[int], m: int) -> list[list[int]] | None:
        parts = karmarkar_karp([verl_workload(lens[s]) for s in seqs], m)
        parts = [[seqs[j] for j in p] for p in parts]
        if any(_slots(p) > capacity for p in parts):
            return None
        return parts

    def _slots(p: list[int]) -> int:
        return _ring_slots(lens, p, cp) if cp > 1 else sum(lens[s] for s in p)

    count = max(
        (-(-sum(_slots([s]) for s in g) // capacity) for g in groups if g),
        default=0,
    )
    count = max(count, 1)
    while True:  # veRL all-reduces MAX so every group runs the same count; grow it until all fit
        parts_per_group = [split(sorted(g), count) if g else [] for g in groups]
        if all(p is not None for p in parts_per_group):
            break
        count += 1
    ranks: list[list[MicroBatch]] = [[] for _ in range(world_size)]
    item = 0
    for m in range(count):
        for gi, parts in enumerate(parts_per_group):
            if m >= len(parts) or not parts[m]:
                continue
            item = _place(ranks, lens, sorted(parts[m]), tuple(range(gi * cp, (gi + 1) * cp)), item)
    return Plan(
        world_size=world_size,
        capacity=capacity,
        planner="verl_kk",
        lengths=tuple(lens),
        ranks=ranks,
        options={"cp_size": cp, "dp_size": dp, "micro_batches_per_rank": count},
    )


# --------------------------------------------------------------------------- lpt


def _on_one_node(ring: Sequence[int], ranks_per_node: int | None) -> bool:
    return ranks_per_node is not None and len({r // ranks_per_node for r in ring}) == 1


def plan_lpt(
    lengths: Sequence[int],
    *,
    world_size: int,
    capacity: int,
    cost_model: CostModel,
    ranks_per_node: int | None = None,
    **_: object,
) -> Plan:
    """Longest-processing-time greedy on minimal rings (module docstring)."""
    lens = _check(lengths, world_size, capacity)
    items: list[tuple[list[int], int]] = []  # (sequences, ring size)
    short = []
    for i, s in enumerate(lens):
        if s <= capacity:
            short.append(i)
            continue
        d = ranks_without_offload(s, capacity)
        if d > world_size:
            raise PlanError(
                f"sequence {i} has length {s} and needs {d} ranks of capacity {capacity}, but world_size "
                f"is {world_size}; add ranks, raise capacity, or split/truncate documents to the context length"
            )
        items.append(([i], d))
    items.extend((sorted(b), 1) for b in best_fit_decreasing(lens, capacity, short))

    def member_time(seqs: list[int], d: int, intra: bool) -> float:
        sl = [lens[q] for q in seqs]
        if d == 1:
            return cost_model.local_time(sl)
        return cost_model.ring_member_time(sl, d, intra=intra, comm_aware=True)[0]

    rpn = ranks_per_node
    key = [member_time(seqs, d, rpn is not None and d <= rpn) for seqs, d in items]
    order = sorted(range(len(items)), key=lambda k: (-key[k], -items[k][1], items[k][0][0]))
    heap = [(0.0, r) for r in range(world_size)]
    ranks: list[list[MicroBatch]] = [[] for _ in range(world_size)]
    item = 0
    for k in order:
        seqs, d = items[k]
        got = [heapq.heappop(heap) for _ in range(d)]
        members = tuple(sorted(r for _, r in got))
        end = max(load for load, _ in got) + member_time(seqs, d, _on_one_node(members, rpn))
        for r in members:
            heapq.heappush(heap, (end, r))
        item = _place(ranks, lens, seqs, members, item)
    return Plan(
        world_size=world_size,
        capacity=capacity,
        planner="lpt",
        lengths=tuple(lens),
        ranks=ranks,
        options={"ranks_per_node": rpn},
    )
