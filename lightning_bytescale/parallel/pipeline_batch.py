"""One pipeline's micro-batches for a step: in the pipeline order, each padded to the capacity C.

A pipeline stage passes activations of one fixed shape to the next (torch's ``PipelineStage``
is built with static shapes), so every micro-batch of a pipeline is padded to ``C`` slots, the
plan's capacity.  Padding slots (input 0, label -100, so they count in no loss) are appended
after the micro-batch's own slots, and its attention layout stays the layout of those own slots
(local, or its share of a ring); the stage runs attention on the padding slots as one separate
causal sequence (:class:`~lightning_bytescale.parallel.pipeline_stage.LlamaStage`), so no real
token attends to a padding slot, no padding slot to a real token, and a ring exchanges exactly
what it would without padding.  A padding micro-batch (``None`` in
:attr:`~lightning_bytescale.planner.pipeline_order.PipelineOrder.slots`) is C such slots.

The order is :func:`~lightning_bytescale.planner.pipeline_order.order_pipelines`'s: a ring item
across pipelines sits at the same micro-batch index on each of its member pipelines (the index
rule, docs/pipelines.md), and a plan with ring items pads every pipeline to at least one
micro-batch per stage, so all run ``Schedule1F1B``, the schedule the rule is proved for.  Every
stage of a pipeline builds the same :class:`PipelineStepBatch` from the same plan (with its own
stage's ring peers), which is how a stage knows micro-batch ``i``'s attention layout and positions
although torch's schedule passes it only tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_bytescale.engine.batch import PackedMicroBatch, StepBatch
from lightning_bytescale.engine.loss import IGNORE_INDEX
from lightning_bytescale.engine.micro_batch import MaskSource, PackingError, TokenSource, build_step
from lightning_bytescale.packed_attention.layout import AttentionLayout
from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.pipeline_order import order_pipelines
from lightning_bytescale.planner.plan import Plan
from lightning_bytescale.sim.pipeline_bubble import pipeline_bubbles

ONE_F_ONE_B = "1F1B"
GPIPE = "GPipe"


def _padding_slots(count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs, labels and positions of ``count`` padding slots (one padding sequence)."""
    return (
        torch.zeros(count, dtype=torch.long),
        torch.full((count,), IGNORE_INDEX, dtype=torch.long),
        torch.arange(count, dtype=torch.long),
    )


def pad_micro_batch(mb: PackedMicroBatch, capacity: int, index: int) -> PackedMicroBatch:
    """``mb`` with padding slots appended up to ``capacity``, at pipeline position ``index``.

    Its layout is kept: it covers the first ``mb.num_slots`` slots, the padding the rest.
    """
    extra = capacity - mb.num_slots
    if extra < 0:
        raise PackingError(
            f"micro-batch {mb.index} holds {mb.num_slots} tokens, more than the capacity {capacity} every "
            "pipeline stage is built for; plan with the capacity the stages use"
        )
    if extra == 0:
        return dataclasses.replace(mb, index=index)
    ids, labels, positions = _padding_slots(extra)
    return dataclasses.replace(
        mb,
        input_ids=torch.cat([mb.input_ids, ids]),
        labels=torch.cat([mb.labels, labels]),
        position_ids=torch.cat([mb.position_ids, positions]),
        index=index,
    )


def padding_micro_batch(capacity: int, num_global_tokens: int, index: int) -> PackedMicroBatch:
    """A micro-batch of ``capacity`` padding slots: it attends only to itself and adds zero to every loss."""
    ids, labels, positions = _padding_slots(capacity)
    return PackedMicroBatch(
        input_ids=ids,
        labels=labels,
        position_ids=positions,
        layout=AttentionLayout(cu_seqlens=(0, capacity), seq_lens=(capacity,)),
        seq_ids=(),
        num_global_tokens=num_global_tokens,
        index=index,
    )


