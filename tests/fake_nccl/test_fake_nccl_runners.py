"""Every layout's step runner on fake NCCL: ``make_runner(layout)``'s ``run`` and ``sync``, as the strategy calls them.

One rank of a fake NCCL world per layout (plain HDP, the tensor-parallel mesh, pipelines with
and without tensor-parallel stages) runs a step in which its HDP rank got no micro-batch (the
tier cannot run autograd): the plan check, the gradient sum of its group and the step's
scalars, and for pipelines the loss broadcast and the agreement after the step, every one of
them on the GPU.  ``sync`` called again returns the first result (Lightning may call it from
``backward`` and again from the optimizer closure).
"""

from __future__ import annotations

import pytest
import torch
from _fake_nccl import fake_nccl

from lightning_bytescale.engine.batch import StepBatch
from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.parallel.dims import ParallelDims
from lightning_bytescale.parallel.layout import Layout, RunnerOptions, layout_class, make_runner
from lightning_bytescale.parallel.pipeline_batch import PipelineStepBatch
from lightning_bytescale.parallel.pipeline_stage import LlamaStage
from lightning_bytescale.parallel.tensor_parallel import parallelize_llama


def _model(mode, layout: Layout) -> torch.nn.Module:
    torch.manual_seed(0)
    model = mode.module_to_cuda(LlamaModel(LlamaConfig.preset("tiny", layers=2, tie_embeddings=False)))
    dims = layout.dims
    if dims.tensor_parallel > 1:
        parallelize_llama(model, layout.mesh.tp_mesh)
    if dims.pipeline > 1:
        model = LlamaStage(model, layout.stage, dims.pipeline)
    return model


def _batch(layout: Layout) -> StepBatch | PipelineStepBatch:
    dims = layout.dims
    step = StepBatch(
        [], num_global_tokens=0, num_tokens=0, digest="plan", step=4, stats={"world_size": dims.data_parallel}
    )
    if dims.pipeline == 1:
        return step
    counts = [0] * dims.data_parallel
    return PipelineStepBatch(step, [], capacity=8, stages=dims.pipeline, counts=counts, padding=0)


@pytest.mark.covers("engine/step_checks.py:start_plan_agreement:all_gather")
@pytest.mark.parametrize(
    ("world", "tp", "pp", "bucketed"),
    [
        pytest.param(4, 1, 1, False, id="plain", marks=pytest.mark.covers("engine/executor.py:allreduce_gradients:all_reduce")),
        pytest.param(
            4, 1, 1, True, id="plain-bucketed",
            marks=pytest.mark.covers("engine/grad_sync.py:BucketedGradSync._launch:all_reduce"),
        ),
        pytest.param(4, 2, 1, False, id="tensor-parallel"),
        pytest.param(
            4, 1, 2, False, id="pipeline",
            marks=pytest.mark.covers(
                "parallel/pipeline_step.py:agree_after_step:all_reduce",
                "parallel/pipeline_step.py:PipelineRunner._schedule_step:broadcast",
            ),
        ),
        pytest.param(8, 2, 2, False, id="pipeline-tensor-parallel"),
    ],
)  # fmt: skip
def test_every_layout_runs_its_step_through_its_runner_on_the_gpu(world, tp, pp, bucketed):
    with fake_nccl(world_size=world, rank=world - 1) as mode:
        cls = layout_class(tensor_parallel=tp, pipeline=pp)
        dims = ParallelDims(world, tensor_parallel=tp, pipeline=pp)
        layout = cls.of(
            cls.build_mesh(dims, device_type="cuda", timeout=None), world_size=world, rank=world - 1
        )
        model = _model(mode, layout)
        options = RunnerOptions(bucket_bytes=2**20 if bucketed else None, stop_requested=lambda: True)
        runner = make_runner(layout, model, options)
        step = runner.run(model, _batch(layout))
        result = runner.sync(step)
        again = runner.sync(step)
        runner.close()
        grads = [p.grad for p in model.parameters()]
    assert type(runner).__name__ == {Layout: "HDPRunner"}.get(
        cls, "PipelineRunner" if pp > 1 else "MeshRunner"
    )
    assert again is result and result.loss == 0.0 and result.stop_requested
    assert all(g is None for g in grads)  # no micro-batch: no gradient, as one process
