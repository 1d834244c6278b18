"""The parallel dimensions without processes: sizes refused with the fix, the rank map, heads, ring lanes.

Expected values are the layout's definition checked from the other side (every global rank appears
in exactly one lane and one TP group, TP groups are runs of consecutive ranks), not the functions'
own output.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_bytescale.data.errors import DataError
from lightning_bytescale.engine import PackingError, build_step
from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.parallel import (
    ParallelDims,
    ParallelDimsError,
    TensorParallelHeadsError,
    check_heads,
    clip_grad_norm_,
    parallelize_llama,
)
from lightning_bytescale.planner import zigzag
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(world_size=6, tensor_parallel=4), r"tensor_parallel_size=4 does not divide the world of 6 ranks.*\[1, 2, 3, 6\]"),
        (dict(world_size=16, tensor_parallel=8, ranks_per_node=4), r"larger than the 4 ranks of a node.*at most tensor_parallel_size=4"),
        (dict(world_size=12, tensor_parallel=3, ranks_per_node=4), r"does not divide the 4 ranks of a node.*span two nodes"),
        (dict(world_size=4, tensor_parallel=0), r"tensor_parallel_size must be a positive integer, got 0"),
        (dict(world_size=4, tensor_parallel=True), r"positive integer, got True"),
        (dict(world_size=6, tensor_parallel=2, pipeline=2), r"pipeline_parallel_size=2 times tensor_parallel_size=2 does not divide the world of 6 ranks.*\[1, 3\]"),
        (dict(world_size=4, pipeline=0), r"pipeline_parallel_size must be a positive integer, got 0"),
    ],
)  # fmt: skip
def test_sizes_that_do_not_fit_are_refused_naming_the_fix(kwargs, message):
    with pytest.raises(ParallelDimsError, match=message):
        ParallelDims(**kwargs)


def test_rank_map_is_tp_inner_and_partitions_the_world():
    dims = ParallelDims(12, tensor_parallel=4, ranks_per_node=8)
    assert dims.data_parallel == 3
    lanes = [dims.lane_ranks(t) for t in range(4)]
    groups = [dims.tp_ranks(h) for h in range(3)]
    assert sorted(r for lane in lanes for r in lane) == list(range(12))
    assert sorted(r for g in groups for r in g) == list(range(12))
    assert groups == [tuple(range(4 * h, 4 * h + 4)) for h in range(3)]  # consecutive ranks: inside a node
    for t, lane in enumerate(lanes):
        assert len(lane) == 3 and all(dims.tp_lane(r) == t for r in lane)
        assert [dims.hdp_rank(r) for r in lane] == [0, 1, 2]
    assert all(dims.global_rank(dims.hdp_rank(r), dims.tp_lane(r)) == r for r in range(12))
    with pytest.raises(ParallelDimsError, match="outside the world of 12 ranks"):
        dims.hdp_rank(12)
    assert ParallelDims(5).lane_ranks(0) == tuple(range(5))  # without TP every rank is an HDP rank


def test_rank_map_with_pipelines_is_stage_outermost_and_partitions_the_world():
    dims = ParallelDims(12, tensor_parallel=2, pipeline=3)
    assert (dims.data_parallel, dims.stage_size) == (2, 4)
    # stage p is the contiguous block [4p, 4p + 4); inside it the TP-inner layout of two HDP ranks
    for g in range(12):
        p, h, t = g // 4, (g % 4) // 2, g % 2
        assert (dims.stage(g), dims.hdp_rank(g), dims.tp_lane(g)) == (p, h, t)
        assert dims.global_rank(h, t, p) == g
    pipes = [dims.pipeline_ranks(h, t) for h in range(2) for t in range(2)]
    assert sorted(r for pipe in pipes for r in pipe) == list(range(12))
    assert dims.pipeline_ranks(1, 0) == (2, 6, 10)  # one rank per stage, in stage order
    assert dims.lane_ranks(1, stage=2) == (9, 11)  # stage 2's data-parallel group of lane 1
    assert ParallelDims(4).stage(3) == 0 and ParallelDims(4).hdp_rank(3) == 3  # no pipelines: as before
    with pytest.raises(ParallelDimsError, match=r"stage 3\) is outside \(2, 2, 3\)"):
        dims.global_rank(0, 0, 3)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "message"),
    [
        (12, 4, 8, r"12 attention heads, which 8 tensor-parallel ranks cannot split evenly.*\[1, 2, 3, 4, 6, 12\]"),
        (32, 4, 8, r"4 key/value heads \(grouped-query attention\), fewer key/value heads than the 8.*\[1, 2, 4\]"),
        (36, 6, 4, r"6 key/value heads.*not a multiple of the 4.*\[1, 2, 3, 6\]"),
    ],
)  # fmt: skip
def test_heads_that_tp_cannot_split_whole_are_refused(heads, kv_heads, tp, message):
    with pytest.raises(TensorParallelHeadsError, match=message):
        check_heads(heads, kv_heads, tp)


def test_heads_that_split_whole_pass():
    check_heads(32, 8, 8)
    check_heads(32, 32, 4)
    ParallelDims(8, tensor_parallel=2).check_heads(4, 2)


def test_parallelize_llama_refuses_gqa_with_fewer_kv_heads_than_lanes_before_touching_the_model():
    model = LlamaModel(LlamaConfig.preset("tiny"))  # 4 heads, 2 KV heads
    mesh = SimpleNamespace(ndim=1, size=lambda: 4)
    with pytest.raises(TensorParallelHeadsError, match="LlamaModel has 2 key/value heads"):
        parallelize_llama(model, mesh)
    with pytest.raises(ParallelDimsError, match="1-D tensor-parallel mesh"):
        parallelize_llama(model, SimpleNamespace(ndim=2, size=lambda: 4))
    assert parallelize_llama(model, SimpleNamespace(ndim=1, size=lambda: 1)) is model  # one lane: unchanged
    assert not any(type(p).__name__ == "DTensor" for p in model.parameters())


def _ring_plan() -> tuple[Plan, list[torch.Tensor]]:
    lengths = [9, 20]
    seqs = [torch.arange(s) % 7 for s in lengths]
    ring = (2, 0)  # plan (HDP) ranks, in ring order
    ranks = [[], [MicroBatch([Piece(0, ((0, 9),))])], []]
    for member, r in enumerate(ring):
        ranks[r].append(MicroBatch([Piece(1, tuple(zigzag.member_ranges(20, 2, member)))], ring=ring, item=0))
    plan = Plan(3, 32, "hand", lengths, ranks)
    plan.validate()
    return plan, seqs


def test_build_step_gives_ring_peers_as_the_global_ranks_of_this_lane():
    plan, seqs = _ring_plan()
    dims = ParallelDims(6, tensor_parallel=2)
    for lane in range(2):
        step = build_step(plan, 2, lambda j: seqs[j], ring_ranks=dims.lane_ranks(lane))
        (mb,) = step.micro_batches
        # HDP ranks 2 and 0 of lane t are global ranks 2 * 2 + t and 0 * 2 + t
        assert mb.layout.ring == (4 + lane, lane) and mb.layout.member == 0
    default = build_step(plan, 2, lambda j: seqs[j]).micro_batches[0]
    assert default.layout.ring == (2, 0)  # without ring_ranks the plan's ranks are global ranks
    assert torch.equal(default.input_ids, step.micro_batches[0].input_ids)  # the same data in every lane
    with pytest.raises(PackingError, match="ring_ranks names 2 global ranks for a plan of 3 ranks"):
        build_step(plan, 2, lambda j: seqs[j], ring_ranks=(0, 2))


def test_step_dataset_refuses_ring_ranks_of_another_length():
    from lightning_bytescale.data.loader import StepDataset

    with pytest.raises(DataError, match="ring_ranks names 2 global ranks for 3 HDP ranks"):
        StepDataset(store=None, samples=None, batching=None, rank=0, world_size=3, ring_ranks=(0, 1))


def test_clip_of_plain_gradients_equals_torch():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(b, 0.3)
    got = clip_grad_norm_(a, 0.3)
    assert float(got) == pytest.approx(float(expected), rel=1e-14)
    assert all(torch.allclose(p.grad, q.grad, rtol=0, atol=1e-15) for p, q in zip(a, b))
