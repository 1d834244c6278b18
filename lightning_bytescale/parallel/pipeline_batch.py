"""One pipeline's micro-batches for a step: in the pipeline order, each padded to the capacity C.

A pipeline stage passes activations of one fixed shape to the next (torch's ``PipelineStage``
is built with static shapes), so every micro-batch of a pipeline is padded to ``C`` slots, the
plan's capacity.  The padding is one more sequence in the packed layout: its slots hold input 0
and label -100, and packed attention is causal *within* a sequence, so no real token attends to
a padding slot and no padding slot to a real token, and the padding counts in no loss (its
gradient contribution is zero).  A padding micro-batch (``None`` in
:attr:`~lightning_bytescale.planner.pipeline_order.PipelineOrder.slots`) is C such slots.

The order is :func:`~lightning_bytescale.planner.pipeline_order.order_pipelines`'s (the index
rule for rings across pipelines, docs/pipelines.md); every stage of a pipeline builds the same
:class:`PipelineStepBatch` from the same plan, which is how a stage knows micro-batch ``i``'s
attention layout and positions although torch's schedule passes it only tensors
(:class:`~lightning_bytescale.parallel.pipeline_stage.LlamaStage`).  Rings across pipelines are
not executed yet: a plan with a ring item is refused (:class:`PipelineRingError`).
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
from lightning_bytescale.parallel.errors import PipelineRingError
from lightning_bytescale.planner.pipeline_order import order_pipelines
from lightning_bytescale.planner.plan import Plan

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
    """``mb`` with a padding sequence appended up to ``capacity`` slots, at pipeline position ``index``.

    Only local micro-batches (no ring) are padded: a ring's zigzag layout has no room for slots
    outside its sequences.
    """
    if mb.layout.ring is not None:
        raise PipelineRingError(
            f"micro-batch {mb.index} is a ring over global ranks {list(mb.layout.ring)}; the pipeline step "
            "pads local micro-batches only"
        )
    extra = capacity - mb.num_slots
    if extra < 0:
        raise PackingError(
            f"micro-batch {mb.index} holds {mb.num_slots} tokens, more than the capacity {capacity} every "
            "pipeline stage is built for; plan with the capacity the stages use"
        )
    if extra == 0:
        return dataclasses.replace(mb, index=index)
    ids, labels, positions = _padding_slots(extra)
    layout = AttentionLayout(
        cu_seqlens=(*mb.layout.cu_seqlens, capacity), seq_lens=(*mb.layout.seq_lens, extra)
    )
    return dataclasses.replace(
        mb,
        input_ids=torch.cat([mb.input_ids, ids]),
        labels=torch.cat([mb.labels, labels]),
        position_ids=torch.cat([mb.position_ids, positions]),
        layout=layout,
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
    def schedule_name(self) -> str | None:
        """``"1F1B"`` with at least one micro-batch per stage, ``"GPipe"`` with fewer, ``None`` with none.

        torch's ``Schedule1F1B`` refuses fewer micro-batches than stages; ``ScheduleGPipe`` runs any
        count (all forwards, then all backwards).  Without rings across pipelines either is exact.
        """
        n = len(self.micro_batches)
        if n == 0:
            return None
        return ONE_F_ONE_B if n >= self.stages else GPIPE


def _refuse_rings(plan: Plan) -> None:
    items = sorted({mb.item for mbs in plan.ranks for mb in mbs if mb.ring is not None}, key=str)
    if items:
        longest = max(plan.lengths, default=0)
        raise PipelineRingError(
            f"the plan shards {len(items)} micro-batch(es) over several pipelines (ring items {items[:5]}), "
            "but the pipeline step does not run rings across pipelines yet. Plan with a capacity of at least "
            f"the longest sequence ({longest} tokens; now {plan.capacity}) so every sequence stays in one "
            "pipeline, or train with pipeline_parallel_size=1"
        )


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
) -> PipelineStepBatch:
    """Pipeline ``hdp_rank``'s micro-batches of ``plan`` in the pipeline order, padded to the plan's capacity.

    ``min_micro_batches`` pads every pipeline with fewer with padding micro-batches at its end
    (``stages`` runs every pipeline with at least one micro-batch per stage under 1F1B).  The
    other arguments are :func:`~lightning_bytescale.engine.micro_batch.build_step`'s; the
    returned ``step`` is its batch, from which the step's checks read the digest and the token
    counts.
    """
    _refuse_rings(plan)
    packed = build_step(
        plan,
        hdp_rank,
        tokens,
        step=step,
        data_identity=data_identity,
        loss_mask=loss_mask,
        loss_tokens=loss_tokens,
    )
    order = order_pipelines(plan, stages=stages, min_micro_batches=min_micro_batches)
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
