"""Attention modes of a ring item: which a group of ranks allows, what each costs, which is best.

A ring item (sequences sharded over ``n`` ranks, each member holding its zigzag share, see
:mod:`.zigzag`) runs its attention in one of three modes, recorded as ``MicroBatch.mode``:

* ``"ring"``: zigzag ring attention; K/V blocks travel around the ring, hidden behind
  attention as far as attention lasts (:meth:`.CostModel.ring_member_time`).
* ``"ulysses"`` (DeepSpeed-Ulysses): an all-to-all among the members gives each the whole
  sequence for ``attention_heads / n`` heads (K/V heads split while ``n`` divides them,
  otherwise the ones its query heads read), local causal attention runs, and a second
  all-to-all returns the output; nothing hides the exchange
  (:meth:`.CostModel.ulysses_member_time`).  Needs ``n`` to divide the lane's query heads.
* ``"hybrid"`` (USP, LoongTrain's 2D attention): Ulysses among the ``u`` members on each node,
  then ring attention across the ``n / u`` node groups (:meth:`.CostModel.hybrid_member_time`).
  Needs two nodes or more, the same ``u >= 2`` members on each, each node's members
  consecutive in ring order, and ``u`` dividing the query heads.  Members hold zigzag shares of
  the ``2n`` chunks in ring order, so the ``u`` members of node group ``j`` together hold chunks
  ``ju .. (j+1)u - 1`` and their mirror, two contiguous blocks of positions: the zigzag share of
  member ``j`` in a ring of ``n / u`` (its bounds those of the ``2n``-chunk split, which differ by
  a few tokens from a ``2n / u``-chunk split when ``2n`` does not divide the length: masks come
  from positions).  :func:`hybrid_groups` lists the groups.

The planner chooses per item the allowed mode with the least time under the cost model (ties
go to the ring, so a plan where nothing else is faster is the ring plan); ``modes`` restricts
the choice (:func:`parse_modes`).  ``Plan.mode_stats()`` counts a plan's items and bytes per mode.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.errors import PlanError

RING = "ring"
ULYSSES = "ulysses"
HYBRID = "hybrid"
#: Every attention mode, in the order ties are broken (the ring first).
MODES = (RING, ULYSSES, HYBRID)
RING_ONLY = (RING,)


def parse_modes(modes: str | Iterable[str] | None) -> tuple[str, ...]:
    """The ``modes`` option as a tuple in :data:`MODES` order.

    ``None``: every mode (the ones the heads and the members' nodes allow, per item).  A string
    is a comma-separated list (``"ring,ulysses"``).  The ring must be among them: it is the mode
    every group allows, whatever its size and nodes.
    """
    if modes is None:
        return MODES
    if isinstance(modes, str):
        names = [m.strip() for m in modes.split(",")]
    elif isinstance(modes, Iterable):
        names = list(modes)
    else:
        raise PlanError(
            f"modes must be None, a list of attention modes from {list(MODES)} or their comma-separated names, got {modes!r}"
        )
    unknown = [m for m in names if m not in MODES]
    if unknown or not names:
        raise PlanError(
            f"modes must name attention modes from {list(MODES)}, got {names!r}"
            + (f" ({unknown[0]!r} is not one)" if unknown else "")
        )
    if RING not in names:
        raise PlanError(
            f"modes {names!r} lacks 'ring', the mode every group of ranks allows (Ulysses needs the group size to "
            "divide the heads, hybrid a group over whole nodes); add 'ring'"
        )
    return tuple(m for m in MODES if m in names)


def check_modes(modes: str | Iterable[str] | None, cost: CostModel) -> tuple[str, ...]:
    """The ``modes`` option checked against the cost model: :func:`parse_modes`, and a mode
    other than the ring named explicitly needs the heads (``None`` quietly means the ring
    alone when the heads are unknown)."""
    allowed = parse_modes(modes)
    if modes is not None and allowed != RING_ONLY and cost.attention_heads is None:
        raise PlanError(
            f"modes {list(allowed)} need the cost model's attention_heads and kv_heads (the query and key/value "
            "heads of one tensor-parallel lane) to know where Ulysses splits them; give them to the CostModel (or "
            "its JSON file), or plan with modes=('ring',)"
        )
    return allowed


@dataclass(frozen=True)
class GroupLayout:
    """Where the members of a group sit: how many, all on one node, and hybrid's per-node degree."""

    size: int
    intra: bool
    """Every member on one node (the intra-node link)."""
    per_node: int | None = None
    """Members on each node when the group spans two nodes or more with the same number ``>= 2``
    on each, consecutive in ring order (hybrid's Ulysses degree); ``None`` otherwise."""


def group_layout(ring: Sequence[int], ranks_per_node: int | None) -> GroupLayout:
    """The layout of the members ``ring`` (in ring order) on nodes of ``ranks_per_node`` ranks."""
    n = len(ring)
    if ranks_per_node is None:
        return GroupLayout(n, False)
    nodes = [r // ranks_per_node for r in ring]
    runs: list[int] = []  # members per run of one node, in ring order
    for k, node in enumerate(nodes):
        if k and node == nodes[k - 1]:
            runs[-1] += 1
        else:
            runs.append(1)
    if len(runs) == 1:
        return GroupLayout(n, True)
    per_node = runs[0] if len(set(runs)) == 1 and len(set(nodes)) == len(runs) and runs[0] >= 2 else None
    return GroupLayout(n, False, per_node)


def likely_layout(size: int, ranks_per_node: int | None, cost: CostModel, intra: bool) -> GroupLayout:
    """The layout the planner assumes for a ring size before its members are chosen.

    Inside one node when ``intra``; otherwise, for a group larger than a node, whole groups of
    the largest ``u <= ranks_per_node`` that divides both the size and the query heads.
    """
    if intra or ranks_per_node is None or size <= ranks_per_node:
        return GroupLayout(size, intra)
    for u in range(min(ranks_per_node, size // 2), 1, -1):
        if size % u == 0 and cost.ulysses_allowed(u):
            return GroupLayout(size, False, u)
    return GroupLayout(size, False)


def allowed_modes(cost: CostModel, layout: GroupLayout, modes: Sequence[str] = MODES) -> tuple[str, ...]:
    """The modes of ``modes`` a group with this layout can run under this cost model's heads."""
    out = [RING] if RING in modes else []
    if ULYSSES in modes and cost.ulysses_allowed(layout.size):
        out.append(ULYSSES)
    if HYBRID in modes and layout.per_node is not None and cost.ulysses_allowed(layout.per_node):
        out.append(HYBRID)
    return tuple(out)


def mode_time(
    cost: CostModel, mode: str, lengths: Sequence[int], layout: GroupLayout, *, comm_aware: bool = True
) -> tuple[float, float]:
    """Whole-model ``(time, exposed)`` seconds of one member of an item in ``mode``."""
    n = layout.size
    if mode == RING:
        return cost.ring_member_time(lengths, n, intra=layout.intra, comm_aware=comm_aware)
    if mode == ULYSSES:
        return cost.ulysses_member_time(lengths, n, intra=layout.intra, comm_aware=comm_aware)
    if mode == HYBRID:
        if layout.per_node is None:
            raise PlanError(
                f"a hybrid item needs whole node groups; a group of {n} laid out as {layout} has none"
            )
        return cost.hybrid_member_time(lengths, n, layout.per_node, comm_aware=comm_aware)
    raise PlanError(f"unknown attention mode {mode!r}; modes are {list(MODES)}")


@dataclass(frozen=True)
class ModeChoice:
    """The mode an item runs in, and one member's seconds in it."""

    mode: str
    time: float
    """Whole-model seconds, communication included."""
    exposed: float
    """Communication seconds nothing hides (in ``time``)."""
    balance_time: float
    """``time``, or without the exposed communication for the compute-only ablation."""


def best_mode(
    cost: CostModel,
    lengths: Sequence[int],
    layout: GroupLayout,
    modes: Sequence[str] = MODES,
    *,
    comm_aware: bool = True,
) -> ModeChoice:
    """The allowed mode with the least time (communication included; ties: :data:`MODES` order)."""
    best: ModeChoice | None = None
    for mode in allowed_modes(cost, layout, modes):
        time, exposed = mode_time(cost, mode, lengths, layout)
        if best is None or time < best.time:
            best = ModeChoice(mode, time, exposed, time)
    if best is None:
        raise PlanError(f"no attention mode of {list(modes)} fits a group of {layout.size}")
    if not comm_aware:
        best = ModeChoice(best.mode, best.time, best.exposed, best.time - best.exposed)
    return best


def hybrid_groups(ring: Sequence[int], ranks_per_node: int | None) -> tuple[tuple[int, ...], ...]:
    """The Ulysses groups of a hybrid item, in ring order: the members on each node.

    Group ``j`` is member ``j`` of the ring across nodes; member ``i`` of the group holds the
    ``i``-th of its node's zigzag shares.  A layout that does not allow hybrid is an error.
    """
    layout = group_layout(ring, ranks_per_node)
    if layout.per_node is None:
        raise PlanError(
            f"ring {tuple(ring)} cannot run hybrid attention on nodes of {ranks_per_node} ranks: it needs two nodes "
            "or more with the same number (>= 2) of members on each, consecutive in ring order"
        )
    u = layout.per_node
    return tuple(tuple(ring[k : k + u]) for k in range(0, len(ring), u))


def mode_bytes(cost: CostModel, mode: str, lengths: Sequence[int], layout: GroupLayout) -> float:
    """Bytes one item sends in a training step in ``mode``, summed over members and layers."""
    n = layout.size
    if mode == RING:
        return cost.ring_bytes(lengths, n)
    if mode == ULYSSES:
        return cost.ulysses_bytes(lengths, n)
    if layout.per_node is None:
        raise PlanError(
            f"a hybrid item needs whole node groups; a group of {n} laid out as {layout} has none"
        )
    return sum(cost.hybrid_bytes(lengths, n, layout.per_node))


__all__ = [
    "HYBRID",
    "MODES",
    "RING",
    "RING_ONLY",
    "ULYSSES",
    "GroupLayout",
    "ModeChoice",
    "allowed_modes",
    "best_mode",
    "check_modes",
    "group_layout",
    "hybrid_groups",
    "likely_layout",
    "mode_bytes",
    "mode_time",
    "parse_modes",
]
