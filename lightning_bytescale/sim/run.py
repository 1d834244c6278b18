"""Run a scenario: draw global batches, plan them with every planner, simulate, summarise.

The planners are the real ones (``make_plan`` and the registry, peers included); the time
of each micro-batch comes from the planner's own communication-aware cost model
(:mod:`.costs`), the per-rank timelines from :mod:`.timeline`, and the gradient all-reduce
from the ring all-reduce formula.  ``step_time_s`` is the slowest rank's finish plus the
all-reduce.

The ``balance`` variants run ring attention only (``modes=("ring",)``), as before attention
modes existed; ``balance_modes`` and ``balance_no_offload_modes`` let ``balance`` choose each
item's mode (ring, Ulysses, or Ulysses inside nodes x ring across them) by the cost model.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from lightning_bytescale.planner import distributions
from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.plan import Plan
from lightning_bytescale.planner.planners import make_plan
from lightning_bytescale.sim import costs
from lightning_bytescale.sim.scenario import Scenario
from lightning_bytescale.sim.timeline import (
    RankTimeline,
    SimulationError,
    ring_allreduce_seconds,
    simulate_pipelines,
    simulate_ranks,
)

RING_ONLY = ("ring",)

# Simulator planner names -> (registered planner, make_plan keyword arguments).
VARIANTS: dict[str, tuple[str, dict]] = {
    "static": ("static", {}),
    "naive": ("naive", {"offload": False}),
    "naive_offload": ("naive", {"offload": True, "offload_policy": "pays"}),
    "naive_offload_min_ranks": ("naive", {"offload": True, "offload_policy": "paper_min_ranks"}),
    "balance": ("balance", {"offload": True, "modes": RING_ONLY}),
    "balance_modes": ("balance", {"offload": True}),
    "balance_no_offload": ("balance", {"offload": False, "modes": RING_ONLY}),
    "balance_no_offload_modes": ("balance", {"offload": False}),
    "balance_min_rings": ("balance", {"offload": False, "grow_rings": False, "modes": RING_ONLY}),
    "balance_compute_only": ("balance", {"offload": True, "comm_aware": False, "modes": RING_ONLY}),
    "megatron_dcp": ("megatron_dcp", {}),
    "verl_kk": ("verl_kk", {}),
    "lpt": ("lpt", {}),
}

SUMMARY_KEYS = (
    "step_time_s",
    "tokens_per_s",
    "max_over_mean",
    "bubble_fraction",
    "ring_bytes",
    "exposed_comm_s",
    "exposed_comm_by_mode",
    "mode_counts",
    "plan_ms",
    "speedup_vs_static",
)


@dataclass
class StepResult:
    """One planner on one global batch."""

    step_time_s: float
    compute_finish_s: float
    allreduce_s: float
    tokens: int
    max_over_mean: float
    bubble_fraction: float
    ring_bytes: float
    exposed_comm_s: float
    plan_ms: float
    busy: list[float] = field(default_factory=list)
    finish: list[float] = field(default_factory=list)
    micro_batches: list[int] = field(default_factory=list)
    exposed_comm_by_mode: dict[str, float] = field(default_factory=dict)
    """Exposed attention communication summed over ranks, per attention mode."""
    mode_counts: dict[str, int] = field(default_factory=dict)
    """Ring items per attention mode (``Plan.mode_stats``)."""


def simulate_plan(plan: Plan, scenario: Scenario, cost_model) -> StepResult:
    """Simulate one plan: per-rank timelines, then the gradient all-reduce."""
    cost = costs.CostFunction(plan, scenario, cost_model)
    if scenario.pipeline_degree > 1:
        tls = simulate_pipelines(plan, cost, scenario.pipeline_degree)
    else:
        tls = simulate_ranks(plan, cost)
    allreduce = allreduce_seconds(scenario)
    return summarise(plan, tls, allreduce)


def allreduce_seconds(scenario: Scenario) -> float:
    """Ring all-reduce of one rank's gradient shard over all HDP ranks (TP x PP split the bytes)."""
    shard = scenario.model.params_total / (scenario.tensor_parallel * scenario.pipeline_degree)
    bw = scenario.bandwidth_inter if scenario.ranks > scenario.ranks_per_node else scenario.bandwidth_intra
    return ring_allreduce_seconds(shard * scenario.grad_bytes_per_param, scenario.ranks, bw)


def summarise(plan: Plan, tls: Sequence[RankTimeline], allreduce: float) -> StepResult:
    busy = [t.busy for t in tls]
    finish = [t.finish for t in tls]
    end = max(finish, default=0.0)
    mean_busy = statistics.fmean(busy) if busy else 0.0
    step = end + allreduce
    by_mode: dict[str, float] = {}
    for t in tls:
        for mode, seconds in t.exposed_comm_by_mode.items():
            by_mode[mode] = by_mode.get(mode, 0.0) + seconds
    return StepResult(
        step_time_s=step,
        compute_finish_s=end,
        allreduce_s=allreduce,
        tokens=sum(plan.lengths),
        max_over_mean=(max(busy) / mean_busy) if mean_busy > 0 else 1.0,
        bubble_fraction=(1.0 - mean_busy / end) if end > 0 else 0.0,
        ring_bytes=sum(t.ring_bytes for t in tls),
        exposed_comm_s=sum(t.exposed_comm for t in tls),
        plan_ms=float(plan.options.get("_plan_ms", 0.0)),
        busy=busy,
        finish=finish,
        micro_batches=[t.num_micro_batches for t in tls],
        exposed_comm_by_mode=by_mode,
        mode_counts=dict(plan.mode_stats()["mode_counts"]),
    )


