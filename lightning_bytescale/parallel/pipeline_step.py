"""The HDP step when every HDP rank is a pipeline: its own micro-batch count, torch's schedule, a sum per stage.

On a ``(pipeline, data_parallel, tensor_parallel)`` mesh
(:class:`~lightning_bytescale.parallel.dims.ParallelDims` with ``pipeline`` P > 1; a stage may be
sharded with :func:`~lightning_bytescale.parallel.tensor_parallel.parallelize_llama` before it is
split), one step on one rank (stage ``p`` of pipeline ``h``) is:

1. :func:`~lightning_bytescale.parallel.step.start_step_check`: the plan must have been made
   for the pipelines (``dims.data_parallel``), and every rank of the world compares plan
   digests, before any transfer.
2. A ``torch.distributed.pipelining.PipelineStage`` of this rank's
   :class:`~lightning_bytescale.parallel.pipeline_stage.LlamaStage` with static shapes (every
   micro-batch is padded to the capacity C), and a schedule built *for this pipeline's own
   micro-batch count* (``n_microbatches`` is fixed when a schedule is built):
   ``Schedule1F1B``, or ``ScheduleGPipe`` for a pipeline with fewer micro-batches than stages
   (1F1B refuses those), none for a pipeline without any.  ``scale_grads=False``: every
   micro-batch's loss is already divided by the global token count
   (:meth:`~lightning_bytescale.engine.batch.PackedMicroBatch.loss`), so the sum of the
   micro-batches' gradients is the gradient.  Only the last stage computes the loss.
   Transfers between stages run on the ``"pipeline"`` group.  A ring item across pipelines
   runs, at every stage, between that stage of its member pipelines on the global group
   (packed attention's point-to-point rings); it sits at the same micro-batch index on every
   member and every pipeline of such a plan runs 1F1B
   (:func:`~lightning_bytescale.parallel.pipeline_batch.build_pipeline_step`), which cannot
   deadlock (docs/pipelines.md).
3. :func:`~lightning_bytescale.engine.executor.sync_step` unchanged, on this stage's
   ``"data_parallel"`` group (stage ``p`` of every pipeline, in this TP lane): the stage's
   gradients (local shards of tensor-parallel ones,
   :class:`~lightning_bytescale.parallel.shards.LocalShards`, as in
   :func:`~lightning_bytescale.parallel.step.run_parallel_step`), the loss and the loss-token
   count of the last stages (checked against the global batch there), the reports; the lanes of
   a TP group stop together (:func:`~lightning_bytescale.parallel.step.agree_across_lanes`).  Then the last stage broadcasts the step's loss over its pipeline, so every rank's
   :class:`~lightning_bytescale.engine.executor.StepResult` holds it.

The result (:class:`PipelineStepResult`) also holds the stage's measured times: the wall
time of torch's ``schedule.step`` and the stage's compute inside it (its forwards, backwards
and, on the last stage, the loss), both taken on the host around torch's calls
(:class:`StageClock`; on CUDA with events read after the schedule, so nothing synchronises
inside it), whose ratio gives the stage's pipeline bubble.

With ``grad_owners`` (ZeRO-2 per stage) each gradient is reduced to its owner among the stage's
HDP ranks instead.  Step the optimizer of the stage's parameters afterwards.  Clipping by the
global norm over stages is not done here (docs/pipelines.md).  No process group is created after the mesh.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from lightning_bytescale.engine.comm_device import comm_device
from lightning_bytescale.engine.executor import LocalResult, MicroBatchResult, StepResult, sync_step
from lightning_bytescale.engine.finite import all_finite
from lightning_bytescale.engine.loss import IGNORE_INDEX, token_loss
from lightning_bytescale.parallel.dims import ParallelMesh
from lightning_bytescale.parallel.errors import ParallelDimsError
from lightning_bytescale.parallel.pipeline_batch import ONE_F_ONE_B, PipelineStepBatch
from lightning_bytescale.parallel.pipeline_stage import DecoderStage
from lightning_bytescale.parallel.shards import LocalShards
from lightning_bytescale.parallel.step import agree_across_lanes, start_step_check


def _device(pmesh: ParallelMesh) -> torch.device:
    device = torch.device(pmesh.mesh.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass
class PipelineStepResult(StepResult):
    """:class:`~lightning_bytescale.engine.executor.StepResult` plus this stage's measured times of the step.

    ``schedule_s`` is the wall time of torch's ``schedule.step`` on this rank, ``compute_s`` the
    stage's forwards, backwards and loss inside it (0 for a pipeline without micro-batches).
    """

    schedule_s: float = 0.0
    compute_s: float = 0.0

    @property
    def stage_bubble(self) -> float:
        """``1 - compute / schedule wall``: the share of the schedule this stage waited (0 without a schedule)."""
        return stage_bubble(self.compute_s, self.schedule_s)


def stage_bubble(compute_s: float, schedule_s: float) -> float:
    """A stage's pipeline bubble, ``1 - compute / schedule wall`` (0 for an empty schedule), as the benchmark defines it."""
    return 1.0 - compute_s / schedule_s if schedule_s > 0 else 0.0


