"""What a micro-batch costs a rank, from the planner's own cost model.

The simulator does not carry a formula of its own: compute and ring communication come from
:class:`~lightning_bytescale.planner.cost_model.CostModel` (``local_time``,
``ring_member_time`` with ``comm_aware=True``, ``ring_bytes``), the same model the
communication-aware planners balance on, so planned and simulated times agree.  The
simulator adds what only a timeline shows:

* the ring bandwidth of the *actual* members: intra-node only when all of them sit on one
  node (``ranks_per_node`` consecutive ranks); an item in another attention mode (Ulysses, or
  Ulysses inside nodes x ring across them) costs what its mode costs on those members
  (:func:`~lightning_bytescale.planner.modes.mode_time`), its exposed communication kept per
  mode;
* offload transfers (paper Eq. 3): on each of the ``l - 2`` offloaded layers of a stage the
  copy of ``r * Act`` bytes runs on the DMA engine beside the layer's compute, so a layer
  takes ``max(compute, r * Act / B)`` in the forward (device to host) and in the backward
  (host to device); the two resident layers never wait.  Nothing is exposed when Eq. 3's
  condition ``T(s) >= r Act(s) / B`` holds.

Scenario shapes are turned into a cost model per HDP rank: a rank is a TP group, so its
FLOP rate, link bandwidths and PCIe bandwidth are ``tp`` times a GPU's, and the heads Ulysses
splits are one lane's (``heads / tp``, and ``kv_heads / tp`` or one replicated K/V head).
"""

from __future__ import annotations

from lightning_bytescale.planner.cost_model import CostModel, OffloadConfig
from lightning_bytescale.planner.modes import group_layout, mode_bytes, mode_time
from lightning_bytescale.planner.plan import MicroBatch, Plan
from lightning_bytescale.planner.planners import static_cp_size
from lightning_bytescale.sim.scenario import Scenario
from lightning_bytescale.sim.timeline import MicroBatchCost

ACHIEVED_FLOPS_PER_GPU = 400e12  # bf16, about 40% of an H100-class peak
PCIE_BANDWIDTH_PER_GPU = 25e9


def cost_model_for(scenario: Scenario) -> CostModel:
    """The per-HDP-rank cost model of a scenario (MoE: the active experts' FFN)."""
    m = scenario.model
    tp = scenario.tensor_parallel
    return CostModel.from_model_shape(
        m.num_layers,
        m.hidden,
        m.heads,
        m.kv_heads,
        m.ffn * m.top_k,
        m.vocab,
        flops_per_s=scenario.extra.get("flops_per_gpu", ACHIEVED_FLOPS_PER_GPU) * tp,
        bandwidth_intra=scenario.bandwidth_intra * tp,
        bandwidth_inter=scenario.bandwidth_inter * tp,
        ranks_per_node=scenario.ranks_per_node,
        name=f"{m.name}-tp{tp}",
    ).with_(attention_heads=m.heads // tp, kv_heads=max(1, m.kv_heads // tp))


def offload_config_for(scenario: Scenario) -> OffloadConfig:
    """Eq. 3's setting: layers per pipeline stage, PCIe bandwidth of the rank's ``tp`` GPUs."""
    bw = scenario.extra.get("pcie_per_gpu", PCIE_BANDWIDTH_PER_GPU) * scenario.tensor_parallel
    layers = max(1, scenario.model.num_layers // scenario.pipeline_degree)
    return OffloadConfig(layers_per_rank=layers, bandwidth_d2h=bw, bandwidth_h2d=bw)


def static_cp(scenario: Scenario) -> int:
    """The static mesh's CP degree: the smallest divisor of the ranks that holds the context."""
    return static_cp_size([scenario.context_length], scenario.ranks, scenario.capacity)


def ring_is_intra(ring: tuple[int, ...], ranks_per_node: int | None) -> bool:
    if not ranks_per_node:
        return False
    node = ring[0] // ranks_per_node
    return all(r // ranks_per_node == node for r in ring)


class CostFunction:
    """``cost(rank, micro_batch) -> MicroBatchCost`` for one plan; ring items are costed once."""

    def __init__(self, plan: Plan, scenario: Scenario, cost_model: CostModel) -> None:
        self.plan = plan
        self.cm = cost_model
        self.offload = offload_config_for(scenario)
        self.ranks_per_node = scenario.ranks_per_node
        self._items: dict[int, MicroBatchCost] = {}

    def __call__(self, rank: int, mb: MicroBatch) -> MicroBatchCost:
        if mb.ring is None:
            return self._local(mb)
        cached = self._items.get(mb.item)
        if cached is None:
            cached = self._ring(mb)
            self._items[mb.item] = cached
        return cached

    def _lengths(self, mb: MicroBatch) -> list[int]:
        return [self.plan.lengths[p.seq] for p in mb.pieces]

    def _local(self, mb: MicroBatch) -> MicroBatchCost:
        lengths = self._lengths(mb)
        compute = self.cm.local_time(lengths)
        slots = sum(lengths)
        exposed_off = self._offload_exposed(compute, slots, mb.offload_ratio)
        return MicroBatchCost(duration=compute + exposed_off, compute=compute, exposed_offload=exposed_off)

    def _ring(self, mb: MicroBatch) -> MicroBatchCost:
        n = len(mb.ring)
        # every member lists the same sequences; lengths are those of the whole sequences
        lengths = self._lengths(mb)
        if mb.mode == "ring":
            intra = ring_is_intra(mb.ring, self.ranks_per_node)
            time, exposed = self.cm.ring_member_time(lengths, n, intra=intra, comm_aware=True)
            sent = self.cm.ring_bytes(lengths, n)
        else:
            layout = group_layout(mb.ring, self.ranks_per_node)
            time, exposed = mode_time(self.cm, mb.mode, lengths, layout)
            sent = mode_bytes(self.cm, mb.mode, lengths, layout)
        slots = sum(2 * (-(-s // (2 * n))) for s in lengths)
        exposed_off = self._offload_exposed(time, slots, mb.offload_ratio)
        return MicroBatchCost(
            duration=time + exposed_off,
            compute=time - exposed,
            exposed_comm=exposed,
            exposed_offload=exposed_off,
            ring_bytes=sent / n,
            mode=mb.mode,
        )

    def _offload_exposed(self, time: float, slots: int, ratio: float) -> float:
        """Eq. 3 overlap: per offloaded layer, the copy beyond that layer's forward (backward) time."""
        if ratio <= 0:
            return 0.0
        layers = self.cm.num_layers
        l_stage = self.offload.layers_per_rank
        offloaded = layers * max(l_stage - 2, 0) / l_stage  # two layers of each stage stay resident
        per_layer = time / layers
        copy = ratio * self.cm.act_bytes(slots) / self.offload.bandwidth
        fwd = self.cm.forward_fraction * per_layer
        bwd = per_layer - fwd
        return offloaded * (max(0.0, copy - fwd) + max(0.0, copy - bwd))
