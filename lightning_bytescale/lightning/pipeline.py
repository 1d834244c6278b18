"""``ByteScaleStrategy(pipeline_parallel_size=P)``: what running every HDP rank as a pipeline changes in the strategy.

The algorithm is on the torch floor (:mod:`lightning_bytescale.parallel`: the
``(pipeline, data_parallel, tensor_parallel)`` mesh, :class:`~lightning_bytescale.parallel.LlamaStage`,
:func:`~lightning_bytescale.parallel.build_pipeline_step`,
:func:`~lightning_bytescale.parallel.run_pipeline_step`); this module is the glue that puts it
under a Lightning ``Trainer`` (docs/pipelines.md, "Pipelines under the Trainer"):

* the options that cannot run with pipelines yet, refused by name at construction
  (:func:`check_options`) and at set-up (:func:`check_setup`);
* the user contract: ``configure_model`` replaces the model by its stage, one
  :class:`~lightning_bytescale.parallel.LlamaStage` holding every trained parameter
  (:func:`stage_of`);
* every rank starts from the parameters of HDP rank 0 *of its own stage* (:func:`broadcast_state`);
* the step: :func:`train` runs the whole step (torch's schedule, the loss at the last stage, the
  gradient sum per stage) where the strategy's ``training_step`` runs its micro-batch loop, so
  the ``LightningModule.training_step`` is not called under pipelines; every forward and loss
  of the stage runs under the precision plugin's ``train_step_context`` (autocast under
  ``"bf16-mixed"``), as ``training_step`` would, and the stage and schedule are kept between
  steps with the same micro-batch count (:func:`stage_schedules`);
* ZeRO-1/2 per stage: :class:`~lightning_bytescale.lightning.mesh.LaneZero` over the stage's
  data-parallel group (the strategy sets it up; ZeRO-2's owners go into the step's sync);
* after the step one all-reduce over the world agrees on the stop flag (preemption) and
  gives every rank every stage's measured times, from which ``step_stats`` get each
  pipeline's measured bubble (:func:`agree_after_step`, :func:`pipeline_stats`);
* clipping by the norm over every stage (:func:`~lightning_bytescale.lightning.mesh.clip_by_global_norm`);
* sharded checkpoints: each stage's optimizer groups merged over the pipeline
  (:func:`optimizer_state`), so the folder names every stage's parameters and each stage
  reads back only its own keys.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_bytescale.engine.executor import LocalResult
from lightning_bytescale.engine.state_sync import broadcast_tensors
from lightning_bytescale.errors import ConfigError
from lightning_bytescale.lightning import step as step_loop
from lightning_bytescale.lightning.checkpoint import sharded_optimizer_state
from lightning_bytescale.lightning.step_stats import step_stats
from lightning_bytescale.parallel import (
    DecoderStage,
    ParallelMesh,
    PipelineStepBatch,
    StageSchedules,
    run_pipeline_step,
)
from lightning_bytescale.parallel.layout import stage_of
from lightning_bytescale.parallel.pipeline_step import agree_after_step, pipeline_stats, refuse_evaluation

if TYPE_CHECKING:
    import lightning.pytorch as pl


def check_options(pipeline_parallel_size: Any, *, checkpoint_format: str) -> int:
    """``pipeline_parallel_size`` itself, and the options that cannot run with it yet (at construction)."""
    pp = pipeline_parallel_size
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ConfigError(f"pipeline_parallel_size must be a positive integer (1: no pipelines), got {pp!r}")
    if pp == 1:
        return pp
    if checkpoint_format == "consolidated":
        raise ConfigError(
            f"checkpoint_format='consolidated' is not supported with pipeline_parallel_size={pp}: every stage "
            "holds other parameters, so rank 0 alone cannot write the model. Use checkpoint_format='sharded' "
            "(or 'auto', which is sharded with pipelines)"
        )
    return pp


_NOT_WITH_PIPELINES = {
    "precision='16-mixed'": "a float16 GradScaler (precision='16-mixed') is not supported: the loss is computed "
    "inside torch's pipeline schedule, which the scaler does not see, and each stage's optimizer would decide on "
    "its own gradients whether to skip a step. Use precision='bf16-mixed' (no scaler), '32-true' or '64-true'",
    "empty_init=True": "the model has parameters on the meta device (Trainer.init_module(empty_init=True)); build "
    "it on the device in configure_model and replace it by its LlamaStage",
    "fully_shard": "configure_model applied fully_shard, which is not supported with pipelines yet: FSDP2's "
    "gathers and reduce-scatters are not driven inside torch's pipeline schedule. Remove fully_shard (each stage "
    "already holds only its own blocks)",
}


def check_precision(strategy: Any) -> None:
    """A float16 ``GradScaler`` (``precision="16-mixed"``) is refused: before the launch, and again at set-up."""
    if getattr(strategy.precision_plugin, "scaler", None) is not None:
        why = _NOT_WITH_PIPELINES["precision='16-mixed'"]
        raise ConfigError(f"pipeline_parallel_size={strategy.pipeline_parallel_size}: {why}")


def check_setup(strategy: Any, trainer: pl.Trainer) -> None:
    """What cannot run with pipelines yet, refused at set-up by the setting's name; the stage is checked."""
    pp = strategy.pipeline_parallel_size
    check_precision(strategy)
    if trainer.state.fn != TrainerFn.FITTING:
        raise ConfigError(
            f"trainer.{trainer.state.fn.value}() is not supported with pipeline_parallel_size={pp} yet: only "
            "training runs through the pipeline schedule. Evaluate with pipeline_parallel_size=1"
        )
    refusals = {
        "empty_init=True": any(p.is_meta for p in strategy.model.parameters()),
        "fully_shard": any(isinstance(m, FSDPModule) for m in strategy.model.modules()),
    }
    for setting, refused in refusals.items():
        if refused:
            raise ConfigError(f"pipeline_parallel_size={pp}: {_NOT_WITH_PIPELINES[setting]}")
    stage_of(strategy.model, strategy.parallel_mesh)