class StageClock:
    """The schedule's wall time and the stage's compute in it, timed around torch's calls on this instance.

    On the host with ``perf_counter`` for a CPU stage; on CUDA with events recorded on the
    current stream around every forward, backward and loss, read after the schedule (no
    synchronisation inside it: the first read waits once for the step's last event).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.wall = 0.0
        self._host_compute = 0.0
        self._events: list[tuple[Any, Any]] = []

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                try:
                    return fn(*args, **kwargs)
                finally:
                    end.record()
                    self._events.append((begin, end))
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._host_compute += time.perf_counter() - t0

        return timed

    def attach(self, schedule: PipelineScheduleSingle) -> None:
        """Time this schedule's stage compute (its ``forward_one_chunk``, ``backward_one_chunk``, loss)."""
        stage = schedule._stage
        for owner, name in (
            (stage, "forward_one_chunk"),
            (stage, "backward_one_chunk"),
            (schedule, "_compute_loss"),
        ):
            if callable(getattr(owner, name, None)):  # torch's names: a release without one times the rest
                setattr(owner, name, self._timed(getattr(owner, name)))

    @property
    def compute(self) -> float:
        """Seconds of stage compute (CUDA: the events' elapsed times; read after the schedule)."""
        if not self._events:
            return self._host_compute
        self._events[-1][1].synchronize()
        return sum(begin.elapsed_time(end) for begin, end in self._events) / 1000.0


def build_schedule(
    module: DecoderStage, batch: PipelineStepBatch, pmesh: ParallelMesh, *, dtype: torch.dtype | None = None
) -> PipelineScheduleSingle | None:
    """This step's ``PipelineStage`` of ``module`` and its schedule for ``len(batch.micro_batches)``, or ``None``.

    Shapes are static (``[1, C]`` ids, ``[1, C, dim]`` activations in ``dtype``, default the
    stage's parameters' dtype, ``[1, C, vocab]`` logits), so torch infers nothing at run time.
    """
    name = batch.schedule_name
    if name is None:
        return None
    dims = pmesh.dims
    if module.stage != pmesh.stage or module.stages != dims.pipeline:
        raise ParallelDimsError(
            f"the stage module is stage {module.stage} of {module.stages} but this rank is stage {pmesh.stage} of "
            f"{dims.pipeline}; build the stage as e.g. LlamaStage(model, pmesh.stage, pmesh.dims.pipeline)"
        )
    c = batch.capacity
    dtype = dtype or next(module.parameters()).dtype
    # activations require grad: torch makes a stage's receive buffers from these (their gradient goes back)
    hidden = torch.empty(1, c, module.hidden_size, dtype=dtype, device="meta", requires_grad=True)
    inputs = torch.empty(1, c, dtype=torch.long, device="meta") if module.is_first else hidden
    outputs = (
        torch.empty(1, c, module.vocab_size, dtype=dtype, device="meta", requires_grad=True)
        if module.is_last
        else hidden
    )
    stage = PipelineStage(
        module,
        pmesh.stage,
        dims.pipeline,
        _device(pmesh),
        input_args=inputs,
        output_args=outputs,
        group=pmesh.pp_group,
    )
    num_global = batch.step.num_global_tokens

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss(logits[0], labels[0], num_global)

    schedule = Schedule1F1B if name == ONE_F_ONE_B else ScheduleGPipe
    return schedule(stage, len(batch.micro_batches), loss_fn=loss_fn, scale_grads=False)


