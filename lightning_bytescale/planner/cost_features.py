"""What a micro-batch asks of the cost model, read from the plan: the features a refit fits on.

Every rank holds the whole plan of a step, so every rank can describe every rank's
micro-batches by the quantities the cost model charges (:class:`Work`, per layer):

* ``area``: what ``a`` multiplies: ``sum s^2`` of a local micro-batch, ``sum s^2 / n`` of a
  member of a group of ``n`` (its share of the causal-mask area);
* ``tokens``: what ``b`` multiplies: the tokens of a local micro-batch, a member's slots
  (``2 ceil(s / 2n)`` per sequence, padding included); ``g`` is paid once per micro-batch;
* ``transfer_bytes``: the bytes a ring member's link carries per layer (``passes (n-1) slots
  kv_bytes``; in a hybrid item the ring across nodes), hidden behind the attention as far as it
  can be, on the intra-node link or not (``transfer_intra``);
* ``exchange_bytes``: the bytes of a Ulysses (or a hybrid item's in-node) all-to-all per layer,
  exposed whole (``exchange_intra``);
* ``offload_ratio`` and the planned seconds (``est_time``) for the telemetry.

:func:`predict_seconds` prices a :class:`Work` with any :class:`CostModel` of the same shape
(layers, K/V bytes, heads) exactly as the planner does (``local_time``, ``ring_member_time``,
``ulysses_member_time``, ``hybrid_member_time``), so a model refitted on these features is the
model the planner would have needed.  :func:`relative_errors` is the per-step fit metric:
the median and worst relative error of planned against measured micro-batch seconds.

Pure Python: the features are JSON-ready (:meth:`Work.to_row`), so the loader can carry them
in a step's statistics and every rank computes the same ones.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.errors import CostRefitError
from lightning_bytescale.planner.modes import HYBRID, RING, ULYSSES, group_layout
from lightning_bytescale.planner.plan import MicroBatch, Plan

_ROW_FIELDS = (
    "area",
    "tokens",
    "size",
    "transfer_bytes",
    "transfer_intra",
    "exchange_bytes",
    "exchange_intra",
    "offload_ratio",
    "planned_s",
)


@dataclass(frozen=True)
class Work:
    """One micro-batch of one rank, as the cost model sees it (per layer; see the module docstring)."""

    area: float
    tokens: float
    size: int = 1  # members of its group (1: local work)
    transfer_bytes: float = 0.0
    transfer_intra: bool = False
    exchange_bytes: float = 0.0
    exchange_intra: bool = False
    offload_ratio: float = 0.0
    planned_s: float = 0.0  # the plan's est_time for it (the model it was planned with)

    def to_row(self) -> list[float]:
        """The fields as a flat list of numbers (``bool`` as 0/1), in :data:`_ROW_FIELDS` order."""
        return [float(getattr(self, f)) for f in _ROW_FIELDS]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> Work:
        if len(row) != len(_ROW_FIELDS):
            raise CostRefitError(
                f"a micro-batch's features are {len(_ROW_FIELDS)} numbers ({', '.join(_ROW_FIELDS)}), got {len(row)}"
            )
        values = dict(zip(_ROW_FIELDS, (float(v) for v in row)))
        return cls(
            area=values["area"],
            tokens=values["tokens"],
            size=int(values["size"]),
            transfer_bytes=values["transfer_bytes"],
            transfer_intra=bool(values["transfer_intra"]),
            exchange_bytes=values["exchange_bytes"],
            exchange_intra=bool(values["exchange_intra"]),
            offload_ratio=values["offload_ratio"],
            planned_s=values["planned_s"],
        )


def _unit_links(cost: CostModel) -> CostModel:
    """``cost`` with both links at 1 byte/s, so its communication seconds are bytes."""
    return cost.with_(bandwidth_intra=1.0, bandwidth_inter=1.0)


def micro_batch_work(
    plan: Plan, mb: MicroBatch, cost: CostModel | None = None, *, ranks_per_node: int | None = None
) -> Work:
    """The :class:`Work` of one micro-batch of ``plan`` (``cost``: the plan's own model by default)."""
    cost = cost if cost is not None else plan_cost_model(plan)
    rpn = ranks_per_node if ranks_per_node is not None else plan.options.get("ranks_per_node")
    lengths = [plan.lengths[p.seq] for p in mb.pieces]
    common = dict(offload_ratio=float(mb.offload_ratio), planned_s=float(mb.est_time))
    if mb.ring is None or len(mb.ring) == 1:
        return Work(area=float(sum(s * s for s in lengths)), tokens=float(sum(lengths)), **common)
    n = len(mb.ring)
    slots = sum(2 * (-(-s // (2 * n))) for s in lengths)
    area = float(sum(s * s for s in lengths)) / n
    layout = group_layout(mb.ring, rpn)
    unit = _unit_links(cost) if cost.kv_bytes_per_token_per_layer > 0 else None
    transfer = exchange = 0.0
    t_intra = e_intra = layout.intra
    if unit is not None and mb.mode == RING:
        transfer = unit.ring_parts(lengths, n, intra=layout.intra)[2]
    elif unit is not None and mb.mode == ULYSSES:
        exchange = unit.ulysses_parts(lengths, n, intra=layout.intra)[2]
    elif unit is not None and mb.mode == HYBRID:
        if layout.per_node is None:
            raise CostRefitError(f"a hybrid micro-batch on ranks {list(mb.ring)} has no whole node groups")
        _, _, transfer, exchange = unit.hybrid_parts(lengths, n, layout.per_node)
        t_intra, e_intra = False, True
    return Work(
        area=area,
        tokens=float(slots),
        size=n,
        transfer_bytes=float(transfer),
        transfer_intra=t_intra,
        exchange_bytes=float(exchange),
        exchange_intra=e_intra,
        **common,
    )


def plan_cost_model(plan: Plan) -> CostModel:
    """The cost model ``plan`` was made with (its options carry it)."""
    data = plan.options.get("cost_model")
    if data is None:
        return CostModel.paper_preset()
    return data if isinstance(data, CostModel) else CostModel.from_json_dict(dict(data))


def plan_work(plan: Plan, cost: CostModel | None = None) -> list[list[Work]]:
    """Every rank's micro-batches as :class:`Work`, in plan order (``plan.ranks[r][i]``)."""
    cost = cost if cost is not None else plan_cost_model(plan)
    return [[micro_batch_work(plan, mb, cost) for mb in mbs] for mbs in plan.ranks]


def plan_work_rows(plan: Plan, cost: CostModel | None = None) -> list[list[list[float]]]:
    """:func:`plan_work` as JSON-ready rows (what a step's statistics carry)."""
    return [[w.to_row() for w in rank] for rank in plan_work(plan, cost)]


def predict_seconds(cost: CostModel, work: Work) -> float:
    """Whole-model seconds ``cost`` gives ``work``, as the planner's ``est_time`` (offload not charged)."""
    a, b, g = cost.a, cost.b, cost.g
    attention = a * work.area
    per_layer = a * work.area + b * work.tokens + g
    if work.size > 1:
        per_layer += max(0.0, comm_seconds(cost, work.transfer_bytes, work.transfer_intra) - attention)
        per_layer += comm_seconds(cost, work.exchange_bytes, work.exchange_intra)
    return cost.num_layers * per_layer


def comm_seconds(cost: CostModel, nbytes: float, intra: bool) -> float:
    """Seconds ``nbytes`` take on ``cost``'s link (0 when the model has no such link)."""
    if nbytes <= 0:
        return 0.0
    bw = cost.bandwidth(intra)
    return 0.0 if bw is None else nbytes / bw


@dataclass(frozen=True)
class ErrorSummary:
    """Relative error ``|planned - measured| / measured`` over a step's micro-batches."""

    median: float
    worst: float
    count: int

    def to_json_dict(self) -> dict:
        return {"median": self.median, "worst": self.worst, "count": self.count}


def relative_errors(planned: Iterable[float], measured: Iterable[float]) -> ErrorSummary:
    """Median and worst relative error of ``planned`` against ``measured`` seconds (pairs with a
    measured time <= 0 or not finite are left out; ``nan`` when none is left)."""
    errors = sorted(
        abs(p - m) / m
        for p, m in zip(planned, measured, strict=True)
        if math.isfinite(m) and m > 0 and math.isfinite(p)
    )
    if not errors:
        return ErrorSummary(math.nan, math.nan, 0)
    return ErrorSummary(_median_sorted(errors), errors[-1], len(errors))


def _median_sorted(values: Sequence[float]) -> float:
    n = len(values)
    mid = n // 2
    return values[mid] if n % 2 else (values[mid - 1] + values[mid]) / 2


__all__ = [
    "ErrorSummary",
    "Work",
    "comm_seconds",
    "micro_batch_work",
    "plan_cost_model",
    "plan_work",
    "plan_work_rows",
    "predict_seconds",
    "relative_errors",
]
