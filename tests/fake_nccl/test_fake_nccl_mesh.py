"""The mesh's collectives on fake NCCL: tensor parallelism, pipelines, ZeRO on the mesh, checkpoints.

Each test builds the strategy's ``(pipeline, data_parallel, tensor_parallel)`` mesh with
``ParallelDims.build("cuda")`` on the fake NCCL world (its sub-groups made by
``init_device_mesh`` as on NCCL), a reference Llama on fake CUDA sharded by
``parallelize_llama`` where TP is on, gradients set by hand, and runs one piece: clipping over
DTensor shards (with ZeRO-2's data-parallel group and over the stages of a pipeline), a
gradient DTensor brought to its parameter's placements, the lanes' agreement after a step, the
pipeline step of a pipeline without micro-batches (the gradient sum per stage and the loss the
last stage broadcasts over its pipeline), the bucketed sync on the mesh with a gradient DTensor
in another placement than its parameter's (a TP partial sum, reduced over the lanes first),
ZeRO-1 on the mesh (its parameter broadcast after the step and the optimizer state it gathers
for a consolidated checkpoint, AdamW's ``step`` on the host), the consolidated checkpoint's
state functions and the parameter broadcast at set-up.
"""

from __future__ import annotations

import pytest
import torch
from _fake_nccl import CUDA, fake_nccl
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_bytescale.engine.batch import StepBatch
from lightning_bytescale.errors import StepError
from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.parallel import full_state
from lightning_bytescale.parallel import zero as zero_
from lightning_bytescale.parallel.dims import ParallelDims
from lightning_bytescale.parallel.layout import MeshLayout, PipelineLayout
from lightning_bytescale.parallel.tensor_parallel import parallelize_llama


def _llama(mode, pmesh=None, *, layers: int = 1) -> LlamaModel:
    """The tiny reference Llama on fake CUDA, sharded over the mesh's TP group when it has one."""
    torch.manual_seed(0)
    model = mode.module_to_cuda(LlamaModel(LlamaConfig.preset("tiny", layers=layers, tie_embeddings=False)))
    if pmesh is not None and pmesh.dims.tensor_parallel > 1:
        parallelize_llama(model, pmesh.tp_mesh)
    return model


def _ones_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # a DTensor like its parameter where it is one


@pytest.mark.covers("parallel/tensor_parallel.py:parallelize_llama:parallelize_module")
def test_tensor_parallel_set_up_shards_on_the_gpu():
    with fake_nccl(world_size=4, rank=3) as mode:
        pmesh = ParallelDims(4, tensor_parallel=2).build("cuda")
        model = _llama(mode, pmesh)
        wq = model.blocks[0].attn.wq.weight
        local = wq.to_local().shape  # inside the tier: autograd (outside no_grad) cannot run on fake CUDA
    assert isinstance(wq, DTensor) and wq.device == CUDA and local == (16, 32)


@pytest.mark.covers("parallel/clip.py:_held_norm:full_tensor")
@pytest.mark.parametrize(
    "zero2",
    [
        pytest.param(False, id="replicated"),
        pytest.param(True, id="zero2", marks=pytest.mark.covers("parallel/clip.py:_combined:all_reduce")),
    ],
)
def test_clipping_over_dtensor_shards_on_the_gpu(zero2):
    from lightning_bytescale.parallel.clip import clip_grad_norm_

    with fake_nccl(world_size=4, rank=2) as mode:
        pmesh = ParallelDims(4, tensor_parallel=2).build("cuda")
        model = _llama(mode, pmesh)
        _ones_grads(model)
        held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
        total = clip_grad_norm_(list(model.parameters()), 1.0, group=pmesh.dp_group if zero2 else None)
        norm = float(total)
    # the tier's other ranks add nothing to a sum: the norm of what this rank holds
    assert total.device == CUDA and norm == pytest.approx(held**0.5)


@pytest.mark.covers("parallel/clip.py:_combined:all_reduce")
def test_clipping_over_the_stages_of_a_pipeline_on_the_gpu():
    from lightning_bytescale.parallel.clip import clip_grad_norm_
    from lightning_bytescale.parallel.pipeline_stage import LlamaStage

    with fake_nccl(world_size=4, rank=1) as mode:
        pmesh = ParallelDims(4, pipeline=2).build("cuda")
        stage = LlamaStage(_llama(mode, layers=2), pmesh.stage, 2)
        _ones_grads(stage)
        total = clip_grad_norm_(list(stage.parameters()), 1.0, pipeline_group=pmesh.pp_group)
    assert total.device == CUDA