def run_pipeline_step(
    module: DecoderStage,
    batch: PipelineStepBatch,
    pmesh: ParallelMesh,
    *,
    on_schedule: Callable[[PipelineScheduleSingle | None], None] | None = None,
    check_plan: bool = True,
    check_tokens: bool = True,
    check_finite: bool = True,
    grad_owners: Mapping[int, int] | None = None,
) -> PipelineStepResult:
    """One step of this rank's stage ``module`` of its pipeline's ``batch`` (module docstring).

    Gradients accumulate into ``p.grad`` of the stage's parameters (zero them before the step);
    afterwards they hold the gradient of the global token-mean loss.  ``on_schedule`` sees the
    schedule built for the step (``None`` for a pipeline without micro-batches).

    ``grad_owners`` (ZeRO-2 per stage: ``id(parameter) -> global rank`` of the HDP rank of this
    stage and lane that keeps its optimizer state) reduces each gradient to its owner over the
    stage's data-parallel group instead of summing it everywhere; the other ranks hold ``None``.
    Clip afterwards with ``clip_grad_norm_(..., group=pmesh.dp_group, pipeline_group=pmesh.pp_group)``.
    """
    start_step_check(batch.step, pmesh, check_plan=check_plan).wait()
    mbs = batch.micro_batches
    device = _device(pmesh)
    schedule = build_schedule(module, batch, pmesh)
    clock = StageClock(device)
    if schedule is not None:
        clock.attach(schedule)
    if on_schedule is not None:
        on_schedule(schedule)
    losses: list[torch.Tensor] = []
    start = time.perf_counter()
    if schedule is not None:
        module.bind(mbs)
        inputs = (torch.stack([mb.input_ids for mb in mbs]).to(device),) if module.is_first else ()
        target = torch.stack([mb.labels for mb in mbs]).to(device) if module.is_last else None
        slot = torch.arange(len(mbs))  # on the host: the stage reads it without a synchronisation
        try:
            schedule.step(*inputs, target=target, losses=losses, return_outputs=False, slot=slot)
        finally:
            module.bind(())
    seconds = time.perf_counter() - start
    if clock.cuda and schedule is not None:  # the host returned at the last launch: wait for the stage's work
        torch.cuda.current_stream(device).synchronize()
        seconds = time.perf_counter() - start
    shards = LocalShards([(n, p) for n, p in module.named_parameters() if p.requires_grad])
    tokens = [int((mb.labels != IGNORE_INDEX).sum()) if module.is_last else 0 for mb in mbs]
    values = [float(x.detach()) for x in losses] if losses else [0.0] * len(mbs)
    grads = [p.grad for _, p in shards.named if p.grad is not None]
    finite = all_finite(grads) if check_finite and mbs else None
    results = [
        MicroBatchResult(
            mb.index,
            values[i],
            tokens[i],
            seconds / len(mbs),  # the schedule's wall time, shared evenly: torch's schedule times no op
            mb.layout.ring_size,
            tuple(mb.seq_ids),
            None if finite is None or i < len(mbs) - 1 else bool(finite),
        )
        for i, mb in enumerate(mbs)
    ]
    local = LocalResult(
        loss=torch.tensor(sum(values), dtype=torch.float64), loss_tokens=sum(tokens), micro_batches=results
    )

    def sync() -> StepResult:
        synced = sync_step(
            shards.named,
            batch.step,
            local,
            group=pmesh.dp_group,
            check_tokens=check_tokens and module.is_last,
            check_finite=check_finite,
            owners=None if grad_owners is None else shards.rekey(grad_owners),
        )
        shards.write_back()
        return synced

    result = agree_across_lanes(sync, pmesh, batch.step.step)
    # sync_step returns the loss on the host: it travels on the pipeline group's device and back once
    loss = result.loss_tensor.reshape(1).to(comm_device(pmesh.pp_group), copy=True)
    dist.broadcast(loss, group=pmesh.pp_group, group_src=pmesh.dims.pipeline - 1)
    result.loss_tensor = loss.to(result.loss_tensor.device)[0]
    result.loss = float(result.loss_tensor)
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    return PipelineStepResult(**fields, schedule_s=seconds, compute_s=clock.compute)


__all__ = ["PipelineStepResult", "StageClock", "build_schedule", "run_pipeline_step", "stage_bubble"]
