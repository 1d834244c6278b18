"""``strategy.step_stats``: one step's measured values and the plan's facts, one name for each fact.

Every rank holds the whole plan of a step (``StepBatch.stats``: ``Plan.stats()`` plus each
sequence's length and ring size, which ``build_step`` adds), so the plan's facts need no
collective; the measured values (busy time, ring traffic, micro-batches per rank, the loss) come
from the step's one all-reduce.  :data:`PLAN_FACTS` maps the plan's names to the ones
``step_stats`` and the telemetry use.  No Lightning here, so the step loop and the telemetry
callback can both import it.
"""

from __future__ import annotations

from typing import Any

#: One name for each fact of the plan: its name in ``StepBatch.stats`` (``Plan.stats()`` plus the
#: per-sequence lengths and ring sizes ``build_step`` adds) -> its name in ``strategy.step_stats``.
PLAN_FACTS: dict[str, str] = {
    "rank_time": "planned_s",
    "max_over_mean": "max_over_mean_planned",
    "exposed_ring_time": "exposed_ring_planned_s",
    "plan_ms": "plan_ms",
    "lengths": "lengths",
    "cp_degrees": "cp_degrees",
    "num_sequences": "num_sequences",
    # under pipelines (``build_pipeline_step``): micro-batches and simulated bubble per pipeline
    "pipeline_micro_batches": "pipeline_micro_batches",
    "pipeline_bubble_sim": "pipeline_bubble_sim",
    # ring items and the bytes their attention sends, per attention mode (``Plan.mode_stats()``)
    "mode_counts": "mode_counts",
    "comm_bytes_by_mode": "comm_bytes_by_mode",
}


def plan_facts(plan_stats: dict[str, Any] | None) -> dict[str, Any]:
    """The plan's facts under their ``step_stats`` names (every rank holds the whole plan)."""
    plan = plan_stats or {}
    out: dict[str, Any] = {}
    for source, name in PLAN_FACTS.items():
        value = plan.get(name, plan.get(source))
        if value is not None:
            out[name] = list(value) if isinstance(value, (list, tuple)) else value
    if "num_sequences" not in out and "lengths" in out:
        out["num_sequences"] = len(out["lengths"])
    return out


def step_stats(batch: Any, result: Any) -> dict[str, Any]:
    """``strategy.step_stats`` of one step: what was measured (the step's all-reduce) and what was planned.

    ``batch`` is the rank's ``StepBatch`` (its ``stats`` come from the plan, the same on every
    rank), ``result`` the step's ``StepResult``.  ``step_time_s`` is filled in after the
    optimizer step.
    """
    planned = plan_facts(batch.stats if isinstance(batch.stats, dict) else None)
    busy = [r.busy_s for r in result.reports]
    mean_busy = sum(busy) / len(busy) if busy else 0.0
    max_busy = max(busy) if busy else 0.0
    return {
        "step": int(batch.step),
        "loss": result.loss,
        "tokens": int(batch.num_tokens),
        "loss_tokens": int(batch.num_global_tokens),
        "step_time_s": 0.0,
        "busy_s": busy,
        "num_micro_batches": [r.num_micro_batches for r in result.reports],
        "max_over_mean_measured": max_busy / mean_busy if mean_busy > 0 else float("nan"),
        "bubble_fraction": 1.0 - mean_busy / max_busy if max_busy > 0 else 0.0,
        "ring_bytes": sum(r.ring_bytes for r in result.reports),
        "ring_bytes_per_rank": [r.ring_bytes for r in result.reports],
        "ring_wait_s": [r.ring_wait_s for r in result.reports],
        "allreduce_s": result.allreduce_s,
        "planned_s": _floats(planned.pop("planned_s", None)),
        "max_over_mean_planned": float(planned.pop("max_over_mean_planned", float("nan"))),
        "exposed_ring_planned_s": float(planned.pop("exposed_ring_planned_s", float("nan"))),
        "plan_ms": float(planned.pop("plan_ms", float("nan"))),
        **planned,
    }


def _floats(values: Any) -> list[float]:
    if values is None:
        return []
    return [float(v) for v in values]


__all__ = ["PLAN_FACTS", "plan_facts", "step_stats"]