@pytest.mark.covers("parallel/shards.py:LocalShards.__init__:redistribute")
def test_a_partial_gradient_is_reduce_scattered_to_its_shard_on_the_gpu():
    from lightning_bytescale.parallel.shards import LocalShards

    with fake_nccl(world_size=2, rank=1) as mode:
        pmesh = ParallelDims(2, tensor_parallel=2).build("cuda")
        weight = nn.Parameter(
            DTensor.from_local(mode.cuda(torch.ones(3, 4)), pmesh.tp_mesh, [Shard(0)], run_check=False)
        )
        weight.grad = DTensor.from_local(
            mode.cuda(torch.ones(6, 4)), pmesh.tp_mesh, [Partial()], run_check=False
        )
        shards = LocalShards([("w", weight)])
        ((name, proxy),) = shards.named
        placements = weight.grad.placements
    assert placements == (Shard(0),) and proxy.grad.shape == (3, 4) and proxy.grad.device == CUDA


@pytest.mark.covers(
    "engine/grad_sync.py:_local_grad:redistribute",
    "engine/grad_sync.py:BucketedGradSync._launch:all_reduce",
)
def test_the_bucketed_sync_on_the_mesh_reduces_a_partial_gradient_over_the_lanes_on_the_gpu():
    """A DTensor gradient in another placement than its parameter's (a TP partial sum) is reduced over the lanes first.

    Then it is summed over the data-parallel group: in place for a parameter of a bucket of its
    own, copied into its bucket's view for one that shares a bucket (autograd replaced the view).
    """
    from lightning_bytescale.engine.grad_sync import BucketedGradSync

    g = torch.Generator().manual_seed(0)
    whole, norm_sum = torch.randn(8, 8, generator=g), torch.randn(8, generator=g)
    with fake_nccl(world_size=4, rank=3) as mode:
        pmesh = ParallelDims(4, tensor_parallel=2).build("cuda")
        tp, lane = pmesh.tp_mesh, pmesh.tp_mesh.get_local_rank()

        def param(t: torch.Tensor, placement) -> nn.Parameter:
            return nn.Parameter(DTensor.from_local(mode.cuda(t), tp, [placement], run_check=False))

        weight = param(torch.zeros(4, 8), Shard(0))  # 32 floats: a bucket of its own
        norm = param(torch.zeros(8), Replicate())
        bias = param(torch.zeros(2), Shard(0))
        sync = BucketedGradSync(
            [bias, norm, weight], group=pmesh.dp_group, bucket_bytes=100, first_bucket_bytes=100
        )
        sync.prepare()
        weight.grad = DTensor.from_local(mode.cuda(whole), tp, [Partial()], run_check=False)
        norm.grad = DTensor.from_local(mode.cuda(norm_sum), tp, [Partial()], run_check=False)
        for p in (bias, norm, weight):
            sync._produced.add(id(p))  # what the last backward would have recorded
        sync.launch()
        sync.finish()
        sync.close()
        grads = [p.grad for p in (weight, norm)]
        values = [mode.value(gr.to_local()).clone() for gr in grads]
        (shared,) = [b for b in sync.buckets if any(p is norm for p in b.params)]
        in_bucket = norm.grad.to_local().data_ptr() in {v.data_ptr() for v in shared.views if v is not None}
        devices = {gr.to_local().device for gr in grads}
    assert [gr.placements for gr in grads] == [(Shard(0),), (Replicate(),)] and devices == {CUDA}
    # the tier's other ranks add nothing: this lane's rows of its partial sum, and the norm's own
    assert torch.equal(values[0], whole[4 * lane : 4 * lane + 4]) and torch.equal(values[1], norm_sum)
    assert in_bucket  # the sum was copied into the bucket and the gradient is its view again


@pytest.mark.covers("parallel/step.py:agree_across_lanes:all_reduce")
def test_the_lanes_agree_on_the_gpu():
    from lightning_bytescale.parallel.step import agree_across_lanes

    class Result:
        stop_requested = True

    with fake_nccl(world_size=4, rank=1) as mode:
        pmesh = ParallelDims(4, tensor_parallel=2).build("cuda")
        result = agree_across_lanes(lambda: Result(), pmesh, 5)
        with pytest.raises(StepError, match="boom"):
            agree_across_lanes(lambda: (_ for _ in ()).throw(StepError("boom")), pmesh, 5)
        d2h = [s for s in mode.syncs if s.kind == "a device-to-host copy"]
    assert result.stop_requested and len(d2h) == 2  # one flag read per agreement


def _empty_pipeline(pmesh, tokens: int):
    from lightning_bytescale.parallel.pipeline_batch import PipelineStepBatch

    step = StepBatch(
        [],
        num_global_tokens=tokens,
        num_tokens=tokens,
        digest="plan",
        step=2,
        stats={"world_size": pmesh.dims.data_parallel},
    )
    return PipelineStepBatch(
        step, [], capacity=8, stages=pmesh.dims.pipeline, counts=[0] * pmesh.dims.data_parallel, padding=0
    )


