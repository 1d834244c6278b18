"""The simulator's pipeline bubble for plans a pipeline run executed, next to the measured bubble.

A run with pipelines (``pipeline_degree`` P > 1) orders each pipeline's micro-batches by the
index rule (:func:`~lightning_bytescale.planner.pipeline_order.order_pipelines`, padding
micro-batches where a ring item leaves a gap, and every pipeline padded to P micro-batches when
the plan has a ring item, as the torch executor's ``build_pipeline_step`` does) and runs them in
a 1F1B schedule.  This module times that executed order with the planner's cost model and the
simulator's 1F1B makespan (:func:`~lightning_bytescale.planner.pipeline.one_f_one_b`), so a
measured run can be set beside the prediction for the very plans it ran: ``bytescale-sim
--measured <file>`` reads a benchmark's JSON (``benchmarks/pipeline_balance.py`` writes one,
schema in :func:`compare_measured`) and prints both per variant and pipeline.

The *pipeline bubble* of a pipeline is ``1 - busy / makespan``: ``busy`` is one stage's share of
the pipeline's work (the simulator splits every micro-batch evenly over the stages) and
``makespan`` the pipeline's own 1F1B time.  The *step bubble* divides by the step's makespan
(the slowest pipeline) instead, so it also holds the wait for slower pipelines.

``pad_to_capacity=True`` costs every micro-batch as the executor computes it: padded to ``C``
slots (the padding one causal sequence of its own), where the simulator proper costs only the
tokens a micro-batch holds.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.modes import group_layout, mode_time
from lightning_bytescale.planner.pipeline import one_f_one_b
from lightning_bytescale.planner.pipeline_order import order_pipelines
from lightning_bytescale.planner.plan import MicroBatch, Plan
from lightning_bytescale.sim.timeline import SimulationError


@dataclass(frozen=True)
class PipelineBubble:
    """One pipeline's simulated step: seconds are whole-model cost-model seconds split over the stages."""

    pipeline: int
    micro_batches: int  # padding micro-batches included
    padding: int
    busy_s: float  # one stage's share of the work
    makespan_s: float  # the pipeline's 1F1B time
    bubble: float  # 1 - busy / makespan
    step_bubble: float  # 1 - busy / the slowest pipeline's makespan


def micro_batch_seconds(
    plan: Plan, mb: MicroBatch | None, cost_model: CostModel, *, pad_to_capacity: bool = False
) -> float:
    """Whole-model seconds of one micro-batch of ``plan`` (``None``: a padding micro-batch of C slots)."""
    capacity = int(plan.capacity)
    if mb is None:
        return cost_model.local_time([capacity])
    lengths = [plan.lengths[p.seq] for p in mb.pieces]
    n = 1 if mb.ring is None else len(mb.ring)
    if mb.mode == "ring":
        seconds, _ = cost_model.ring_member_time(lengths, n, comm_aware=True)
    else:
        seconds, _ = mode_time(
            cost_model, mb.mode, lengths, group_layout(mb.ring, plan.options.get("ranks_per_node"))
        )
    if not pad_to_capacity:
        return seconds
    slots = mb.num_tokens
    pad = max(0, capacity - slots)
    # the padding's own causal sequence and its linear work, once per layer
    return seconds + cost_model.num_layers * (cost_model.a * pad * pad + cost_model.b * pad)


