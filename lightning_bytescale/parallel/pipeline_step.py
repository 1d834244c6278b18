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
   (1F1B refuses those), none for a pipeline without any; kept for the next step with the same
   count (:class:`StageSchedules`: torch allocates a stage's receive buffers for every
   micro-batch once per stage).  The stage's forwards and the loss run under the caller's
   compute context (the precision plugin's autocast under the Trainer), the last stage's
   logits declared in the autocast dtype.  ``scale_grads=False``: every
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
   :class:`~lightning_bytescale.engine.executor.StepResult` holds it.  With a
   :class:`~lightning_bytescale.engine.grad_sync.BucketedGradSync` over the stage's
   data-parallel group (``grad_sync``, the strategy's default) the stage's gradients are summed
   in buckets launched from the hooks of its last backward, as on the mesh without pipelines:
   1F1B and GPipe run a stage's backwards in micro-batch order, so the last one is that of the
   last micro-batch, and a hook on that forward's output arms the sync when its gradient arrives
   (not when that micro-batch is a ring item: the buckets then go after the schedule, the rule
   of docs/engine.md).  A stage's buckets are issued before its last gradient send to the stage
   before it, which issues its own (on its own data-parallel group) only after receiving it, and
   the ranks of one data-parallel group launch the same buckets in the same order, so the issue
   orders of the stages' groups and the pipeline's transfers agree on every rank.

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

import contextlib
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.utils.hooks import RemovableHandle

from lightning_bytescale.engine.attention_check import (
    AttentionVerdict,
    check_attention,
    kind_of,
    pipeline_verdict,
)
from lightning_bytescale.engine.batch import PackedMicroBatch
from lightning_bytescale.engine.comm_device import comm_device
from lightning_bytescale.engine.executor import sync_step
from lightning_bytescale.engine.finite import all_finite
from lightning_bytescale.engine.grad_sync import BucketedGradSync
from lightning_bytescale.engine.loss import IGNORE_INDEX, token_loss
from lightning_bytescale.engine.results import LocalResult, MicroBatchResult, StepResult
from lightning_bytescale.engine.runner import (
    DEFAULT_CHECKS,
    DEFAULT_COMPUTE,
    FLAT_SYNC,
    Compute,
    InFlight,
    NamedParams,
    SyncOptions,
    trained,
)
from lightning_bytescale.engine.step_checks import StepChecks
from lightning_bytescale.errors import ConfigError
from lightning_bytescale.packed_attention import count_attention_calls
from lightning_bytescale.packed_attention.input_dtype import autocast_dtype
from lightning_bytescale.parallel.dims import ParallelMesh
from lightning_bytescale.parallel.errors import ParallelDimsError
from lightning_bytescale.parallel.pipeline_batch import GPIPE, ONE_F_ONE_B, PipelineStepBatch
from lightning_bytescale.parallel.pipeline_stage import DecoderStage
from lightning_bytescale.parallel.shards import LocalShards
from lightning_bytescale.parallel.step import agree_across_lanes, check_grad_sync, start_step_check


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
    """The schedule's wall time and the stage's compute in it, timed around torch's calls.

    On the host with ``perf_counter`` for a CPU stage; on CUDA with events recorded on the
    current stream around every forward, backward and loss, read after the schedule (no
    synchronisation inside it: the first read waits once for the step's last event).  The
    stage's :class:`TimedStage` and its :class:`TokenLoss` time themselves with the clock of the
    step they run in (:meth:`timing`); nothing of torch's is patched, so the clock holds no
    reference to a stage and a stage none to the clock after its step.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.wall = 0.0
        self._host_compute = 0.0
        self._events: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        """Count the time of the code inside as stage compute."""
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((begin, end))
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._host_compute += time.perf_counter() - t0

    @property
    def compute(self) -> float:
        """Seconds of stage compute (CUDA: the events' elapsed times; read after the schedule)."""
        if not self._events:
            return self._host_compute
        self._events[-1][1].synchronize()
        return sum(begin.elapsed_time(end) for begin, end in self._events) / 1000.0


ComputeContext = Callable[[], AbstractContextManager[Any]]


@dataclass
class StepScope:
    """What one step lends a cached stage and its loss: the clock, the compute context, the global token count.

    ``context`` is entered around every forward and every loss of the stage, never around a
    backward: Lightning enters its precision plugin's ``train_step_context`` (autocast under
    ``"bf16-mixed"``) around ``training_step`` and runs the backward outside it.
    :func:`run_pipeline_step` sets the fields before the schedule and resets them after it.
    """

    clock: StageClock | None = None
    context: ComputeContext = contextlib.nullcontext
    num_global_tokens: int = 1

    @contextlib.contextmanager
    def compute(self, *, forward: bool) -> Iterator[None]:
        """The stage's compute: timed by the step's clock, a forward (or the loss) under the step's context."""
        with contextlib.ExitStack() as stack:
            if forward:
                stack.enter_context(self.context())
            if self.clock is not None:
                stack.enter_context(self.clock.timing())
            yield

    def reset(self) -> None:
        self.clock, self.context = None, contextlib.nullcontext


class TimedStage(PipelineStage):
    """torch's ``PipelineStage`` whose forwards and backwards run in its :class:`StepScope` (timed, forwards under the context).

    A subclass rather than wrappers stored on the instance: a wrapper of a bound method kept on
    its own object is a reference cycle, which kept every step's stage and its receive buffers
    alive until a full garbage collection.
    """

    def __init__(self, *args: Any, scope: StepScope, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scope = scope

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self.scope.compute(forward=True):
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self.scope.compute(forward=False):
            return super().backward_one_chunk(*args, **kwargs)


class TokenLoss:
    """The last stage's loss: a micro-batch's token cross-entropy sum over the step's global token count.

    The count comes from the :class:`StepScope` (it changes every step while the schedule is
    reused); the loss runs under the step's compute context, as Lightning computes the loss
    inside ``training_step``.
    """

    def __init__(self, scope: StepScope) -> None:
        self.scope = scope

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self.scope.compute(forward=True):
            return token_loss(logits[0], labels[0], self.scope.num_global_tokens)


@dataclass(frozen=True)
class ScheduleKey:
    """What determines a stage and its schedule: reused while these repeat (the stage module and mesh are the cache's)."""

    micro_batches: int
    schedule: str
    capacity: int
    dtype: torch.dtype
    output_dtype: torch.dtype


@dataclass
class StageSchedule:
    """A ``PipelineStage`` of the stage module, its schedule, and the step scope both read."""

    key: ScheduleKey
    stage: TimedStage
    schedule: PipelineScheduleSingle
    scope: StepScope


def logits_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the last stage's logits from parameters in ``dtype``: autocast's under autocast (float64 stays)."""
    target = autocast_dtype(device.type)
    return target if target is not None and dtype != torch.float64 else dtype


def _schedule_key(
    module: DecoderStage, batch: PipelineStepBatch, dtype: torch.dtype | None, out: torch.dtype | None
):
    name = batch.schedule_name
    if name is None:
        return None
    dtype = dtype or next(module.parameters()).dtype
    return ScheduleKey(len(batch.micro_batches), name, batch.capacity, dtype, out or dtype)


def _build(
    module: DecoderStage, key: ScheduleKey, pmesh: ParallelMesh, *, forward_only: bool = False
) -> StageSchedule:
    dims = pmesh.dims
    if module.stage != pmesh.stage or module.stages != dims.pipeline:
        raise ParallelDimsError(
            f"the stage module is stage {module.stage} of {module.stages} but this rank is stage {pmesh.stage} of "
            f"{dims.pipeline}; build the stage as e.g. LlamaStage(model, pmesh.stage, pmesh.dims.pipeline)"
        )
    c = key.capacity
    # activations require grad (but for a forward-only schedule): torch makes a stage's receive buffers
    # from these (their gradient goes back)
    grad = not forward_only
    hidden = torch.empty(1, c, module.hidden_size, dtype=key.dtype, device="meta", requires_grad=grad)
    inputs = torch.empty(1, c, dtype=torch.long, device="meta") if module.is_first else hidden
    outputs = (
        torch.empty(1, c, module.vocab_size, dtype=key.output_dtype, device="meta", requires_grad=grad)
        if module.is_last
        else hidden
    )
    scope = StepScope()
    stage = TimedStage(
        module,
        pmesh.stage,
        dims.pipeline,
        _device(pmesh),
        input_args=inputs,
        output_args=outputs,
        group=pmesh.pp_group,
        scope=scope,
    )
    schedule_cls = Schedule1F1B if key.schedule == ONE_F_ONE_B else ScheduleGPipe
    loss_fn = None if forward_only else TokenLoss(scope)  # without one, torch's schedule runs no backward
    schedule = schedule_cls(stage, key.micro_batches, loss_fn=loss_fn, scale_grads=False)
    return StageSchedule(key, stage, schedule, scope)


def build_schedule(
    module: DecoderStage,
    batch: PipelineStepBatch,
    pmesh: ParallelMesh,
    *,
    dtype: torch.dtype | None = None,
    output_dtype: torch.dtype | None = None,
) -> PipelineScheduleSingle | None:
    """A ``PipelineStage`` of ``module`` and its schedule for ``len(batch.micro_batches)``, or ``None``.

    Shapes are static (``[1, C]`` ids, ``[1, C, dim]`` activations in ``dtype``, default the
    stage's parameters' dtype, ``[1, C, vocab]`` logits in ``output_dtype``, default ``dtype``:
    give the autocast dtype under autocast, :func:`logits_dtype`), so torch infers nothing at run
    time.  The loss reads the global token count of the step's :class:`StepScope`
    (``schedule._stage.scope``); :func:`run_pipeline_step` sets it.
    """
    key = _schedule_key(module, batch, dtype, output_dtype)
    return None if key is None else _build(module, key, pmesh).schedule


class StageSchedules:
    """This rank's stages and schedules, kept from step to step where the micro-batch count repeats.

    torch's ``PipelineStage`` allocates its activation and output-gradient receive buffers
    (``[1, C, dim]`` each) for every micro-batch the first time its schedule runs; a stage and
    its schedule built again every step allocate them again every step (and, on torch 2.13,
    vote over the pipeline again).  :meth:`get` returns the cached pair of the step's
    :class:`ScheduleKey` or builds it.  The cache never holds more micro-batches' buffers than
    ``max_micro_batches`` (the planner's limit on one pipeline's count, which the memory
    accounting counts, :func:`~lightning_bytescale.planner.pipeline.receive_buffer_bytes`), or
    without one more than the step's own count: the least recently used pairs are dropped
    before a new one is built.  One cache serves one stage module on one mesh.
    """

    def __init__(
        self, module: DecoderStage, pmesh: ParallelMesh, *, max_micro_batches: int | None = None
    ) -> None:
        self.module, self.pmesh = module, pmesh
        self.max_micro_batches = max_micro_batches
        self._entries: OrderedDict[ScheduleKey, StageSchedule] = OrderedDict()
        self.built = 0

    @property
    def held_micro_batches(self) -> int:
        """Micro-batches whose receive buffers the cached stages hold."""
        return sum(key.micro_batches for key in self._entries)

    def get(
        self,
        batch: PipelineStepBatch,
        *,
        dtype: torch.dtype | None = None,
        output_dtype: torch.dtype | None = None,
    ) -> StageSchedule | None:
        """The stage and schedule of this step (``None`` for a pipeline without micro-batches)."""
        key = _schedule_key(self.module, batch, dtype, output_dtype)
        if key is None:
            return None
        entry = self._entries.pop(key, None)
        if entry is None:
            limit = max(key.micro_batches, self.max_micro_batches or 0)
            while self._entries and self.held_micro_batches + key.micro_batches > limit:
                self._entries.popitem(last=False)
            entry = _build(self.module, key, self.pmesh)
            self.built += 1
        self._entries[key] = entry
        return entry

    def clear(self) -> None:
        """Drop every cached stage and schedule (their receive buffers with them)."""
        self._entries.clear()


def arm_for_last_backward(
    module: DecoderStage, grad_sync: BucketedGradSync, last_slot: int
) -> RemovableHandle:
    """Arm ``grad_sync`` when the backward of micro-batch ``last_slot`` reaches this stage (remove the handle after the step).

    The stage's forward of that micro-batch (its ``slot`` keyword) gets a hook on its output,
    which runs when that output's gradient arrives: the start of the stage's backward of it, the
    last one of the step under 1F1B and GPipe.
    """

    def on_forward(_module: nn.Module, _args: Any, kwargs: dict[str, Any], output: Any) -> None:
        slot = kwargs.get("slot")
        out = output if isinstance(output, torch.Tensor) else None
        if (
            slot is not None
            and int(slot.reshape(-1)[0]) == last_slot
            and out is not None
            and out.requires_grad
        ):
            out.register_hook(lambda _grad: grad_sync.arm())

    return module.register_forward_hook(on_forward, with_kwargs=True)


@contextlib.contextmanager
def _evaluation_losses(
    module: DecoderStage, micro_batches: Sequence[PackedMicroBatch], losses: list[torch.Tensor]
) -> Iterator[None]:
    """On the last stage, each forward's token loss appended to ``losses`` as its logits come out.

    ``token_loss(logits, mb.labels, mb.num_global_tokens)`` of the micro-batch in the forward's
    ``slot``, detached: the forward-only schedule keeps no output (``return_outputs=False``), so
    only this scalar outlives the forward.  Other stages: nothing.
    """
    if not module.is_last:
        yield
        return

    def on_forward(_module: nn.Module, _args: Any, kwargs: dict[str, Any], output: Any) -> None:
        mb = micro_batches[int(kwargs["slot"].reshape(-1)[0])]
        labels = mb.labels.to(output.device)
        losses.append(token_loss(output[0], labels, mb.num_global_tokens).detach())

    handle = module.register_forward_hook(on_forward, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


class PipelineRunner:
    """The step runner when every HDP rank is a pipeline: torch's schedule, the gradient sum per stage, the loss.

    ``stage`` is this rank's stage module (:class:`~lightning_bytescale.parallel.pipeline_stage.DecoderStage`).
    :meth:`run` is the whole step (module docstring): a pipeline's backwards run inside torch's
    schedule, so its gradient sum and checks (:func:`~lightning_bytescale.engine.executor.sync_step`
    on the stage's data-parallel group) run there too, and :meth:`sync` only returns the result.
    With ``sync.stop_requested`` given (under the Trainer) one all-reduce over the world after the
    step agrees on the stop flag and gives every rank every stage's times
    (:func:`agree_after_step`, :func:`pipeline_stats`: the result's ``layout_stats``).
    ``schedules(stage)`` gives the stages and schedules kept between steps
    (:class:`StageSchedules`; default: one per runner), ``compute_context`` is entered around
    every forward and loss of the stage (the precision plugin's autocast under the Trainer),
    ``on_schedule`` sees each step's schedule.  :meth:`evaluate` runs the forward-only schedule
    (validation and test; prediction is refused).
    """

    def __init__(
        self,
        stage: DecoderStage,
        pmesh: ParallelMesh,
        sync: SyncOptions = FLAT_SYNC,
        *,
        schedules: Callable[[DecoderStage], StageSchedules] | None = None,
        compute_context: ComputeContext | None = None,
        on_schedule: Callable[[PipelineScheduleSingle | None], None] | None = None,
    ) -> None:
        self.stage, self.pmesh, self.options = stage, pmesh, sync
        self.schedules = schedules
        self.compute_context = compute_context or contextlib.nullcontext
        self.on_schedule = on_schedule

    def run(
        self,
        model: nn.Module,
        batch: PipelineStepBatch,
        *,
        compute: Compute = DEFAULT_COMPUTE,
        checks: StepChecks = DEFAULT_CHECKS,
        params: NamedParams | None = None,
    ) -> InFlight:
        """The step of this rank's stage of its pipeline's ``batch``, its gradient sum included."""
        self._check_batch(batch, "training")
        stage = self.stage
        named = trained(model, params)
        compute.waits(f"the pipeline step {batch.step.step} (waits on every rank)")
        # the bucketed sync on the stage's data-parallel group (ZeRO-2's owners in it), or the flat one
        grad_sync = self.options.buckets([p for p in stage.parameters() if p.requires_grad])
        owners = self.options.owners if grad_sync is None else None
        with count_attention_calls() if checks.attention else contextlib.nullcontext() as counted:
            result = self._schedule_step(batch, checks, owners, grad_sync)
        if checks.attention:  # the first steps: the pipelines' stages together called the packed attention
            result.attention = agree_on_attention(counted.calls, batch.step.micro_batches, self.pmesh)
            check_attention(result.attention, batch.step.step)  # every rank alike, before the optimizer step
        if self.options.stop_requested is not None:  # under the Trainer: one agreement over the world
            stop, times = agree_after_step(result, self.pmesh, self.options.stop())
            result.stop_requested = stop
            result.layout_stats = pipeline_stats(times, self.pmesh)
        # what a pipeline checks: no loss probe, no parameter fingerprints
        done = InFlight(
            batch.step, named, result.local, replace(checks, loss_scaling=False, parameters=False), compute
        )
        done.loss_dtype = next(stage.parameters()).dtype
        done.finish(result)
        return done

    def sync(self, step: InFlight, *, extra: torch.Tensor | None = None) -> StepResult:
        """The result :meth:`run` made (the gradients were summed inside the schedule)."""
        return step.result  # type: ignore[return-value]

    def _check_batch(self, batch: Any, what: str) -> None:
        if not isinstance(batch, PipelineStepBatch):
            raise TypeError(
                f"with pipeline_parallel_size={self.pmesh.dims.pipeline} every {what} batch must be a "
                f"PipelineStepBatch (one pipeline's micro-batches, padded), got {type(batch).__name__}: plan with "
                "pipeline_degree equal to the pipelines and build the steps with build_pipeline_step "
                "(ByteScaleDataModule does both under the strategy; docs/pipelines.md)"
            )

    def evaluate(
        self, model: nn.Module, batch: Any, *, compute: Compute, name: str = "evaluation"
    ) -> LocalResult:
        """The pipeline's forward-only schedule on ``batch``: each micro-batch's token loss at the last stage.

        torch's schedule, built without a loss function, runs only the stages' forwards (no
        backward, no gradient, no sync); the last stage's output of each micro-batch (its logits)
        gives the micro-batch's token loss over the step's global token count as it comes out
        (:func:`_evaluation_losses`), so the last stage's result is its pipeline's share of the global
        token mean (``loss``) and its loss tokens; the other stages return zeros, so a sum over the
        world counts every token once.  ``compute.forward`` is not called: as in training, a stage
        cannot run the LightningModule's own step.  The caller's context (the precision plugin's
        ``val_step_context``) is already entered around this call.  Prediction (each micro-batch's
        outputs) is refused by name.
        """
        pmesh = self.pmesh
        if name == "predict_step":
            raise refuse_evaluation(name, pmesh.dims.pipeline)
        self._check_batch(batch, "evaluation")
        compute.waits(f"the pipeline {name} of step {batch.step.step} (waits on every rank)")
        start_step_check(batch.step, pmesh).wait()
        module, mbs = self.stage, batch.micro_batches
        dtype = next(module.parameters()).dtype
        losses: list[torch.Tensor] = []
        if mbs:
            device = _device(pmesh)
            key = ScheduleKey(len(mbs), GPIPE, batch.capacity, dtype, logits_dtype(dtype, device))
            # this batch's only: no training buffers kept
            entry = _build(module, key, pmesh, forward_only=True)
            module.bind(mbs)
            inputs = (torch.stack([mb.input_ids for mb in mbs]).to(device),) if module.is_first else ()
            try:
                with torch.no_grad(), _evaluation_losses(module, mbs, losses):
                    entry.schedule.step(*inputs, return_outputs=False, slot=torch.arange(len(mbs)))
            finally:
                module.bind(())
        # the last stage's losses: one copy to the host for the whole batch, not one per micro-batch
        loss = (
            torch.stack(losses).to("cpu", torch.float64).sum()
            if losses
            else torch.zeros((), dtype=torch.float64)
        )
        return LocalResult(
            loss=loss,
            loss_tokens=sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in mbs) if module.is_last else 0,
            loss_dtype=dtype,
        )

    def close(self) -> None:
        close = getattr(self.options.buckets, "close", None)
        if callable(close):
            close()

    def _schedule_step(
        self,
        batch: PipelineStepBatch,
        checks: StepChecks,
        grad_owners: Mapping[int, int] | None,
        grad_sync: BucketedGradSync | None,
    ) -> PipelineStepResult:
        module, pmesh = self.stage, self.pmesh
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if grad_sync is not None:
            check_grad_sync(grad_sync, [p for _, p in named], pmesh, grad_owners)
        start_step_check(batch.step, pmesh, check_plan=checks.plan).wait()
        mbs = batch.micro_batches
        device = _device(pmesh)
        context = self.compute_context
        one_step = self.schedules is None
        schedules = StageSchedules(module, pmesh) if self.schedules is None else self.schedules(module)
        if schedules.module is not module or schedules.pmesh is not pmesh:
            raise ParallelDimsError(
                "the StageSchedules were made for another stage module or mesh; make one per stage: "
                "StageSchedules(stage, pmesh)"
            )
        dtype = next(module.parameters()).dtype
        with context():
            out_dtype = logits_dtype(dtype, device)
        entry = schedules.get(batch, dtype=dtype, output_dtype=out_dtype)
        schedule = None if entry is None else entry.schedule
        clock = StageClock(device)
        if self.on_schedule is not None:
            self.on_schedule(schedule)
        losses: list[torch.Tensor] = []
        armed: RemovableHandle | None = None
        if grad_sync is not None:
            grad_sync.prepare()  # the gradients accumulate into the buckets
            grad_sync.track_finite = checks.finite_gradients
            if schedule is not None and mbs[-1].layout.ring is None:  # no ring exchange in the last backward
                armed = arm_for_last_backward(module, grad_sync, len(mbs) - 1)
        start = time.perf_counter()
        if entry is not None:
            scope = entry.scope
            scope.clock, scope.context, scope.num_global_tokens = clock, context, batch.step.num_global_tokens
            module.bind(mbs)
            inputs = (torch.stack([mb.input_ids for mb in mbs]).to(device),) if module.is_first else ()
            target = torch.stack([mb.labels for mb in mbs]).to(device) if module.is_last else None
            slot = torch.arange(len(mbs))  # on the host: the stage reads it without a synchronisation
            try:
                entry.schedule.step(*inputs, target=target, losses=losses, return_outputs=False, slot=slot)
            finally:
                module.bind(())
                scope.reset()
                entry.stage.clear_runtime_states()  # the input buffers' gradients and the cached forwards, until next time
                if armed is not None:
                    armed.remove()
        if grad_sync is not None:
            grad_sync.launch()  # the buckets the hooks did not launch (all of them without micro-batches)
        seconds = time.perf_counter() - start
        if (
            clock.cuda and entry is not None
        ):  # the host returned at the last launch: wait for the stage's work
            torch.cuda.current_stream(device).synchronize()
            seconds = time.perf_counter() - start
        if one_step:  # nothing keeps this step's stage: its buffers go now, before the gradient sync
            schedules.clear()
        del entry, schedule
        shards = LocalShards(named) if grad_sync is None else None
        tokens = [int((mb.labels != IGNORE_INDEX).sum()) if module.is_last else 0 for mb in mbs]
        values = [float(x.detach()) for x in losses] if losses else [0.0] * len(mbs)
        finite = None
        if (
            checks.finite_gradients and mbs
        ):  # with buckets: this rank's own values, read when each was launched
            finite = (
                grad_sync.local_grads_finite()
                if grad_sync is not None
                else all_finite([p.grad for _, p in shards.named if p.grad is not None])
            )
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
            loss=torch.tensor(sum(values), dtype=torch.float64),
            loss_tokens=sum(tokens),
            micro_batches=results,
        )

        def sync() -> StepResult:
            if grad_sync is not None:  # the buckets: launched already, waited for here
                return sync_step(
                    named, batch.step, local, group=pmesh.dp_group, check_tokens=checks.tokens and module.is_last,
                    check_finite=checks.finite, grad_sync=grad_sync,
                )  # fmt: skip
            synced = sync_step(
                shards.named,
                batch.step,
                local,
                group=pmesh.dp_group,
                check_tokens=checks.tokens and module.is_last,
                check_finite=checks.finite,
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


def run_pipeline_step(
    module: DecoderStage,
    batch: PipelineStepBatch,
    pmesh: ParallelMesh,
    *,
    on_schedule: Callable[[PipelineScheduleSingle | None], None] | None = None,
    schedules: StageSchedules | None = None,
    compute_context: ComputeContext | None = None,
    check_plan: bool = True,
    check_tokens: bool = True,
    check_finite: bool = True,
    grad_owners: Mapping[int, int] | None = None,
    grad_sync: BucketedGradSync | None = None,
) -> PipelineStepResult:
    """One step of this rank's stage ``module`` of its pipeline's ``batch`` (module docstring).

    Gradients accumulate into ``p.grad`` of the stage's parameters (zero them before the step);
    afterwards they hold the gradient of the global token-mean loss.  ``on_schedule`` sees the
    schedule of the step (``None`` for a pipeline without micro-batches).

    ``schedules`` keeps the stage and schedule for the next step with the same micro-batch count
    (:class:`StageSchedules`; without it they are built for this step and dropped after it).
    ``compute_context`` (a context-manager factory: under the Trainer the precision plugin's
    ``train_step_context``) is entered around every forward and loss of the stage, not its
    backward; under autocast the last stage's logits are declared in the autocast dtype.

    ``grad_owners`` (ZeRO-2 per stage: ``id(parameter) -> global rank`` of the HDP rank of this
    stage and lane that keeps its optimizer state) reduces each gradient to its owner over the
    stage's data-parallel group instead of summing it everywhere; the other ranks hold ``None``.
    Clip afterwards with ``clip_grad_norm_(..., group=pmesh.dp_group, pipeline_group=pmesh.pp_group)``.

    ``grad_sync`` (a :class:`~lightning_bytescale.engine.grad_sync.BucketedGradSync` of exactly
    the stage's trained parameters, in ``module.named_parameters()`` order, on ``pmesh.dp_group``;
    made once and reused): the gradients are summed in buckets from the stage's last backward
    (module docstring); ZeRO-2's owners then belong to the sync, not ``grad_owners``.  It is
    :class:`PipelineRunner`'s ``run``.
    """
    runner = PipelineRunner(
        module, pmesh, SyncOptions(buckets=lambda _params: grad_sync, owners=grad_owners),
        schedules=None if schedules is None else (lambda _stage: schedules),
        compute_context=compute_context, on_schedule=on_schedule,
    )  # fmt: skip
    checks = StepChecks(
        plan=check_plan, tokens=check_tokens, finite=check_finite, finite_gradients=check_finite
    )
    return runner.sync(runner.run(module, batch, checks=checks))  # type: ignore[return-value]


def agree_on_attention(
    calls: int, micro_batches: Sequence[PackedMicroBatch], pmesh: ParallelMesh
) -> AttentionVerdict:
    """The attention check of a pipeline step: one all-reduce over the world of each stage's calls.

    ``calls``: this stage's packed attention calls over the step; every rank learns every
    stage's and applies the per-pipeline rule
    (:func:`~lightning_bytescale.engine.attention_check.pipeline_verdict`), so all raise alike.
    """
    dims = pmesh.dims
    values = torch.zeros(dims.world_size, 4, dtype=torch.int64)
    kinds = [kind_of(mb) for mb in micro_batches]
    values[dist.get_rank()] = torch.tensor([calls, *(kinds.count(k) for k in ("ring", "packed", "single"))])
    values = values.to(comm_device())
    dist.all_reduce(values)
    per_rank = [tuple(row) for row in values.cpu().tolist()]  # one copy back
    pipelines = [
        dims.pipeline_ranks(h, lane)
        for h in range(dims.data_parallel)
        for lane in range(dims.tensor_parallel)
    ]
    return pipeline_verdict(per_rank, pipelines)


def agree_after_step(
    result: PipelineStepResult, pmesh: ParallelMesh, stop_requested: bool
) -> tuple[bool, torch.Tensor]:
    """One all-reduce over the world after the step: the stop flag and every rank's stage times.

    Returns whether any rank asked to stop (preemption) and a ``[2, world]`` float64 tensor on
    the host: every global rank's schedule wall time and stage compute, the same on every rank.
    """
    world = pmesh.dims.world_size
    values = torch.zeros(1 + 2 * world, dtype=torch.float64)
    values[0] = float(stop_requested)
    me = dist.get_rank()
    values[1 + me], values[1 + world + me] = result.schedule_s, result.compute_s
    values = values.to(comm_device())
    dist.all_reduce(values)
    values = values.cpu()  # one copy back
    return bool(values[0] > 0), values[1:].reshape(2, world)


def pipeline_stats(times: torch.Tensor, pmesh: ParallelMesh) -> dict[str, Any]:
    """The measured pipeline figures of a step from every rank's stage times (the same on every rank).

    ``pipeline_stage_bubble[h][p]``: stage p of pipeline h, ``1 - compute / schedule wall`` (the
    mean over its TP lanes); ``pipeline_bubble[h]``: the mean over the pipeline's stages, as the
    benchmark defines a pipeline's bubble; ``pipeline_schedule_s[h]``: its slowest stage's wall,
    which is also the pipeline's ``busy_s`` (and the imbalance figures computed from it), so
    every rank, whatever its stage, reports the same.  The strategy adds them to ``step_stats``.
    """
    dims = pmesh.dims
    lanes = range(dims.tensor_parallel)
    stage_bubbles, walls = [], []
    for h in range(dims.data_parallel):
        row = []
        for p in range(dims.pipeline):
            ranks = [dims.global_rank(h, lane, p) for lane in lanes]
            row.append(sum(stage_bubble(float(times[1, g]), float(times[0, g])) for g in ranks) / len(ranks))
        walls.append(
            max(float(times[0, dims.global_rank(h, lane, p)]) for p in range(dims.pipeline) for lane in lanes)
        )
        stage_bubbles.append(row)
    mean, top = sum(walls) / len(walls), max(walls)
    return {
        "pipeline_stage_bubble": stage_bubbles,
        "pipeline_bubble": [sum(row) / len(row) for row in stage_bubbles],
        "pipeline_schedule_s": walls,
        # per HDP rank the pipeline's schedule wall (its slowest stage), the same on every rank,
        # in place of the stage's own report of its data-parallel group
        "busy_s": walls,
        "max_over_mean_measured": top / mean if mean > 0 else float("nan"),
        "bubble_fraction": 1.0 - mean / top if top > 0 else 0.0,
    }


def refuse_evaluation(hook: str, pipeline_parallel_size: int) -> ConfigError:
    """The error for prediction under pipelines (validation and test run the forward-only schedule).

    Raised at set-up by ``trainer.predict``, before any batch.
    """
    return ConfigError(
        f"{hook} is not supported with pipeline_parallel_size={pipeline_parallel_size} yet: the pipeline's "
        "forward-only schedule gives the token loss (validation and test), not each micro-batch's outputs. Predict "
        "with pipeline_parallel_size=1 from the checkpoint (python -m lightning_bytescale.lightning.checkpoint FOLDER "
        "model.pt --model-only model. writes the unsplit model's state dict; docs/pipelines.md)"
    )


__all__ = [
    "PipelineRunner",
    "PipelineStepResult",
    "StageClock",
    "StageSchedules",
    "arm_for_last_backward",
    "build_schedule",
    "agree_after_step",
    "agree_on_attention",
    "logits_dtype",
    "pipeline_stats",
    "refuse_evaluation",
    "run_pipeline_step",
    "stage_bubble",
]
