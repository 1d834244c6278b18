"""The HDP planner: which ranks hold which tokens in which micro-batch, for one global batch.

Pure Python and NumPy (no framework imports), so the simulator, the data loader and the
command line share it.  Entry point: :func:`make_plan`, with its options in one
:class:`PlannerConfig`; see :mod:`.planners` for the planners
and the decisions they make, :mod:`.cost_model` for the cost model and Eq. 3.
"""

from __future__ import annotations

from lightning_bytescale.planner.config import PlannerConfig
from lightning_bytescale.planner.cost_model import (
    CostModel,
    OffloadConfig,
    eq3_ranks,
    load_cost_model,
    max_offload_ratio,
    offload_options,
    ranks_with_offload,
    ranks_without_offload,
)
from lightning_bytescale.planner.errors import PlanError, PlannerConfigError, PlanValidationError
from lightning_bytescale.planner.packing import best_fit_decreasing
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan
from lightning_bytescale.planner.planners import (
    available_planners,
    get_planner,
    make_plan,
    register_planner,
)

__all__ = [
    "CostModel",
    "MicroBatch",
    "OffloadConfig",
    "Piece",
    "Plan",
    "PlanError",
    "PlannerConfig",
    "PlannerConfigError",
    "PlanValidationError",
    "available_planners",
    "best_fit_decreasing",
    "eq3_ranks",
    "get_planner",
    "load_cost_model",
    "make_plan",
    "max_offload_ratio",
    "offload_options",
    "ranks_with_offload",
    "ranks_without_offload",
    "register_planner",
]
