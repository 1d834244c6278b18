"""Cluster simulator: the real planners on thousands of simulated ranks.

:func:`run_scenario` draws global batches for a :class:`Scenario`, plans each with every
planner (``static``, ``naive``, ``balance`` and the peers ``megatron_dcp``, ``verl_kk``,
``lpt``), and simulates every rank's timeline with the planner's own communication-aware cost model:
compute, ring transfers not hidden behind attention, offload copies beyond Eq. 3's overlap,
ring partners waiting for each other, barriers, 1F1B pipelines and the gradient all-reduce.
The console script ``bytescale-sim`` (:mod:`.cli`) prints the comparison; :mod:`.compare`
runs the no-offload planner comparison on a grid of distributions, world sizes and cost models;
:func:`step_lower_bound` (:mod:`.bounds`) is the step time no plan without offload can beat;
:func:`pipeline_bubbles` (:mod:`.pipeline_bubble`) scores the plans a pipeline run executed, and
:func:`compare_measured` sets a measured run's bubbles beside them (``bytescale-sim --measured``).
"""

from __future__ import annotations

from lightning_bytescale.sim.bounds import StepBound, step_lower_bound
from lightning_bytescale.sim.pipeline_bubble import (
    PipelineBubble,
    compare_measured,
    micro_batch_seconds,
    pipeline_bubbles,
)
from lightning_bytescale.sim.run import (
    SUMMARY_KEYS,
    VARIANTS,
    StepResult,
    draw_batch,
    make_variant_plan,
    run_scenario,
    simulate_plan,
)
from lightning_bytescale.sim.scenario import MODELS, SCENARIOS, ModelShape, Scenario, get_scenario
from lightning_bytescale.sim.timeline import (
    MicroBatchCost,
    RankTimeline,
    SimulationError,
    one_f_one_b,
    ring_allreduce_seconds,
    simulate_pipelines,
    simulate_ranks,
)

__all__ = [
    "MODELS",
    "SCENARIOS",
    "SUMMARY_KEYS",
    "VARIANTS",
    "MicroBatchCost",
    "ModelShape",
    "PipelineBubble",
    "RankTimeline",
    "Scenario",
    "SimulationError",
    "StepBound",
    "StepResult",
    "compare_measured",
    "draw_batch",
    "get_scenario",
    "make_variant_plan",
    "micro_batch_seconds",
    "one_f_one_b",
    "pipeline_bubbles",
    "ring_allreduce_seconds",
    "run_scenario",
    "simulate_pipelines",
    "simulate_plan",
    "simulate_ranks",
    "step_lower_bound",
]