@dataclass
class PipelineStepBatch:
    """What every stage of one pipeline (one HDP rank) runs in one step."""

    step: StepBatch  # this HDP rank's micro-batches in the plan's order: digest, token counts, stats
    micro_batches: list[PackedMicroBatch]  # in the pipeline order, each padded to ``capacity`` slots
    capacity: int
    stages: int
    counts: list[int]  # micro-batches of every pipeline this step, padding included (the same on every rank)
    padding: int  # padding micro-batches of this pipeline

    @property
    def step_batch(self) -> StepBatch:
        """The step's :class:`StepBatch` (as ``StepBatch.step_batch``: every step batch answers it)."""
        return self.step

    @property
    def stats(self) -> dict:
        """The plan's statistics of the step (``step.stats``), where callbacks look for a batch's."""
        return self.step.stats

    @property
    def digest(self) -> str:
        return self.step.digest

    @property
    def schedule_name(self) -> str | None:
        """``"1F1B"`` with at least one micro-batch per stage, ``"GPipe"`` with fewer, ``None`` with none.

        torch's ``Schedule1F1B`` refuses fewer micro-batches than stages; ``ScheduleGPipe`` runs any
        count (all forwards, then all backwards).  Either is exact; a plan with rings across
        pipelines pads every pipeline to 1F1B (:func:`build_pipeline_step`).
        """
        n = len(self.micro_batches)
        if n == 0:
            return None
        return ONE_F_ONE_B if n >= self.stages else GPIPE


def _pipeline_facts(plan: Plan, counts: Sequence[int], stages: int, min_micro_batches: int) -> dict:
    """What every rank knows of the executed pipeline order: micro-batches and simulated bubble per pipeline.

    ``pipeline_micro_batches`` (padding included) and ``pipeline_bubble_sim``: the simulator's
    bubble of every pipeline for the executed order, each micro-batch costed padded to C as the
    stages run it, with the cost model the plan was made with
    (:func:`~lightning_bytescale.sim.pipeline_bubble.pipeline_bubbles`); for the telemetry.
    """
    facts: dict = {"pipeline_micro_batches": [int(c) for c in counts]}
    cost = plan.options.get("cost_model")
    if cost and stages > 1:
        bubbles = pipeline_bubbles(
            plan,
            CostModel.from_json_dict(cost),
            stages=stages,
            min_micro_batches=min_micro_batches,
            pad_to_capacity=True,
        )
        facts["pipeline_bubble_sim"] = [b.bubble for b in bubbles]
    return facts


def build_pipeline_step(
    plan: Plan,
    hdp_rank: int,
    tokens: TokenSource,
    *,
    stages: int,
    step: int = 0,
    data_identity: str = "",
    min_micro_batches: int = 0,
    loss_mask: MaskSource | None = None,
    loss_tokens: Sequence[int] | None = None,
    ring_ranks: Sequence[int] | None = None,
) -> PipelineStepBatch:
    """Pipeline ``hdp_rank``'s micro-batches of ``plan`` in the pipeline order, padded to the plan's capacity.

    ``min_micro_batches`` pads every pipeline with fewer with padding micro-batches at its end;
    a plan with ring items pads to at least ``stages`` (1F1B everywhere).  ``ring_ranks`` are
    the global ranks of this stage (and lane) of every pipeline
    (:attr:`~lightning_bytescale.parallel.dims.ParallelMesh.ring_ranks`): a ring runs between
    the same stage of its member pipelines.  The other arguments are
    :func:`~lightning_bytescale.engine.micro_batch.build_step`'s; the returned ``step`` is its
    batch, from which the step's checks read the digest and the token counts.
    """
    packed = build_step(
        plan,
        hdp_rank,
        tokens,
        step=step,
        data_identity=data_identity,
        loss_mask=loss_mask,
        loss_tokens=loss_tokens,
        ring_ranks=ring_ranks,
    )
    if any(mb.ring is not None for mbs in plan.ranks for mb in mbs):
        min_micro_batches = max(min_micro_batches, stages)
    order = order_pipelines(plan, stages=stages, min_micro_batches=min_micro_batches)
    packed.stats.update(_pipeline_facts(plan, order.micro_batch_counts, stages, min_micro_batches))
    position = {id(mb): i for i, mb in enumerate(plan.ranks[hdp_rank])}
    capacity = int(plan.capacity)
    slots = []
    for index, mb in enumerate(order.slots[hdp_rank]):
        if mb is None:
            slots.append(padding_micro_batch(capacity, packed.num_global_tokens, index))
        else:
            slots.append(pad_micro_batch(packed.micro_batches[position[id(mb)]], capacity, index))
    return PipelineStepBatch(
        step=packed,
        micro_batches=slots,
        capacity=capacity,
        stages=stages,
        counts=order.micro_batch_counts,
        padding=order.pads[hdp_rank],
    )


__all__ = [
    "PipelineStepBatch",
    "build_pipeline_step",
    "pad_micro_batch",
    "padding_micro_batch",
]