def _mean_by_key(rows: list[dict]) -> dict[str, float]:
    """Per key, the mean over ``rows`` (a key missing from a row counts as 0)."""
    keys = sorted({k for row in rows for k in row})
    return {k: statistics.fmean(row.get(k, 0) for row in rows) for k in keys}


def make_variant_plan(name: str, lengths: Sequence[int], scenario: Scenario, cost_model, seed: int) -> Plan:
    """Plan one global batch with simulator planner ``name``; records the planning CPU time."""
    if name not in VARIANTS:
        raise SimulationError(f"unknown planner {name!r}; choose from {sorted(VARIANTS)}")
    planner, extra = VARIANTS[name]
    kwargs = dict(
        world_size=scenario.ranks,
        capacity=scenario.capacity,
        planner=planner,
        cost_model=cost_model,
        seed=seed,
        pipeline_degree=scenario.pipeline_degree,
        ranks_per_node=scenario.ranks_per_node,
        **extra,
    )
    if kwargs.get("offload") is True:  # Eq. 3 with the scenario's layers per stage and PCIe links
        kwargs["offload"] = costs.offload_config_for(scenario)
    if planner in ("static", "verl_kk"):
        kwargs["cp_size"] = costs.static_cp(scenario)
    t0 = time.process_time()  # CPU time of this (single-threaded) process: one core, undisturbed by load
    plan = make_plan(list(lengths), **kwargs)
    plan_ms = (time.process_time() - t0) * 1e3
    plan.options["_plan_ms"] = plan_ms
    return plan


def draw_batch(scenario: Scenario, step: int) -> list[int]:
    """One global batch of ``tokens_per_step`` tokens (lengths capped at the context length)."""
    if scenario.dataset.startswith("fixed:"):
        return [int(x) for x in scenario.dataset[6:].split(",")]
    rng = random.Random(scenario.seed * 1_000_003 + step)
    return distributions.sample_global_batch(
        scenario.dataset,
        tokens=scenario.tokens_per_step,
        context_length=scenario.context_length,
        rng=rng,
    )


def run_scenario(
    scenario: Scenario,
    planners: Sequence[str] | None = None,
    steps: int | None = None,
    keep_steps: bool = False,
    cost_model: CostModel | None = None,
) -> dict:
    """Simulate ``steps`` global batches with each planner; JSON-ready summary.

    ``cost_model`` (default: the scenario's, :func:`~lightning_bytescale.sim.costs.cost_model_for`)
    plans and charges every step: a measured or refined model of one HDP rank."""
    scenario.validate()
    names = list(planners or scenario.planners)
    unknown = [p for p in names if p not in VARIANTS]
    if unknown:
        raise SimulationError(f"unknown planner(s) {unknown}; choose from {sorted(VARIANTS)}")
    steps = steps or scenario.steps
    cost_model = costs.cost_model_for(scenario) if cost_model is None else cost_model
    per: dict[str, list[StepResult]] = {n: [] for n in names}
    for step in range(steps):
        lengths = draw_batch(scenario, step)
        for name in names:
            plan = make_variant_plan(name, lengths, scenario, cost_model, scenario.seed + step)
            per[name].append(simulate_plan(plan, scenario, cost_model))
    out: dict = {}
    for name, results in per.items():
        tokens = sum(r.tokens for r in results)
        total = sum(r.step_time_s for r in results)
        out[name] = {
            "step_time_s": total / len(results),
            "tokens_per_s": tokens / total if total > 0 else 0.0,
            "max_over_mean": statistics.fmean(r.max_over_mean for r in results),
            "bubble_fraction": statistics.fmean(r.bubble_fraction for r in results),
            "ring_bytes": statistics.fmean(r.ring_bytes for r in results),
            "exposed_comm_s": statistics.fmean(r.exposed_comm_s for r in results),
            "exposed_comm_by_mode": _mean_by_key([r.exposed_comm_by_mode for r in results]),
            "mode_counts": _mean_by_key([r.mode_counts for r in results]),
            "plan_ms": statistics.fmean(r.plan_ms for r in results),
        }
    base = out.get("static")
    for row in out.values():
        row["speedup_vs_static"] = (
            row["tokens_per_s"] / base["tokens_per_s"] if base and base["tokens_per_s"] > 0 else None
        )
    result = {"scenario": scenario.name, "planners": out}
    if keep_steps:
        result["steps"] = {n: [asdict(r) for r in rs] for n, rs in per.items()}
    return result
