"""Planner comparisons on a grid: the same batches, one cost model, step times from the simulator.

A :class:`Case` is one cell of the no-offload comparison (issue 16): a length distribution,
a world size and a named cost model (:mod:`lightning_bytescale.planner.cost_presets`).  It
turns into a :class:`~.scenario.Scenario` (LLaMA-7B gradient all-reduce, nodes of 8 ranks, the
cost model's links) whose global batches every planner plans; :func:`compare` simulates each
plan (:func:`~.run.simulate_plan`: the slowest rank's finish, ring waits and exposed
transfers included, plus the all-reduce) and returns the step times side by side.  Named
simulator scenarios (``paper-70b-github-2m``...) compare the same way with their own model.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.cost_presets import get_preset
from lightning_bytescale.planner.distributions import REFERENCE_CONTEXT
from lightning_bytescale.sim import costs
from lightning_bytescale.sim.run import draw_batch, make_variant_plan, simulate_plan
from lightning_bytescale.sim.scenario import MODELS, Scenario

#: The no-offload comparison: ``balance`` without offload against the two peers.
NO_OFFLOAD_PLANNERS = ("balance_no_offload", "megatron_dcp", "lpt")


@dataclass(frozen=True)
class Case:
    """One grid cell: ``micro_batches_per_rank`` micro-batches' worth of tokens on every rank.

    The context is ``min(2M, world_size x capacity / 2)``: the longest sequence needs at most
    half the ranks, so every planner (Megatron's power-of-two groups too) can place it.
    """

    distribution: str
    world_size: int
    cost_model: str
    capacity: int = 8192
    micro_batches_per_rank: int = 8
    ranks_per_node: int = 8
    steps: int = 1
    seed: int = 0

    @property
    def name(self) -> str:
        return f"{self.distribution}-{self.world_size}-{self.cost_model}"

    @property
    def context_length(self) -> int:
        return min(REFERENCE_CONTEXT, self.world_size * self.capacity // 2)

    def model(self) -> CostModel:
        return get_preset(self.cost_model).with_(ranks_per_node=self.ranks_per_node)

    def scenario(self) -> Scenario:
        cm = self.model()
        return Scenario(
            name=self.name,
            model=MODELS["7b"],
            gpus=self.world_size,
            capacity=self.capacity,
            tokens_per_step=self.world_size * self.capacity * self.micro_batches_per_rank,
            context_length=self.context_length,
            dataset=self.distribution,
            bandwidth_intra=cm.bandwidth(True),
            bandwidth_inter=cm.bandwidth(False),
            gpus_per_node=self.ranks_per_node,
            steps=self.steps,
            seed=self.seed,
            description=f"{self.distribution}, {self.world_size} ranks, {self.cost_model} cost model",
        )


def compare(
    scenario: Scenario, cost_model: CostModel | None = None, planners: Sequence[str] = NO_OFFLOAD_PLANNERS
) -> dict[str, dict[str, float]]:
    """Per planner: mean step time, compute finish, max/mean busy and plan CPU ms over the steps."""
    scenario.validate()
    cm = costs.cost_model_for(scenario) if cost_model is None else cost_model
    rows: dict[str, list] = {p: [] for p in planners}
    for step in range(scenario.steps):
        lengths = draw_batch(scenario, step)
        for p in planners:
            plan = make_variant_plan(p, lengths, scenario, cm, scenario.seed + step)
            rows[p].append(simulate_plan(plan, scenario, cm))
    return {
        p: {
            "step_time_s": statistics.fmean(r.step_time_s for r in res),
            "compute_finish_s": statistics.fmean(r.compute_finish_s for r in res),
            "max_over_mean": statistics.fmean(r.max_over_mean for r in res),
            "plan_ms": statistics.fmean(r.plan_ms for r in res),
        }
        for p, res in rows.items()
    }


def compare_case(case: Case, planners: Sequence[str] = NO_OFFLOAD_PLANNERS) -> dict[str, dict[str, float]]:
    return compare(case.scenario(), case.model(), planners)