@pytest.mark.covers(
    "parallel/pipeline_step.py:PipelineRunner._schedule_step:broadcast",
    "engine/executor.py:allreduce_gradients:all_reduce",
)
@pytest.mark.parametrize(
    "rank",
    [
        pytest.param(1, id="first-stage"),
        pytest.param(3, id="last-stage"),
    ],
)
def test_a_pipeline_without_micro_batches_sums_and_broadcasts_its_loss_on_the_gpu(rank):
    """A pipeline that got no micro-batch still joins the gradient sum of its stage and the loss broadcast."""
    from lightning_bytescale.parallel.pipeline_stage import LlamaStage
    from lightning_bytescale.parallel.pipeline_step import run_pipeline_step

    with fake_nccl(world_size=4, rank=rank) as mode:
        pmesh = ParallelDims(4, pipeline=2).build("cuda")
        stage = LlamaStage(_llama(mode, layers=2), pmesh.stage, 2)
        result = run_pipeline_step(stage, _empty_pipeline(pmesh, 0), pmesh, check_plan=False)
        grads = [p.grad for p in stage.parameters()]
    assert result.loss == 0.0 and result.loss_tensor.device.type == "cpu"
    assert grads and all(g is None for g in grads)  # no rank made a gradient: None, as one process


@pytest.mark.covers(
    "engine/step_checks.py:start_plan_agreement:all_gather",
    "parallel/step.py:agree_across_lanes:all_reduce",
    "parallel/pipeline_step.py:PipelineRunner._schedule_step:broadcast",
)
def test_a_pipeline_step_with_tensor_parallel_stages_checks_its_plan_on_the_gpu():
    from lightning_bytescale.parallel.pipeline_stage import LlamaStage
    from lightning_bytescale.parallel.pipeline_step import run_pipeline_step

    with fake_nccl(world_size=8, rank=6) as mode:
        pmesh = ParallelDims(8, tensor_parallel=2, pipeline=2).build("cuda")
        stage = LlamaStage(_llama(mode, pmesh, layers=2), pmesh.stage, 2)
        result = run_pipeline_step(stage, _empty_pipeline(pmesh, 0), pmesh)
    assert pmesh.stage == 1 and result.loss == 0.0


@pytest.mark.covers("engine/step_checks.py:start_plan_agreement:all_gather")
def test_a_pipeline_evaluates_its_forward_only_step_after_the_plan_check_on_the_gpu():
    """``PipelineRunner.evaluate``: the plan check on the GPU, then no gradient and no sync (a pipeline without micro-batches)."""
    from lightning_bytescale.engine.runner import Compute
    from lightning_bytescale.parallel.layout import RunnerOptions
    from lightning_bytescale.parallel.pipeline_stage import LlamaStage

    with fake_nccl(world_size=4, rank=3) as mode:
        pmesh = ParallelDims(4, pipeline=2).build("cuda")
        model = LlamaStage(_llama(mode, layers=2), pmesh.stage, 2)
        runner = PipelineLayout.of(pmesh, world_size=4, rank=3).make_runner(model, RunnerOptions())
        local = runner.evaluate(model, _empty_pipeline(pmesh, 0), compute=Compute(forward_only=True))
        grads = [p.grad for p in model.parameters()]
    assert float(local.loss) == 0.0 and local.loss_tokens == 0
    assert all(g is None for g in grads)


