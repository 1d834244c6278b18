"""The step runner: one step of one layout, cut where Lightning calls the strategy twice.

Lightning runs an optimizer step as ``training_step`` and then ``backward``; every layout's
step fits that cut.  A :class:`StepRunner` has exactly those halves: :meth:`~StepRunner.run`
(this rank's micro-batches, forward and backward, from ``training_step``) and
:meth:`~StepRunner.sync` (the step's gradient sum and checks, from ``backward``; a second call
returns the first result), plus :meth:`~StepRunner.evaluate` (the same loop without a backward,
for validation, test and prediction) and :meth:`~StepRunner.close`.  One runner per layout:
:class:`~lightning_bytescale.engine.executor.HDPRunner` (plain HDP, every rank one HDP rank),
:class:`~lightning_bytescale.parallel.step.MeshRunner` (an HDP rank is a tensor-parallel group,
with FSDP2 or not) and :class:`~lightning_bytescale.parallel.pipeline_step.PipelineRunner` (an
HDP rank is a pipeline); :func:`~lightning_bytescale.parallel.layout.make_runner` makes the
layout's.  ``run_step``, ``run_parallel_step`` and ``run_pipeline_step`` are ``run`` then
``sync`` of one.

What a runner is given, it is given as records rather than flags passed on layer by layer:
:class:`Compute` (how the caller runs a micro-batch), :class:`~lightning_bytescale.engine.step_checks.StepChecks`
(what the step checks) and :class:`SyncOptions` (how the gradients are summed).  Between the
halves the step is an :class:`InFlight`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from lightning_bytescale.engine.batch import PackedMicroBatch, StepBatch
from lightning_bytescale.engine.grad_sync import BucketedGradSync
from lightning_bytescale.engine.results import LocalResult, StepResult
from lightning_bytescale.engine.step_checks import StepChecks

ForwardFn = Callable[[nn.Module, PackedMicroBatch], torch.Tensor]
BackwardFn = Callable[[torch.Tensor], None]
ContextFactory = Callable[[PackedMicroBatch], AbstractContextManager]
PhaseFn = Callable[[str], None]
GradSyncSource = Callable[[Sequence[torch.Tensor]], BucketedGradSync | None]
NamedParams = list[tuple[str, torch.Tensor]]


def no_buckets(_params: Sequence[torch.Tensor]) -> None:
    """The flat sync: no bucketed gradient sync (every gradient summed after the loop, in one buffer)."""
    return None


@dataclass(frozen=True)
class Compute:
    """How the caller runs its micro-batches: the forward, the backward and what wraps them."""

    forward: ForwardFn | None = None
    """``forward(model, mb) -> loss`` (default: the model's logits and the token loss)."""

    backward: BackwardFn | None = None
    """``backward(loss)`` (default: ``loss.backward()``); under the Trainer the precision plugin's."""

    micro_batch_context: ContextFactory | None = None
    """``context(mb)`` around each micro-batch's forward and backward (activation offload)."""

    sync_timing: bool = False
    """Measure each micro-batch's device time (CUDA events on a GPU)."""

    p2p_group: Any = None
    """The group ring attention sends on (default: the global group)."""

    on_phase: PhaseFn | None = None
    """Told where the rank is before each micro-batch (a watchdog, error messages)."""

    on_wait: PhaseFn | None = None
    """Told before each part of the step that waits on every rank: its start and its sync."""

    forward_only: bool = False
    """Evaluation and prediction: no backward, no gradient check, no gradient sync."""

    def waits(self, phase: str) -> None:
        """Tell :attr:`on_wait` (if given) that the rank now waits on every rank in ``phase``."""
        if self.on_wait is not None:
            self.on_wait(phase)


@dataclass(frozen=True)
class SyncOptions:
    """How a runner sums the step's gradients and what its sync carries besides them."""

    buckets: GradSyncSource = no_buckets
    """The bucketed sync for the trained parameters it is given (:class:`GradSyncCache`), or none: flat."""

    owners: Mapping[int, int] | None = None
    """ZeRO-2 with the flat sync: ``id(parameter) -> global rank`` that keeps its gradient."""

    stop_requested: Callable[[], bool] | None = None
    """Asked at the sync whether this rank wants to stop at this step boundary (preemption)."""

    def stop(self) -> bool:
        return self.stop_requested is not None and bool(self.stop_requested())


DEFAULT_COMPUTE = Compute()
"""The model's logits and the token loss, ``loss.backward()``, nothing around them."""

DEFAULT_CHECKS = StepChecks()
"""Every check of a step but the loss probe and the parameter fingerprints."""

FLAT_SYNC = SyncOptions()
"""Every gradient summed after the loop in one buffer; no owners, no stop request."""


class GradSyncCache:
    """The bucketed gradient sync of a run: made for the trained parameters, made again when they change.

    ``group`` is where the buckets are summed (plain HDP: their own group, so they may be in
    flight beside ring exchanges on the global group; the mesh: the lane's data-parallel group),
    ``owners`` ZeRO-2's gradient owners.  Called with no parameters (FSDP2 reduces every
    gradient itself) it gives no sync.
    """

    def __init__(self, *, group: Any, bucket_bytes: int, owners: Mapping[int, int] | None = None) -> None:
        self.group, self.bucket_bytes, self.owners = group, int(bucket_bytes), owners
        self.sync: BucketedGradSync | None = None

    def __call__(self, params: Sequence[torch.Tensor]) -> BucketedGradSync | None:
        if not params:
            return None
        sync = self.sync
        if sync is None or [id(p) for p in sync.params] != [id(p) for p in params]:
            self.close()
            sync = self.sync = BucketedGradSync(
                params, group=self.group, bucket_bytes=self.bucket_bytes, owners=self.owners
            )
        return sync

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
            self.sync = None


@dataclass
class InFlight:
    """One step on this rank between its runner's :meth:`~StepRunner.run` and :meth:`~StepRunner.sync`.

    ``batch`` is the step's :class:`StepBatch` (a pipeline's own ``.step``), ``named`` the
    trained parameters, ``local`` this rank's loop.  ``loss`` is this rank's share of the loss
    until the sync, then the step's global loss (``loss_dtype``: the dtype the forward returned
    it in); ``result`` is set by the sync (by ``run`` already where the layout's step syncs in
    its schedule).
    """

    batch: StepBatch
    named: NamedParams
    local: LocalResult
    checks: StepChecks
    compute: Compute
    grad_sync: BucketedGradSync | None = None
    result: StepResult | None = None
    synced: bool = False
    loss: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    loss_dtype: torch.dtype = torch.float32

    @classmethod
    def started(
        cls, batch: StepBatch, named: NamedParams, local: LocalResult, checks: StepChecks, compute: Compute
    ) -> InFlight:
        """The step after its loop: this rank's loss share, in the dtype its forward returned."""
        return cls(
            batch, named, local, checks, compute, loss=local.loss.detach(), loss_dtype=local.loss_dtype
        )

    def finish(self, result: StepResult) -> StepResult:
        """Record the step's sync: its result and the global loss."""
        self.result, self.synced, self.loss = result, True, result.loss_tensor.detach()
        return result


class StepRunner(Protocol):
    """One layout's step, in the two halves Lightning calls (module docstring)."""

    def run(
        self,
        model: nn.Module,
        batch: Any,
        *,
        compute: Compute = ...,
        checks: StepChecks = ...,
        params: NamedParams | None = None,
    ) -> InFlight:
        """This rank's part of the step up to the gradient sum; ``params``: the trained ``(name, parameter)`` pairs."""
        ...

    def sync(self, step: InFlight, *, extra: torch.Tensor | None = None) -> StepResult:
        """The step's gradient sum and checks, on every rank; the same result when called again."""
        ...

    def evaluate(self, model: nn.Module, batch: Any, *, compute: Compute, name: str = ...) -> LocalResult:
        """``compute.forward`` on each micro-batch of this rank, without a backward (``name``: what runs, for errors)."""
        ...

    def close(self) -> None:
        """Release what the runner keeps between steps (the bucketed sync, a pipeline's stages)."""
        ...


def trained(model: nn.Module, params: NamedParams | None = None) -> NamedParams:
    """``params`` as given, or the model's trained ``(name, parameter)`` pairs."""
    if params is not None:
        return list(params)
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


__all__ = [
    "BackwardFn",
    "Compute",
    "DEFAULT_CHECKS",
    "DEFAULT_COMPUTE",
    "FLAT_SYNC",
    "ContextFactory",
    "ForwardFn",
    "GradSyncCache",
    "GradSyncSource",
    "InFlight",
    "PhaseFn",
    "StepRunner",
    "SyncOptions",
    "no_buckets",
    "trained",
]
