"""The `Plan`: what every rank runs in one step, and the checks that make it safe to run.

A plan lists, for every rank, an ordered list of micro-batches.  A micro-batch is either
*local* (``ring is None``: whole sequences packed on this rank) or one member's share of a
*ring item* (``ring`` is the ordered tuple of global ranks that share it; every member holds
its zigzag share of the same sequences, see :mod:`.zigzag`).  Ring items carry an ``item`` id
that is unique in the plan; members run their shared items in increasing ``item`` order, so a
global order of items exists and point-to-point rings cannot deadlock.  A ring item's ``mode``
says how its attention runs: ``"ring"`` (zigzag ring attention, the default), ``"ulysses"``
or ``"hybrid"`` (:mod:`.modes`); a local micro-batch's is always ``"ring"``.

:meth:`Plan.validate` checks the five promises (coverage, capacity, ring membership, order, modes),
:meth:`Plan.digest` hashes the canonical JSON form so ranks can compare plans cheaply,
:meth:`Plan.stats` summarises estimated load, and :meth:`Plan.to_json_dict` /
:meth:`Plan.from_json_dict` give the documented file schema (docs/planner.md).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_bytescale.planner.cost_model import CostModel, OffloadConfig, resident_tokens
from lightning_bytescale.planner.errors import PlanError, PlanValidationError
from lightning_bytescale.planner.modes import MODES, RING, ULYSSES, group_layout, mode_bytes
from lightning_bytescale.planner.zigzag import all_member_ranges


@dataclass(frozen=True)
class Piece:
    """The part of one sequence that one rank holds in one micro-batch.

    ``seq`` indexes the global batch's length list; ``ranges`` are half-open token ranges in
    the sequence's own positions, real tokens only (padding is never in ranges).
    """

    seq: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def num_tokens(self) -> int:
        return sum(e - s for s, e in self.ranges)


@dataclass
class MicroBatch:
    """One forward+backward on one rank."""

    pieces: list[Piece]
    ring: tuple[int, ...] | None = None  # global ranks in ring order; None for local work
    item: int | None = None  # ring item id (global order key); None for local work
    offload_ratio: float = 0.0
    est_time: float = 0.0
    exposed_time: float = 0.0  # ring transfer time not hidden behind attention (seconds, in est_time)
    # how a ring item's members compute attention: "ring" (zigzag ring), "ulysses" (heads split over
    # the members by an all-to-all) or "hybrid" (Ulysses inside each node x ring across nodes)
    mode: str = "ring"

    @property
    def is_local(self) -> bool:
        return self.ring is None

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.pieces)


@dataclass
class Plan:
    """Per rank, the ordered micro-batches of one step."""

    world_size: int
    capacity: int
    planner: str
    lengths: tuple[int, ...]
    ranks: list[list[MicroBatch]]
    options: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ checks
    def validate(self) -> Plan:
        """Check the plan's four promises; raise :class:`PlanValidationError` naming the fault.

        1. every real token of every sequence is assigned exactly once (local micro-batches hold
           whole sequences, ring members hold exactly their zigzag share);
        2. every micro-batch fits the capacity: its slots (padding included), times the offload
           resident fraction when it offloads, are at most ``capacity``;
        3. every ring item appears on all of its members, once each, with the same ring, the same
           sequences in the same order and the same offload ratio, and nowhere else;
        4. every rank runs its ring items in strictly increasing ``item`` order, so sorting items
           by id is a global order consistent with every rank (no P2P deadlock);
        5. every micro-batch has a known ``mode``, ``"ring"`` when it is local; the members of an
           item agree on it; a ``"ulysses"`` item's size, and a ``"hybrid"`` item's members per
           node, divide the query heads of the plan's cost model (when it names them); a hybrid
           item spans two nodes or more (``ranks_per_node`` in the options) with the same number
           (>= 2) of members on each, consecutive in ring order.

        Returns the plan, so ``plan = make_plan(...).validate()`` reads naturally.
        """
        world, cap, lengths = self.world_size, self.capacity, self.lengths
        if len(self.ranks) != world:
            raise PlanValidationError(f"plan lists {len(self.ranks)} ranks but world_size is {world}")
        for i, s in enumerate(lengths):
            if not isinstance(s, int) or s < 1:
                raise PlanValidationError(f"sequence {i} has invalid length {s!r}")
        off_opt = self.options.get("offload")
        offload = OffloadConfig.from_json_dict(off_opt) if off_opt else None
        covered: list[list[tuple[int, int]]] = [[] for _ in lengths]
        items: dict[int, tuple[tuple[int, ...], tuple[int, ...], float, set[int], str]] = {}
        nseq = len(lengths)
        share_cache: dict[tuple[int, int], list[tuple[tuple[int, int], ...]]] = {}
        for r, mbs in enumerate(self.ranks):
            last = -1
            for m, mb in enumerate(mbs):
                where = f"rank {r} micro-batch {m}"
                if not mb.pieces:
                    raise PlanValidationError(f"{where} has no pieces")
                if not 0.0 <= mb.offload_ratio <= 1.0:
                    raise PlanValidationError(f"{where} has offload ratio {mb.offload_ratio} outside [0, 1]")
                if mb.mode not in MODES:
                    raise PlanValidationError(
                        f"{where} has attention mode {mb.mode!r}; the modes are {', '.join(MODES)}"
                    )
                if mb.offload_ratio > 0 and offload is None:
                    raise PlanValidationError(
                        f"{where} offloads (ratio {mb.offload_ratio}) but the plan has no offload options"
                    )
                seqs = tuple(p.seq for p in mb.pieces)
                if len(set(seqs)) != len(seqs):
                    raise PlanValidationError(f"{where} lists a sequence twice: {seqs}")
                for q in seqs:
                    if not 0 <= q < nseq:
                        raise PlanValidationError(f"{where} names sequence {q}, outside the batch of {nseq}")
                if mb.ring is None:
                    if mb.item is not None:
                        raise PlanValidationError(f"{where} is local but carries ring item id {mb.item}")
                    if mb.mode != RING:
                        raise PlanValidationError(
                            f"{where} is local but has attention mode {mb.mode!r}; a local micro-batch's is 'ring'"
                        )
                    slots = 0
                    for p in mb.pieces:
                        s = lengths[p.seq]
                        if tuple(tuple(x) for x in p.ranges) != ((0, s),):
                            raise PlanValidationError(
                                f"{where}: local piece of sequence {p.seq} must be the whole sequence "
                                f"[(0, {s})], got {list(p.ranges)}"
                            )
                        covered[p.seq].append((0, s))
                        slots += s
                else:
                    ring = tuple(mb.ring)
                    n = len(ring)
                    if n < 2:
                        raise PlanValidationError(f"{where}: a single-rank ring must be a local micro-batch")
                    if len(set(ring)) != n or any(not 0 <= x < world for x in ring):
                        raise PlanValidationError(f"{where}: ring {ring} has repeated or out-of-range ranks")
                    if r not in ring:
                        raise PlanValidationError(f"{where}: rank {r} is not in its ring {ring}")
                    if not isinstance(mb.item, int) or mb.item < 0:
                        raise PlanValidationError(
                            f"{where}: ring micro-batch needs an item id >= 0, got {mb.item}"
                        )
                    if mb.item <= last:
                        raise PlanValidationError(
                            f"{where}: ring item {mb.item} follows item {last}; members must run shared "
                            "items in increasing item order"
                        )
                    last = mb.item
                    member = ring.index(r)
                    slots = 0
                    for p in mb.pieces:
                        s = lengths[p.seq]
                        shares = share_cache.get((s, n))
                        if shares is None:
                            shares = share_cache[(s, n)] = all_member_ranges(s, n)
                        want = shares[member]
                        if p.ranges != want and [tuple(x) for x in p.ranges] != list(want):
                            got = [tuple(x) for x in p.ranges]
                            raise PlanValidationError(
                                f"{where}: sequence {p.seq} (length {s}) should hold zigzag share {want} of "
                                f"member {member}/{n}, got {got}"
                            )
                        covered[p.seq].extend(want)
                        slots += 2 * (-(-s // (2 * n)))
                    seen = items.get(mb.item)
                    if seen is None:
                        items[mb.item] = (ring, seqs, mb.offload_ratio, {r}, mb.mode)
                        if mb.mode != RING:
                            self._check_mode(mb.item, ring, mb.mode)
                    else:
                        if (
                            seen[0] != ring
                            or seen[1] != seqs
                            or seen[2] != mb.offload_ratio
                            or seen[4] != mb.mode
                        ):
                            raise PlanValidationError(
                                f"{where}: ring item {mb.item} differs between members (ring {seen[0]} vs "
                                f"{ring}, sequences {seen[1]} vs {seqs}, offload {seen[2]} vs {mb.offload_ratio}, "
                                f"mode {seen[4]} vs {mb.mode})"
                            )
                        if r in seen[3]:
                            raise PlanValidationError(
                                f"{where}: ring item {mb.item} appears twice on rank {r}"
                            )
                        seen[3].add(r)
                resident = resident_tokens(slots, mb.offload_ratio, offload)
                if resident > cap * (1 + 1e-12):
                    raise PlanValidationError(
                        f"{where} holds {slots} slots ({resident:.1f} resident at offload "
                        f"{mb.offload_ratio}) above the capacity {cap}"
                    )
        for item, (ring, _, _, members, _) in items.items():
            if members != set(ring):
                missing = sorted(set(ring) - members)
                raise PlanValidationError(
                    f"ring item {item} on ring {ring} is missing from member rank(s) {missing}"
                )
        for q, ranges in enumerate(covered):
            s = lengths[q]
            ranges.sort()
            pos = 0
            for a, b in ranges:
                if a != pos:
                    what = "assigned twice" if a < pos else "never assigned"
                    lo, hi = (a, pos) if a < pos else (pos, a)
                    raise PlanValidationError(f"sequence {q} (length {s}): tokens [{lo}, {hi}) {what}")
                pos = b
            if pos != s:
                raise PlanValidationError(f"sequence {q} (length {s}): tokens [{pos}, {s}) never assigned")
        return self

    def _check_mode(self, item: int, ring: tuple[int, ...], mode: str) -> None:
        """Promise 5 for a ring item that is not a ring: the heads and nodes allow its mode."""
        cm = self.options.get("cost_model") or {}
        heads = cm.get("attention_heads")
        where = f"ring item {item} on ring {ring}"
        if mode == ULYSSES:
            if heads is not None and heads % len(ring):
                raise PlanValidationError(
                    f"{where} runs Ulysses over {len(ring)} members, which do not divide the {heads} query heads "
                    "of the plan's cost model"
                )
            return
        rpn = self.options.get("ranks_per_node")
        layout = group_layout(ring, rpn) if rpn else None
        if layout is None or layout.per_node is None:
            raise PlanValidationError(
                f"{where} runs hybrid attention but its members do not form whole node groups (nodes of "
                f"{rpn} ranks): it needs two nodes or more with the same number (>= 2) of members on each, "
                "consecutive in ring order"
            )
        if heads is not None and heads % layout.per_node:
            raise PlanValidationError(
                f"{where} runs hybrid attention with {layout.per_node} members a node, which do not divide the "
                f"{heads} query heads of the plan's cost model"
            )

    # ------------------------------------------------------------------ identity
    def digest(self) -> str:
        """Stable sha256 (hex) of the plan's canonical text form: same plan, same digest, any process.

        The text is the JSON of ``world_size, capacity, planner, lengths, options`` (sorted keys,
        compact), then one line per micro-batch, rank by rank:
        ``rank|ring|item|offload_ratio|est_time|exposed_time|seq:a-b,c-d;seq:...`` with floats in
        ``repr`` form (exact, as JSON writes them) and ``-`` for a missing ring or item; a
        micro-batch whose mode is not ``"ring"`` ends in ``|mode`` (so a ring-only plan's text is
        what it was before modes existed).
        """
        h = hashlib.sha256()
        head = {
            "world_size": self.world_size,
            "capacity": self.capacity,
            "planner": self.planner,
            "lengths": [int(x) for x in self.lengths],
            "options": self.options,
        }
        h.update(json.dumps(head, sort_keys=True, separators=(",", ":"), default=_json_default).encode())
        for r, mbs in enumerate(self.ranks):
            lines = []
            for mb in mbs:
                ring = "-" if mb.ring is None else ",".join(str(int(x)) for x in mb.ring)
                item = "-" if mb.item is None else str(int(mb.item))
                pieces = ";".join(
                    f"{int(p.seq)}:" + ",".join(f"{int(a)}-{int(b)}" for a, b in p.ranges) for p in mb.pieces
                )
                lines.append(
                    f"\n{r}|{ring}|{item}|{float(mb.offload_ratio)!r}|{float(mb.est_time)!r}|"
                    f"{float(mb.exposed_time)!r}|{pieces}" + ("" if mb.mode == RING else f"|{mb.mode}")
                )
            h.update("".join(lines).encode())
        return h.hexdigest()

    # ------------------------------------------------------------------ statistics
    def rank_times(self) -> list[float]:
        """Estimated busy seconds per rank (a 1F1B pipeline when ``pipeline_degree`` > 1)."""
        p = int(self.options.get("pipeline_degree", 1) or 1)
        out = []
        for mbs in self.ranks:
            ts = [mb.est_time for mb in mbs]
            if p <= 1 or not ts:
                out.append(float(sum(ts)))
            else:
                out.append(sum(ts) / p + (p - 1) * max(ts) / p)
        return out

    def finish_times(self) -> list[float]:
        """Per-rank finish time when every ring item starts only once all its members are ready."""
        return self.schedule()[0]

    def schedule(self) -> tuple[list[float], dict[int, dict[int, float]]]:
        """:meth:`finish_times`, and when each member arrives at each ring item.

        Returns ``(finish, arrivals)``: ``arrivals[item][rank]`` is the estimated time rank
        ``rank`` is ready to start ring item ``item`` (its earlier micro-batches done); the item
        starts at the latest of its members' arrivals.
        """
        clock = [0.0] * self.world_size
        pos = [0] * self.world_size
        ring_mbs: dict[int, list[tuple[int, MicroBatch]]] = {}
        for r, mbs in enumerate(self.ranks):
            for mb in mbs:
                if mb.ring is not None:
                    ring_mbs.setdefault(mb.item, []).append((r, mb))

        def run_locals(r: int) -> None:
            mbs = self.ranks[r]
            while pos[r] < len(mbs) and mbs[pos[r]].ring is None:
                clock[r] += mbs[pos[r]].est_time
                pos[r] += 1

        arrivals: dict[int, dict[int, float]] = {}
        for item in sorted(ring_mbs):
            members = ring_mbs[item]
            for r, _ in members:
                run_locals(r)
                if self.ranks[r][pos[r]].item != item:
                    raise PlanValidationError(
                        f"rank {r} does not run ring item {item} in increasing item order"
                    )
            arrivals[item] = {r: clock[r] for r, _ in members}
            start = max(arrivals[item].values())
            for r, mb in members:
                clock[r] = start + mb.est_time
                pos[r] += 1
        for r in range(self.world_size):
            run_locals(r)
        return clock, arrivals

    def cp_degrees(self) -> list[int]:
        """The ring size each sequence runs on, by sequence id (1: packed locally on one rank)."""
        degree = [1] * len(self.lengths)
        for micro_batches in self.ranks:
            for mb in micro_batches:
                if mb.ring is not None:
                    for piece in mb.pieces:
                        degree[piece.seq] = max(degree[piece.seq], len(mb.ring))
        return degree

    def mode_stats(self) -> dict[str, dict[str, float]]:
        """Ring items and the bytes their attention sends in one step, per attention mode.

        ``{"mode_counts": {mode: items}, "comm_bytes": {mode: bytes}}`` with every mode of
        :data:`~.modes.MODES` as a key (0 where none runs): bytes summed over members and layers
        from the plan's cost model (none in the options: 0; a Ulysses or hybrid item needs its
        heads).  A step's telemetry (``comm/mode_counts``, bytes per mode) is this dict.
        """
        counts = {m: 0 for m in MODES}
        sent = {m: 0.0 for m in MODES}
        cm_dict = self.options.get("cost_model") or {}
        kvb = float(cm_dict.get("kv_bytes_per_token_per_layer", 0.0) or 0.0)
        layers = int(cm_dict.get("num_layers", 1) or 1)
        passes = float(cm_dict.get("comm_passes", 3.0))
        cost: CostModel | None = None
        rpn = self.options.get("ranks_per_node")
        seen: set[int] = set()
        for mbs in self.ranks:
            for mb in mbs:
                if mb.ring is None or mb.item in seen:
                    continue
                seen.add(mb.item)
                counts[mb.mode] += 1
                n = len(mb.ring)
                if mb.mode == RING:
                    slots = sum(2 * (-(-self.lengths[p.seq] // (2 * n))) for p in mb.pieces)
                    sent[RING] += passes * layers * n * (n - 1) * slots * kvb
                    continue
                if cost is None:
                    if not cm_dict.get("attention_heads"):
                        continue
                    cost = CostModel.from_json_dict(cm_dict)
                lengths = [self.lengths[p.seq] for p in mb.pieces]
                sent[mb.mode] += mode_bytes(cost, mb.mode, lengths, group_layout(mb.ring, rpn))
        return {"mode_counts": counts, "comm_bytes": sent}

    def stats(self) -> dict:
        """Summary numbers (all JSON-ready).

        ``rank_time`` (busy seconds) per rank and its max/mean (``max_over_mean``, the imbalance);
        ``makespan``, the last finish with ring members waiting for each other;
        ``bubble_fraction = 1 - mean/makespan`` (idle share, ring waits included);
        ``ring_bytes``, the bytes the ring items' attention sends per step, every mode together
        (cost model in the options), and per mode :meth:`mode_stats`; ``exposed_ring_time``
        (communication not hidden, every mode) summed over ranks and its per-rank max;
        ``cp_degree_histogram`` (ring size -> number of sequences); micro-batch counts; offload use.
        """
        times = self.rank_times()
        mx = max(times) if times else 0.0
        mean = sum(times) / len(times) if times else 0.0
        counts = [len(m) for m in self.ranks]
        hist: dict[int, int] = {}
        exposed = [0.0] * self.world_size
        offloaded: set[int] = set()
        seen_items: set[int] = set()
        local_seqs: set[int] = set()
        for r, mbs in enumerate(self.ranks):
            for mb in mbs:
                exposed[r] += mb.exposed_time
                if mb.offload_ratio > 0:
                    offloaded.update(p.seq for p in mb.pieces)
                if mb.ring is None:
                    local_seqs.update(p.seq for p in mb.pieces)
                    continue
                if mb.item in seen_items:
                    continue
                seen_items.add(mb.item)
                n = len(mb.ring)
                hist[n] = hist.get(n, 0) + len(mb.pieces)
        if local_seqs:
            hist[1] = hist.get(1, 0) + len(local_seqs)
        finish = self.finish_times() if int(self.options.get("pipeline_degree", 1) or 1) <= 1 else times
        makespan = max(finish) if finish else 0.0
        by_mode = self.mode_stats()
        return {
            "rank_time": times,
            "max_time": mx,
            "mean_time": mean,
            "max_over_mean": (mx / mean) if mean > 0 else 1.0,
            "bubble_fraction": (1.0 - mean / makespan) if makespan > 0 else 0.0,
            "makespan": makespan,
            "ring_bytes": sum(by_mode["comm_bytes"].values()),
            "exposed_ring_time": sum(exposed),
            "max_rank_exposed_ring_time": max(exposed) if exposed else 0.0,
            "cp_degree_histogram": {str(k): hist[k] for k in sorted(hist)},
            "mode_counts": by_mode["mode_counts"],
            "comm_bytes_by_mode": by_mode["comm_bytes"],
            "micro_batches": sum(counts),
            "micro_batch_counts": counts,
            "min_micro_batches": min(counts) if counts else 0,
            "max_micro_batches": max(counts) if counts else 0,
            "ring_items": len(seen_items),
            "offloaded_sequences": len(offloaded),
            "num_sequences": len(self.lengths),
            "num_tokens": sum(self.lengths),
        }

    # ------------------------------------------------------------------ files
    def to_json_dict(self, *, with_stats: bool = True) -> dict:
        """The documented plan schema (docs/planner.md)."""
        out = {
            "world_size": self.world_size,
            "capacity": self.capacity,
            "planner": self.planner,
            "digest": self.digest(),
            "lengths": list(self.lengths),
            "options": self.options,
            "ranks": [
                {"rank": r, "micro_batches": [_mb_to_dict(mb) for mb in mbs]}
                for r, mbs in enumerate(self.ranks)
            ],
        }
        if with_stats:
            out["stats"] = self.stats()
        return out

    @classmethod
    def from_json_dict(cls, data: dict, *, check_digest: bool = True) -> Plan:
        """Rebuild a plan written by :meth:`to_json_dict`; the digest must match when present."""
        try:
            ranks_in = sorted(data["ranks"], key=lambda e: e["rank"])
            if [e["rank"] for e in ranks_in] != list(range(len(ranks_in))):
                raise PlanError("plan file ranks must be numbered 0..world_size-1 without gaps")
            ranks = [[_mb_from_dict(m) for m in e["micro_batches"]] for e in ranks_in]
            plan = cls(
                world_size=int(data["world_size"]),
                capacity=int(data["capacity"]),
                planner=str(data["planner"]),
                lengths=tuple(int(x) for x in data["lengths"]),
                ranks=ranks,
                options=dict(data.get("options") or {}),
            )
        except (KeyError, TypeError) as err:
            raise PlanError(
                f"malformed plan dict ({err!r}); expected the schema of Plan.to_json_dict"
            ) from err
        if check_digest and "digest" in data and data["digest"] != plan.digest():
            raise PlanError(
                f"plan digest {data['digest']} does not match its contents ({plan.digest()}); the file was "
                "edited or written by another version"
            )
        return plan


def _json_default(obj):
    """NumPy scalars and other number-likes in options serialise as plain numbers."""
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"plan options must be JSON-serialisable, got {type(obj).__name__}")


def _mb_to_dict(mb: MicroBatch) -> dict:
    return {
        "ring": None if mb.ring is None else list(mb.ring),
        "item": mb.item,
        "offload_ratio": float(mb.offload_ratio),
        "est_time": float(mb.est_time),
        "exposed_time": float(mb.exposed_time),
        "mode": mb.mode,
        "pieces": [{"seq": p.seq, "ranges": [list(x) for x in p.ranges]} for p in mb.pieces],
    }


def _mb_from_dict(d: dict) -> MicroBatch:
    ring = d.get("ring")
    return MicroBatch(
        pieces=[Piece(int(p["seq"]), tuple((int(a), int(b)) for a, b in p["ranges"])) for p in d["pieces"]],
        ring=None if ring is None else tuple(int(x) for x in ring),
        item=None if d.get("item") is None else int(d["item"]),
        offload_ratio=float(d.get("offload_ratio", 0.0)),
        est_time=float(d.get("est_time", 0.0)),
        exposed_time=float(d.get("exposed_time", 0.0)),
        mode=str(d.get("mode", RING)),
    )


def plans_equal(a: Plan, b: Plan) -> bool:
    """Same contents (ignores object identity)."""
    return a.digest() == b.digest()


__all__: Sequence[str] = ("MicroBatch", "Piece", "Plan", "PlanError", "PlanValidationError", "plans_equal")
