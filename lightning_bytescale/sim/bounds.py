"""A lower bound on the simulated step time of any plan without offload, to read planners against.

Two planners that tie may both be poor, or both be at the best any plan can do.  In the
simulator's cost model no plan that keeps every ring member within the capacity ``C`` (no
activation offload) can end a step sooner than either of:

* **the longest sequence**: it runs on some ring of ``n >= ceil(s / C)`` ranks, and a rank's
  micro-batches run one after another, so the step lasts at least the shortest time that
  sequence alone takes on any ring size (sharing its micro-batch with other sequences or
  waiting for ring partners only adds: every term of the cost model grows with the lengths);
* **the work**: a ring item of ``n`` members busy for ``T`` costs ``n * T`` rank-seconds, and per
  layer ``T = linear + max(attention, exposed-or-not transfer)``.  Summed over a plan's items,
  ``n * linear >= b * s`` per sequence (padding and the per-micro-batch constant only add),
  ``n * attention = a * s^2``, and ``n * transfer >= passes * (D(s) - 1) * s * kv_bytes / bw``,
  since every ring a sequence is in has ``n >= D(s) = ceil(s / C)`` members (the link is the
  node-local one only where ``D(s)`` fits a node).  The maximum of two sums is at most the sum
  of the maxima, so the rank-seconds are at least ``layers * (sum(b * s) + max(sum(a * s^2),
  sum(transfer)))``, and the slowest rank is busy at least that spread over the ranks.

The gradient all-reduce comes after both.  Pipelines (``pipeline_degree > 1``) follow another
schedule and get no bound here.  The bound is for ring attention: a plan whose items run as
Ulysses or Ulysses x ring (:mod:`lightning_bytescale.planner.modes`) moves other volumes and can
end sooner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.sim.run import allreduce_seconds
from lightning_bytescale.sim.scenario import Scenario
from lightning_bytescale.sim.timeline import SimulationError


@dataclass(frozen=True)
class StepBound:
    """The two lower bounds of one global batch's step time (seconds) and the step bound itself."""

    longest_sequence_s: float
    """The longest sequence alone on its best ring size (intra-node where the ring fits a node)."""
    work_s: float
    """The least rank-seconds of all sequences (compute, or ring transfers on minimal rings) spread over the ranks."""
    allreduce_s: float
    """The gradient all-reduce after the last micro-batch."""

    @property
    def step_s(self) -> float:
        """No ring-only plan without offload ends this step sooner (in the simulator's model)."""
        return max(self.longest_sequence_s, self.work_s) + self.allreduce_s


def smallest_ring(s: int, capacity: int) -> int:
    """``D(s) = ceil(s / C)``: the fewest ranks whose capacity holds a sequence of ``s`` tokens."""
    return max(1, -(-s // capacity))


def best_ring_time(s: int, world: int, capacity: int, cost_model: CostModel, ranks_per_node: int) -> float:
    """The least whole-model time of one sequence of ``s`` tokens alone on any ring it fits."""
    smallest = smallest_ring(s, capacity)
    if smallest > world:
        raise SimulationError(
            f"a sequence of {s} tokens needs {smallest} ranks of capacity {capacity}, more than the {world} there are"
        )
    best = float("inf")
    for n in range(smallest, world + 1):
        links = (True, False) if n <= ranks_per_node else (False,)
        for intra in links:
            best = min(best, cost_model.ring_member_time([s], n, intra=intra, comm_aware=True)[0])
    return best


def least_transfer(s: int, capacity: int, cost_model: CostModel, ranks_per_node: int) -> float:
    """Per layer, the least ``n x`` ring-transfer seconds of a sequence: on its smallest ring, ``D(s)``."""
    smallest = smallest_ring(s, capacity)
    if smallest == 1 or cost_model.kv_bytes_per_token_per_layer <= 0:
        return 0.0
    links = [cost_model.bandwidth(False)]
    if smallest <= ranks_per_node:
        links.append(cost_model.bandwidth(True))
    bandwidth = max((bw for bw in links if bw is not None), default=None)
    if bandwidth is None:
        return 0.0
    return cost_model.comm_passes * (smallest - 1) * s * cost_model.kv_bytes_per_token_per_layer / bandwidth


def step_lower_bound(lengths: Sequence[int], scenario: Scenario, cost_model: CostModel) -> StepBound:
    """The lower bound on the simulated step time of ``lengths`` for any ring-only plan without offload."""
    if scenario.pipeline_degree > 1:
        raise SimulationError("step_lower_bound covers plans without pipeline stages (pipeline_degree 1)")
    if not lengths:
        raise SimulationError("step_lower_bound needs at least one sequence")
    world, capacity, per_node = scenario.ranks, scenario.capacity, scenario.ranks_per_node
    longest = best_ring_time(max(lengths), world, capacity, cost_model, per_node)
    linear = attention = transfer = 0.0
    for s in lengths:
        linear += cost_model.b * s
        attention += cost_model.a * s * s
        transfer += least_transfer(s, capacity, cost_model, per_node)
    work = cost_model.num_layers * (linear + max(attention, transfer)) / world
    return StepBound(longest_sequence_s=longest, work_s=work, allreduce_s=allreduce_seconds(scenario))


__all__ = ["StepBound", "best_ring_time", "least_transfer", "smallest_ring", "step_lower_bound"]