def _lane_zero(mode, world: int, rank: int):
    pmesh = ParallelDims(world, tensor_parallel=2).build("cuda")
    model = _llama(mode, pmesh)
    _ones_grads(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    (zero,) = zero_.lane_zero([optimizer], pmesh, level=1)
    optimizer.step()  # the owners step, then broadcast their parameters over the lane
    return pmesh, model, optimizer, zero


@pytest.mark.covers(
    "parallel/zero.py:LaneZero.materialize:broadcast_object_list",
    "engine/state_sync.py:broadcast_tensors:broadcast",
)
def test_zero1_on_the_mesh_gathers_adamw_state_with_its_host_step_on_the_gpu():
    """AdamW keeps ``step`` on the host: materialising the lane's state broadcasts it through the GPU."""
    with fake_nccl(world_size=2, rank=1) as mode:
        pmesh, model, optimizer, zero = _lane_zero(mode, 2, 1)
        zero.materialize()
        steps = [optimizer.state[p]["step"] for p in model.parameters()]
        exp_avg = [optimizer.state[p]["exp_avg"] for p in model.parameters()]
    assert len(steps) == len(list(model.parameters()))
    assert {s.device.type for s in steps} == {"cpu"} and {float(s) for s in steps} == {1.0}
    assert {e.device for e in exp_avg} == {CUDA}


def test_a_non_owner_makes_room_for_the_state_where_the_owner_keeps_it():
    """AdamW's moments of a DTensor parameter: DTensors like it; its ``step``: a host scalar; a plain one's: its device."""
    from lightning_bytescale.parallel.zero import _StateTensor

    with fake_nccl(world_size=2) as mode:
        pmesh = ParallelDims(2, tensor_parallel=2).build("cuda")
        sharded = nn.Parameter(
            DTensor.from_local(mode.cuda(torch.zeros(3, 2)), pmesh.tp_mesh, [Shard(0)], run_check=False)
        )
        plain = nn.Parameter(mode.cuda(torch.zeros(4)))
        moment = _StateTensor.of(torch.zeros_like(sharded)).zeros_like(sharded)
        step = _StateTensor.of(torch.tensor(4.0)).zeros_like(sharded)
        plain_moment = _StateTensor.of(torch.zeros_like(plain)).zeros_like(plain)
        local = moment.to_local().shape
    assert isinstance(moment, DTensor) and moment.placements == (Shard(0),) and local == (3, 2)
    assert step.device.type == "cpu" and step.shape == () and not isinstance(step, DTensor)
    assert (
        plain_moment.device == CUDA and plain_moment.shape == (4,) and not isinstance(plain_moment, DTensor)
    )


def test_on_the_host_a_non_owner_still_makes_dtensor_moments():
    """On gloo every tensor is on the host: a moment of a DTensor parameter is still a DTensor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_bytescale.parallel.zero import _StateTensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = nn.Parameter(DTensor.from_local(torch.zeros(3, 2), mesh, [Shard(0)]))
        moment = _StateTensor.of(torch.zeros_like(sharded)).zeros_like(sharded)
        step = _StateTensor.of(torch.tensor(1.0)).zeros_like(sharded)
    finally:
        dist.destroy_process_group()
    assert isinstance(moment, DTensor) and not isinstance(step, DTensor) and step.shape == ()


@pytest.mark.covers(
    "parallel/full_state.py:model_state:get_model_state_dict",
    "parallel/full_state.py:optimizer_state:get_optimizer_state_dict",
    "parallel/full_state.py:load_model_state:set_model_state_dict",
    "parallel/full_state.py:load_optimizer_states:set_optimizer_state_dict",
    "parallel/full_state.py:full_state_dict:full_tensor",
)
@pytest.mark.parametrize(
    "zero",
    [
        pytest.param(False, id="plain"),
        pytest.param(
            True,
            id="zero1",
            marks=pytest.mark.covers("parallel/zero.py:LaneZero.materialize:broadcast_object_list"),
        ),
    ],
)
def test_consolidated_checkpoint_state_round_trips_on_the_gpu(zero):
    with fake_nccl(world_size=2, rank=0) as mode:
        if zero:
            pmesh, model, optimizer, _ = _lane_zero(mode, 2, 0)
        else:
            pmesh = ParallelDims(2, tensor_parallel=2).build("cuda")
            model = _llama(mode, pmesh)
            _ones_grads(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
            optimizer.step()
        weights = full_state.model_state(model)
        state = full_state.optimizer_state(model, optimizer)
        whole = full_state.full_state_dict(model)
        full_state.load_model_state(model, {k: v.cpu() for k, v in weights.items()}, strict=True)
        full_state.load_optimizer_states(model, [optimizer], [state])
        wq = model.blocks[0].attn.wq.weight
        local = wq.to_local().shape
    assert weights["blocks.0.attn.wq.weight"].shape == (32, 32)  # whole
    assert whole["blocks.0.attn.wq.weight"].shape == (32, 32)
    assert isinstance(wq, DTensor) and local == (16, 32)  # this rank's shard again
    assert set(state["state"]) == {n for n, _ in model.named_parameters()}


@pytest.mark.covers("engine/state_sync.py:broadcast_tensors:broadcast")
@pytest.mark.parametrize(("world", "tp", "pp"), [(4, 2, 1), (8, 2, 2)], ids=["tensor-parallel", "pipeline"])
def test_the_setup_broadcast_on_the_mesh_runs_on_the_gpu(world, tp, pp):
    from lightning_bytescale.parallel.pipeline_stage import LlamaStage

    with fake_nccl(world_size=world, rank=world - 1) as mode:
        pmesh = ParallelDims(world, tensor_parallel=tp, pipeline=pp).build("cuda")
        model = _llama(mode, pmesh, layers=2)
        if pp > 1:
            stage = LlamaStage(model, pmesh.stage, pp)
            stage.register_buffer("host_table", torch.arange(3.0))  # a buffer kept on the host
            PipelineLayout.of(pmesh, world_size=world, rank=world - 1).broadcast_state(stage)
        else:
            model.register_buffer("host_table", torch.arange(3.0))
            MeshLayout.of(pmesh, world_size=world, rank=world - 1).broadcast_state(model)
