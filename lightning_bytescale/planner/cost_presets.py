"""Named cost models the planner comparisons run under, beside :meth:`CostModel.paper_preset`.

A plan that wins on one link speed can lose on another: with slow links more rings are
communication-bound, where a member's exposed transfer hardly falls with more ranks.  The
no-offload comparison (``benchmarks/planner_no_offload.py``) therefore runs every case under
two models:

* ``paper``: :meth:`CostModel.paper_preset` (150 GB/s inside a node of 8, 25 GB/s between
  nodes; rings between nodes turn communication-bound below about 18K tokens a rank).
* ``slow-link``: the same compute, fitted to the paper's per-layer table exactly as the paper
  preset is (docs/cost-model.md, "Presets and calibration"), on a cluster with slower links:
  nodes of 8 without NVLink (GPUs talk over PCIe, 50 GB/s per rank and direction) and one
  100 Gb/s NIC per GPU (12.5 GB/s).  Crossovers (``CostModel.crossover_length`` per rank):
  about 9K tokens inside a node, 36K between nodes, so at ``C = 8K`` every ring is at least
  partly communication-bound.
"""

from __future__ import annotations

from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.errors import PlanError

SLOW_LINK_INTRA = 50e9  # bytes/s per rank and direction: PCIe peer-to-peer, no NVLink
SLOW_LINK_INTER = 12.5e9  # bytes/s per rank and direction: one 100 Gb/s NIC per GPU


def slow_link_preset() -> CostModel:
    """The paper preset's fitted compute on the slow links above."""
    return CostModel.paper_preset().with_(
        bandwidth_intra=SLOW_LINK_INTRA, bandwidth_inter=SLOW_LINK_INTER, name="slow-link"
    )


PRESETS = {"paper": CostModel.paper_preset, "slow-link": slow_link_preset}


def get_preset(name: str) -> CostModel:
    """A named cost model: ``paper`` or ``slow-link``."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise PlanError(f"unknown cost model preset {name!r}; choose from {sorted(PRESETS)}") from None
