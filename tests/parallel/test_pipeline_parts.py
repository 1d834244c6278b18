"""The pipeline step's parts without processes: the stage split, refused models and plans, the padding.

The padding check runs one stage that is the whole model (``LlamaStage(model, 0, 1)``) on a
micro-batch padded to the capacity and compares it with the model on the same micro-batch
unpadded: the real slots' logits and the gradients must be the same, the padding counts in no
loss, and a padding micro-batch gives a zero loss and zero gradients.
"""

from __future__ import annotations

import pytest
import torch

from lightning_bytescale.engine import build_step
from lightning_bytescale.engine.loss import IGNORE_INDEX
from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.packed_attention import attention_context
from lightning_bytescale.parallel import (
    LlamaStage,
    ParallelDims,
    PipelineModelError,
    build_pipeline_step,
    pad_micro_batch,
    padding_micro_batch,
    stage_layers,
)
from lightning_bytescale.planner import make_plan
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan


def test_stage_layers_are_contiguous_and_cover_every_block_once():
    for layers in range(1, 9):
        for stages in range(1, layers + 1):
            runs = [stage_layers(layers, stages, p) for p in range(stages)]
            assert [i for r in runs for i in r] == list(range(layers))
            assert max(map(len, runs)) - min(map(len, runs)) <= 1 and min(map(len, runs)) >= 1


def test_models_that_cannot_be_split_are_refused_naming_the_fix():
    with pytest.raises(
        PipelineModelError, match=r"2 blocks, fewer than the 3 pipeline stages.*pipeline_parallel_size <= 2"
    ):
        LlamaStage(LlamaModel(LlamaConfig.preset("tiny")), 0, 3)
    with pytest.raises(PipelineModelError, match=r"tie_embeddings=True.*LlamaConfig\(tie_embeddings=False\)"):
        LlamaStage(LlamaModel(LlamaConfig.preset("tiny", tie_embeddings=True)), 0, 2)


def test_a_ring_across_pipelines_sits_at_one_index_runs_between_one_stage_and_pads_to_1f1b():
    lengths = [30, 8, 6]  # 30 > C: a ring item over both pipelines
    plan = make_plan(lengths, world_size=2, capacity=24, planner="balance", pipeline_degree=2)
    assert any(mb.ring is not None for mbs in plan.ranks for mb in mbs)
    seqs = [torch.arange(s) % 7 for s in lengths]
    dims = ParallelDims(4, pipeline=2)
    batches = [
        build_pipeline_step(plan, h, lambda j: seqs[j], stages=2, ring_ranks=dims.lane_ranks(0, stage=1))
        for h in range(2)
    ]
    rings = [[i for i, mb in enumerate(b.micro_batches) if mb.layout.ring is not None] for b in batches]
    assert rings[0] == rings[1] and len(rings[0]) == 1  # the index rule
    ring_mb = batches[0].micro_batches[rings[0][0]]
    assert set(ring_mb.layout.ring) == {2, 3}  # stage 1 of pipelines 0 and 1: global ranks 2 and 3
    assert ring_mb.layout.num_slots < ring_mb.num_slots == 24  # padded after the ring's own slots
    assert all(len(b.micro_batches) >= 2 and b.schedule_name == "1F1B" for b in batches)


def _plan(lengths: list[int], capacity: int) -> Plan:
    plan = Plan(
        1,
        capacity,
        "hand",
        tuple(lengths),
        [[MicroBatch([Piece(j, ((0, s),)) for j, s in enumerate(lengths)])]],
    )
    return plan.validate()


def test_a_micro_batch_over_the_capacity_is_refused():
    from lightning_bytescale.engine import PackingError

    seqs = [torch.arange(9) % 5]
    mb = build_step(_plan([9], 9), 0, lambda j: seqs[j]).micro_batches[0]
    with pytest.raises(PackingError, match="holds 9 tokens, more than the capacity 8"):
        pad_micro_batch(mb, 8, 0)


def _run(stage: torch.nn.Module, mb) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    stage.zero_grad(set_to_none=True)
    stage.bind([mb])
    logits = stage(mb.input_ids[None], slot=torch.zeros(1, dtype=torch.long))[0]
    loss = mb.loss(logits)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in stage.named_parameters()}


def test_padding_to_the_capacity_changes_no_real_logit_loss_or_gradient():
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig.preset("tiny", tie_embeddings=False)).double()
    stage = LlamaStage(model, 0, 1)
    lengths = [7, 5]
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 64, (s,), generator=g) for s in lengths]
    step = build_step(_plan(lengths, 20), 0, lambda j: seqs[j])
    mb = step.micro_batches[0]
    padded = pad_micro_batch(mb, 20, index=4)
    assert (
        padded.num_slots == 20 and padded.index == 4 and padded.layout == mb.layout
    )  # the layout of its own slots
    assert (padded.labels[12:] == IGNORE_INDEX).all() and (padded.input_ids[12:] == 0).all()
    logits, loss, grads = _run(stage, mb)
    with attention_context(mb.layout):
        whole = model(mb.input_ids, mb.position_ids)  # the model itself on the unpadded micro-batch
    assert torch.equal(logits, whole.detach())
    p_logits, p_loss, p_grads = _run(stage, padded)
    assert (p_logits[:12] - logits).abs().max().item() <= 1e-14
    assert abs(float(p_loss - loss)) <= 1e-15
    assert max((p_grads[n] - grads[n]).abs().max().item() for n in grads) <= 1e-15
    empty = padding_micro_batch(20, step.num_global_tokens, index=5)
    _, e_loss, e_grads = _run(stage, empty)
    assert float(e_loss) == 0.0 and all(not g.any() for g in e_grads.values())