@torch.no_grad()
def broadcast_state(module: nn.Module, pmesh: ParallelMesh) -> None:
    """Every rank starts from HDP rank 0's parameters and buffers of its own stage (and lane).

    Plain tensors come from lane 0 of HDP rank 0 of the stage (over the TP group, then the
    stage's data-parallel group); DTensor shards from the same lane of HDP rank 0 of the stage.
    """
    tensors = list({id(t): t for t in (*module.parameters(), *module.buffers())}.values())
    plain = [t for t in tensors if not isinstance(t, DTensor)]
    dims, stage = pmesh.dims, pmesh.stage
    if dims.tensor_parallel > 1:
        broadcast_tensors(plain, src=dims.global_rank(pmesh.hdp_rank, 0, stage), group=pmesh.tp_group)
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    broadcast_tensors(local, src=dims.global_rank(0, pmesh.lane, stage), group=pmesh.dp_group)


def train(strategy: Any, batch: PipelineStepBatch) -> step_loop.TrainStep:
    """One optimizer step of this rank's stage: the schedule, the gradient sum per stage, the global loss.

    Returns the step with its result set and its gradients put aside (Lightning zeroes them
    between ``training_step`` and ``backward``, which puts them back).
    """
    module = strategy.lightning_module
    pmesh: ParallelMesh = strategy.parallel_mesh
    loop: step_loop.StepLoop = strategy._loop
    started = time.perf_counter()
    stage = stage_of(module, pmesh)
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    for _, p in named:
        p.grad = None
    loop.beat(f"the pipeline step {batch.step.step} (waits on every rank)", waits_on_peers=True)
    # the bucketed sync on the stage's data-parallel group (ZeRO-2's owners in it), or the flat one
    grad_sync = loop._bucketed_sync([p for p in stage.parameters() if p.requires_grad])
    owners = strategy._grad_owners if strategy.zero == 2 and grad_sync is None else None
    result = run_pipeline_step(
        stage,
        batch,
        pmesh,
        schedules=stage_schedules(strategy, stage),
        compute_context=strategy.precision_plugin.train_step_context,  # autocast under "bf16-mixed"
        check_finite=strategy.check_finite,
        grad_owners=owners,
        grad_sync=grad_sync,
    )
    preemption = strategy._preemption
    stop, times = agree_after_step(result, pmesh, preemption is not None and preemption.requested)
    if preemption is not None:
        preemption.record_agreement(stop)
    dtype = next(stage.parameters()).dtype
    local = LocalResult(loss=result.loss_tensor.detach(), loss_tokens=0)
    step = step_loop.TrainStep(batch.step, named, local, None, False, started, dtype, result=result)
    step.stats = {**step_stats(batch.step, result), **pipeline_stats(times, pmesh)}
    loop.steps_run += 1
    if strategy.log_loss:
        loop._log(strategy.loss_name, result.loss_tensor, on_step=True, prog_bar=True)
    step.put_aside()
    return step


def stage_schedules(strategy: Any, stage: DecoderStage) -> StageSchedules:
    """The strategy's :class:`StageSchedules` of ``stage``: kept between steps, bounded by the planner's ``max_micro_batches``."""
    schedules = strategy._stage_schedules
    if schedules is None or schedules.module is not stage or schedules.pmesh is not strategy.parallel_mesh:
        schedules = strategy._stage_schedules = StageSchedules(
            stage, strategy.parallel_mesh, max_micro_batches=strategy.planner_config.max_micro_batches
        )
    return schedules


def optimizer_state(optimizer: Optimizer, module: nn.Module, pmesh: ParallelMesh) -> dict[str, Any]:
    """This rank's state by parameter name, with each group's parameter names of every stage (a pipeline collective).

    Rank 0 writes the groups into ``meta.pt``; with them merged over the pipeline every stage
    finds its own parameters there on load.
    """
    state = sharded_optimizer_state(optimizer, module)
    names = [[*g["params"]] for g in state["param_groups"]]
    every: list[Any] = [None] * pmesh.dims.pipeline
    dist.all_gather_object(every, names, group=pmesh.pp_group)
    for g, group in enumerate(state["param_groups"]):
        group["params"] = [n for stage in every for n in stage[g]]
    return state


__all__ = [
    "agree_after_step",
    "broadcast_state",
    "check_options",
    "check_precision",
    "check_setup",
    "optimizer_state",
    "pipeline_stats",
    "refuse_evaluation",
    "stage_of",
    "stage_schedules",
    "train",
]
