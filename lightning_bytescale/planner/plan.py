"""The `Plan`: what every rank runs in one step, and the checks that make it safe to run.

A plan lists, for every rank, an ordered list of micro-batches.  A micro-batch is either
*local* (``ring is None``: whole sequences packed on this rank) or one member's share of a
*ring item* (``ring`` is the ordered tuple of global ranks that share it; every member holds
its zigzag share of the same sequences, see :mod:`.zigzag`).  Ring items carry an ``item`` id
that is unique in the plan; members run their shared items in increasing ``item`` order, so a
global order of items exists and point-to-point rings cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