def pipeline_bubbles(
    plan: Plan,
    cost_model: CostModel,
    *,
    stages: int | None = None,
    min_micro_batches: int | None = None,
    pad_to_capacity: bool = False,
) -> list[PipelineBubble]:
    """Every pipeline's simulated bubble for ``plan`` in the order the executor runs it.

    ``stages`` defaults to the plan's ``pipeline_degree``; ``min_micro_batches`` to the
    executor's rule (``stages`` when the plan has a ring item, else none).
    """
    p = int(stages if stages is not None else (plan.options.get("pipeline_degree", 1) or 1))
    if p < 2:
        raise SimulationError(
            f"pipeline bubbles need a pipeline degree of at least 2, got {p}; plan with "
            "pipeline_degree=P or pass stages=P"
        )
    if min_micro_batches is None:
        has_ring = any(mb.ring is not None for mbs in plan.ranks for mb in mbs)
        min_micro_batches = p if has_ring else 0
    order = order_pipelines(plan, stages=p, min_micro_batches=min_micro_batches)
    rows = []
    for r, slots in enumerate(order.slots):
        durations = [
            micro_batch_seconds(plan, mb, cost_model, pad_to_capacity=pad_to_capacity) for mb in slots
        ]
        rows.append((r, len(slots), order.pads[r], sum(durations) / p, one_f_one_b(durations, p)))
    step = max((row[4] for row in rows), default=0.0)
    return [
        PipelineBubble(
            pipeline=r,
            micro_batches=m,
            padding=pads,
            busy_s=busy,
            makespan_s=makespan,
            bubble=1.0 - busy / makespan if makespan > 0 else 0.0,
            step_bubble=1.0 - busy / step if step > 0 else 0.0,
        )
        for r, m, pads, busy, makespan in rows
    ]


def _need(data: dict, key: str, where: str) -> object:
    if not isinstance(data, dict) or key not in data:
        raise SimulationError(
            f"measured-run file: {where} has no {key!r}; write it with benchmarks/pipeline_balance.py "
            "(schema: lightning_bytescale.sim.pipeline_bubble.compare_measured)"
        )
    return data[key]


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def compare_measured(data: dict) -> list[dict]:
    """Per variant and pipeline: the measured bubble (median, min, max) next to the simulator's.

    ``data`` is a measured run: ``{"cost_model": CostModel.to_json_dict(), "variants": {name:
    {"steps": [{"plan": Plan.to_json_dict(), "measured": [{"bubble": [per pipeline], ...}, ...]}]}}}``
    (one ``measured`` entry per repetition of the step; ``min_micro_batches`` in a step
    overrides the executor's rule).  The simulated bubbles are recomputed here from the plans
    and the cost model; the simulated figure of a pipeline is its mean over the steps.
    """
    cost = CostModel.from_json_dict(_need(data, "cost_model", "the file"))
    variants = _need(data, "variants", "the file")
    rows = []
    for name, variant in variants.items():
        steps = _need(variant, "steps", f"variant {name!r}")
        measured: dict[int, list[float]] = {}
        simulated: dict[int, list[float]] = {}
        padded: dict[int, list[float]] = {}
        counts: dict[int, list[int]] = {}
        for k, step in enumerate(steps):
            plan = Plan.from_json_dict(_need(step, "plan", f"variant {name!r} step {k}"))
            extra = {"min_micro_batches": step["min_micro_batches"]} if "min_micro_batches" in step else {}
            for b in pipeline_bubbles(plan, cost, **extra):
                simulated.setdefault(b.pipeline, []).append(b.bubble)
                counts.setdefault(b.pipeline, []).append(b.micro_batches)
            for b in pipeline_bubbles(plan, cost, pad_to_capacity=True, **extra):
                padded.setdefault(b.pipeline, []).append(b.bubble)
            for rep in _need(step, "measured", f"variant {name!r} step {k}"):
                bubbles = _need(rep, "bubble", f"variant {name!r} step {k}'s measured entry")
                if len(bubbles) != plan.world_size:
                    raise SimulationError(
                        f"variant {name!r} step {k}: {len(bubbles)} measured bubbles for a plan of "
                        f"{plan.world_size} pipelines; record one per pipeline"
                    )
                for r, x in enumerate(bubbles):
                    measured.setdefault(r, []).append(float(x))
        for r in sorted(simulated):
            rows.append(
                {
                    "variant": name,
                    "pipeline": r,
                    "micro_batches": statistics.fmean(counts[r]),
                    "measured": _spread(measured[r]) if r in measured else None,
                    "simulated": statistics.fmean(simulated[r]),
                    "simulated_padded": statistics.fmean(padded[r]),
                }
            )
    return rows


__all__ = ["PipelineBubble", "compare_measured", "micro_batch_seconds", "pipeline_bubbles"]
