"""The Lightning glue's, the Hugging Face module's and the profiler's collectives on fake NCCL.

The strategy's ``barrier`` / ``broadcast`` / ``reduce`` (``self.log(..., sync_dist=True)`` and
epoch metrics), the epoch-end agreement on metric keys, the pipeline strategy's agreement after
a step and its optimizer-state names over the stages, ``HFCausalLM``'s check that every rank
built the same model, the gradient sum over TP lanes of Hugging Face's replicated parameters
(its backward called directly: autograd cannot run on fake CUDA) and the profiler's group
reductions: each runs on this process as one rank of a fake NCCL world, where a host tensor in
any collective fails as on NCCL.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _fake_nccl import CUDA, fake_nccl
from torch import nn

from lightning_bytescale.parallel.dims import ParallelDims


@pytest.mark.covers("engine/comm_device.py:barrier:barrier")
def test_the_strategy_barrier_names_the_gpu():
    from lightning_bytescale import ByteScaleStrategy

    strategy = ByteScaleStrategy()
    with fake_nccl(world_size=2, rank=1):
        strategy.barrier("save")


@pytest.mark.covers("lightning/process_strategy.py:ProcessGroupStrategy.broadcast:broadcast_object_list")
def test_the_strategy_broadcasts_objects_on_the_gpu():
    from lightning_bytescale import ByteScaleStrategy

    strategy = ByteScaleStrategy()
    with fake_nccl(world_size=2, rank=0):
        out = strategy.broadcast({"path": "ckpt/last.ckpt"}, src=0)
    assert out == {"path": "ckpt/last.ckpt"}


@pytest.mark.covers("lightning/epoch_metrics.py:_all_reduce:all_reduce")
@pytest.mark.parametrize("on_gpu", [False, True], ids=["host-value", "gpu-value"])
def test_the_strategy_reduce_runs_on_the_gpu_whatever_the_value_lives_on(on_gpu):
    """``self.log(..., sync_dist=True)`` of a host value (a Python float Lightning made a tensor of) reduces on the GPU."""
    from lightning_bytescale import ByteScaleStrategy

    strategy = ByteScaleStrategy()
    with fake_nccl(world_size=2, rank=1) as mode:
        value = torch.tensor([3.0, 5.0])
        value = mode.cuda(value) if on_gpu else value
        total = strategy.reduce(value, reduce_op="sum")
        mean = strategy.reduce(torch.tensor(7), reduce_op="mean")  # an integer count: an exact float64 mean
        total_values = (mode.value(total) if on_gpu else total).tolist()
        mean_value = float(mean)
    assert total is value and total.device == value.device  # reduced in place, where it was
    assert total_values == [3.0, 5.0] and mean.dtype == torch.float64 and mean_value == 3.5


@pytest.mark.covers("lightning/epoch_metrics.py:agree_on_epoch_metrics:all_gather_object")
def test_the_epoch_end_agreement_gathers_on_the_gpu():
    from lightning_bytescale.lightning.epoch_metrics import agree_on_epoch_metrics

    trainer = SimpleNamespace(_results=None)  # nothing logged this epoch
    with fake_nccl(world_size=3, rank=2):
        extras = agree_on_epoch_metrics(trainer, None, lambda *a, **k: None, extra=(4.0, 2))
    assert extras == [(4.0, 2)] * 3


@pytest.mark.covers(
    "parallel/pipeline_step.py:agree_after_step:all_reduce",
    "lightning/checkpoint.py:PipelineCheckpoints.optimizer_state:all_gather_object",
)
def test_the_pipeline_strategy_agrees_after_the_step_and_names_every_stage_on_the_gpu():
    from lightning_bytescale.lightning.checkpoint import PipelineCheckpoints
    from lightning_bytescale.parallel.layout import PipelineLayout
    from lightning_bytescale.parallel.pipeline_step import agree_after_step

    with fake_nccl(world_size=4, rank=3) as mode:
        pmesh = ParallelDims(4, pipeline=2).build("cuda")
        result = SimpleNamespace(schedule_s=2.0, compute_s=1.5)
        stop, times = agree_after_step(result, pmesh, stop_requested=True)
        module = nn.Sequential(mode.module_to_cuda(nn.Linear(2, 2)))
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        layout = PipelineLayout.of(pmesh, world_size=4, rank=3)
        state = PipelineCheckpoints(2).optimizer_state(
            optimizer, module, sharded=True, layout=layout, default=optimizer.state_dict
        )
    assert stop and times.device.type == "cpu" and times[:, 3].tolist() == [2.0, 1.5]
    assert (
        state["param_groups"][0]["params"] == ["0.weight", "0.bias"] * 2
    )  # every stage's names (the same here)


@pytest.mark.covers("parallel/pipeline_step.py:agree_on_attention:all_reduce")
def test_the_pipeline_attention_check_agrees_on_the_gpu():
    from lightning_bytescale.engine.attention_check import AttentionVerdict
    from lightning_bytescale.parallel.pipeline_step import agree_on_attention

    with fake_nccl(world_size=4, rank=3):
        pmesh = ParallelDims(4, pipeline=2).build("cuda")
        verdict = agree_on_attention(0, [], pmesh)  # a fake group moves no data: no values checked
    assert isinstance(verdict, AttentionVerdict)


@pytest.mark.covers("hf/module.py:HFCausalLM._check_same_structure:all_gather_object")
def test_hf_module_checks_every_rank_built_the_same_model_on_the_gpu():
    transformers = pytest.importorskip("transformers")
    from lightning_bytescale.hf import HFCausalLM

    config = transformers.AutoConfig.for_model(
        "llama",
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_hidden_layers=1,
    )
    module = HFCausalLM(config, from_config=True)
    with fake_nccl(world_size=2, rank=1) as mode:
        module.model = mode.module_to_cuda(nn.Linear(4, 4))
        module._check_same_structure()  # every rank gathers the same digest here: no error


@pytest.mark.covers("hf/tensor_parallel.py:_SumOverLanes.backward:all_reduce")
def test_hf_replicated_parameters_sum_their_gradient_over_the_lanes_on_the_gpu():
    from lightning_bytescale.hf.tensor_parallel import _SumOverLanes

    with fake_nccl(world_size=2, rank=0) as mode:
        pmesh = ParallelDims(2, tensor_parallel=2).build("cuda")
        grad = mode.cuda(torch.arange(6.0).reshape(2, 3).t())  # not contiguous, as autograd may hand it
        out, none = _SumOverLanes.backward(SimpleNamespace(group=pmesh.tp_group), grad)
        values = mode.value(out).tolist()
    assert none is None and out.device == CUDA and values == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]


@pytest.mark.covers("profiler/group.py:group_reduce:all_reduce")
def test_the_profiler_reduces_a_tensor_parallel_groups_figures_on_the_gpu():
    from lightning_bytescale.profiler.group import group_reduce

    with fake_nccl(world_size=2, rank=1):
        assert group_reduce([1.5, 2.0], "max") == [1.5, 2.0]
        assert group_reduce([3.0], "min") == [3.0]
