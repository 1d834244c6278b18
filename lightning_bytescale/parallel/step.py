"""The HDP step on a ``(data_parallel, tensor_parallel)`` mesh, with FSDP2 on the data-parallel dimension or not.

The same three phases as :func:`~lightning_bytescale.engine.executor.run_step`, on the mesh:

1. :func:`start_step_check`: the plan-digest all-gather over *every* rank -- all TP lanes of
   all HDP ranks read the same plan and data, so they must all agree -- started before anything
   else; the plan must have been made for the HDP ranks (``dims.data_parallel``).
2. With FSDP2, :meth:`~lightning_bytescale.parallel.fsdp.FSDPStepDriver.begin_step` (its
   all-gathers, before any ring exchange), then
   :func:`~lightning_bytescale.engine.executor.run_micro_batches` unchanged: TP lanes of one HDP
   rank run the same micro-batches (their per-layer collectives on the TP group), rings run
   lane by lane between the global ranks the micro-batches were built with
   (``build_step(..., ring_ranks=pmesh.ring_ranks)``), point to point on the global group; then
   :meth:`~lightning_bytescale.parallel.fsdp.FSDPStepDriver.finish_step` (its reduce-scatters,
   after every ring exchange of the rank).
3. :func:`~lightning_bytescale.engine.executor.sync_step` unchanged, on this lane's
   data-parallel group: the gradients FSDP does not reduce (all of them without FSDP) and the
   step's scalars.  With a :class:`~lightning_bytescale.engine.grad_sync.BucketedGradSync`
   over the lane's data-parallel group (``grad_sync``, what the strategy passes by default) the
   gradients are summed in buckets of local shards launched from the hooks of the last
   micro-batch's backward, the rule of docs/engine.md ("The order of a step's communication");
   without one they are summed after the loop in one flat buffer of their local shards
   (:class:`~lightning_bytescale.parallel.shards.LocalShards`).  A lane's data-parallel group
   holds one rank per HDP rank, so the loss, the token count and the reports count each HDP
   rank once, not once per lane; TP shards are summed
   only with the same shard of the other HDP ranks, and replicated parameters (norms, tied
   embeddings) per lane, their gradients being equal on every lane already.  Every lane must
   then stop or go on together: :func:`agree_across_lanes` turns an error raised on some lanes
   only into one on all of them (a small all-reduce on the TP group).

Clip afterwards with :func:`lightning_bytescale.parallel.clip.clip_grad_norm_` (the global norm
over DTensor shards and plain replicas, each element once) and step the optimizer.  With ZeRO-2
(``grad_owners``) each gradient is reduced to the HDP rank that owns it instead, and the clip
combines the owners' norms over the lane's data-parallel group.

Collectives on the data-parallel group never run between two ring exchanges of the same rank:
the digest all-gather and FSDP's all-gathers come before the loop; the gradient buckets after
the rank's last ring exchange (in or right after its last backward, every one of them before
FSDP's reduce-scatters on every rank, also on one without micro-batches); FSDP's reduce-scatters
and the scalars after the loop.  In the last backward the buckets interleave with the layers'
TP collectives at the same points on every lane (the lanes cut the same buckets), so every
rank's issue order of the two is a subsequence of one global order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from lightning_bytescale.engine.batch import StepBatch
from lightning_bytescale.engine.comm_device import comm_device
from lightning_bytescale.engine.executor import StepCheck, check_step, micro_batch_loop, sync_step
from lightning_bytescale.engine.grad_sync import BucketedGradSync
from lightning_bytescale.engine.results import LocalResult, StepResult
from lightning_bytescale.engine.runner import (
    DEFAULT_CHECKS,
    DEFAULT_COMPUTE,
    FLAT_SYNC,
    BackwardFn,
    Compute,
    ContextFactory,
    ForwardFn,
    InFlight,
    NamedParams,
    SyncOptions,
    trained,
)
from lightning_bytescale.engine.step_checks import StepChecks, start_plan_agreement
from lightning_bytescale.errors import ConfigError, StepError
from lightning_bytescale.parallel.dims import ParallelMesh
from lightning_bytescale.parallel.errors import LaneDivergenceError
from lightning_bytescale.parallel.fsdp import FSDPStepDriver
from lightning_bytescale.parallel.shards import LocalShards

T = TypeVar("T")


def start_step_check(step: StepBatch, pmesh: ParallelMesh, *, check_plan: bool = True) -> StepCheck:
    """Refuse a plan made for another number of HDP ranks, and start the digest all-gather over every rank.

    Pass the result to ``run_micro_batches(plan_check=...)``: it is waited for before the first
    ring exchange (and at the latest after the loop), and raises on every rank together when
    any two ranks -- of any lanes -- planned or read differently.
    """
    check_step(step, pmesh.dp_group, check_plan=False)  # planned world vs the HDP ranks: no collective
    agreement = None
    if check_plan:
        agreement = start_plan_agreement(
            step.digest,
            step.step,
            pmesh.dims.world_size,
            group=None,
            data_identity=getattr(step, "data_identity", "") or "",
            async_op=True,
        )
    return StepCheck(agreement, None, pmesh.dims.world_size)


def agree_across_lanes(run: Callable[[], T], pmesh: ParallelMesh, step: int | None = None) -> T:
    """``run()``, then stop every TP lane of this HDP rank if it raised a :class:`StepError` on any of them.

    The step's checks run per lane (each on its own data-parallel group); a failure confined to
    one lane's shards -- a parameter shard that diverged, a non-finite gradient in one lane's
    heads -- would otherwise stop that lane and leave the others waiting in the next step's TP
    collectives.  The lanes that failed raise their own error, the others
    :class:`~lightning_bytescale.parallel.errors.LaneDivergenceError`.

    The same all-reduce carries a :class:`StepResult`'s ``stop_requested`` (a preemption signal):
    ``run()`` OR-ed it over the lane's HDP ranks, so the MAX over the TP group is the OR over every
    rank of the world, and every rank learns at the same step boundary that one was signalled.
    """
    failure: StepError | None = None
    result: T | None = None
    try:
        result = run()
    except StepError as err:
        failure = err
    if pmesh.dims.tensor_parallel > 1:
        stop = failure is None and bool(getattr(result, "stop_requested", False))
        flag = torch.tensor(
            [0 if failure is None else 1, int(stop)], dtype=torch.int32, device=comm_device(pmesh.tp_group)
        )
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pmesh.tp_group)
        failed_somewhere, stop_somewhere = flag.tolist()
        if failure is None and stop_somewhere and isinstance(result, StepResult):
            # every lane's OR over its HDP ranks, OR-ed over the lanes: every rank of the world
            result.stop_requested = True
        if failure is None and failed_somewhere:
            where = "" if step is None else f" at step {step}"
            raise LaneDivergenceError(
                f"another tensor-parallel lane of HDP rank {pmesh.hdp_rank} (global ranks "
                f"{list(pmesh.dims.tp_ranks(pmesh.hdp_rank))}) stopped{where} with an error; this lane "
                "stops with it. The lane that failed names the cause in its own message"
            )
    if failure is not None:
        raise failure
    return result  # type: ignore[return-value]


class _NoFSDP:
    """A mesh without ``fully_shard``: FSDP2 drives nothing and manages no parameter."""

    units: tuple[()] = ()

    def unmanaged(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        return list(named)

    def begin_step(self) -> None:
        pass

    def finish_step(self) -> None:
        pass


def fsdp_or_none(fsdp: FSDPStepDriver | None) -> FSDPStepDriver | _NoFSDP:
    """``fsdp``, or for a model without ``fully_shard`` a driver of nothing (the plain case as a value)."""
    return _NoFSDP() if fsdp is None else fsdp


class MeshRunner:
    """The step runner on the mesh: an HDP rank is a tensor-parallel group, with FSDP2 on ``"data_parallel"`` or not.

    :meth:`run` starts the plan check over every rank (:func:`start_step_check`), gathers
    FSDP2's units once, runs this rank's micro-batches (:func:`~lightning_bytescale.engine.executor.run_micro_batches`,
    unchanged: the lanes of an HDP rank run the same ones), launches the buckets left and
    reduce-scatters FSDP2's gradients; :meth:`sync` sums the other gradients and the step's
    scalars on the lane's data-parallel group (:func:`~lightning_bytescale.engine.executor.sync_step`:
    in buckets, or flat over their local shards, :class:`~lightning_bytescale.parallel.shards.LocalShards`),
    once, and every lane stops or goes on together (:func:`agree_across_lanes`).  The module
    docstring gives the order of the collectives.
    """

    def __init__(
        self, pmesh: ParallelMesh, fsdp: FSDPStepDriver | None = None, sync: SyncOptions = FLAT_SYNC
    ) -> None:
        self.pmesh, self.fsdp, self.options = pmesh, fsdp_or_none(fsdp), sync

    def run(
        self,
        model: nn.Module,
        batch: StepBatch,
        *,
        compute: Compute = DEFAULT_COMPUTE,
        checks: StepChecks = DEFAULT_CHECKS,
        params: NamedParams | None = None,
    ) -> InFlight:
        named = trained(model, params)
        compute.waits(f"the plan digest check of step {batch.step}")
        plan_check = start_step_check(batch, self.pmesh, check_plan=checks.plan)
        # the buckets sum local shards over the lane's HDP ranks; FSDP2 reduces its own
        grad_sync = self.options.buckets([p for _, p in self.fsdp.unmanaged(named)])
        self.fsdp.begin_step()  # one all-gather per unit, before any ring exchange
        local = micro_batch_loop(
            model,
            batch.micro_batches,
            batch.step,
            compute,
            checks,
            grad_sync,
            plan_check,
            [p for _, p in named],
        )
        if grad_sync is not None:
            grad_sync.launch()  # every rank's buckets before FSDP's reduce-scatters (all of them without micro-batches)
        self.fsdp.finish_step()  # one reduce-scatter per unit, after the last ring exchange
        step = InFlight.started(batch, named, local, checks, compute)
        step.grad_sync = grad_sync
        return step

    def sync(self, step: InFlight, *, extra: torch.Tensor | None = None) -> StepResult:
        if step.synced:
            return step.result  # type: ignore[return-value]
        checks, batch, pmesh = step.checks, step.batch, self.pmesh
        step.compute.waits(f"the gradient all-reduce of step {batch.step}")
        named = self.fsdp.unmanaged(step.named)  # FSDP2 reduced its own already
        stop = self.options.stop()
        if step.grad_sync is not None:

            def reduce() -> StepResult:
                return sync_step(
                    named, batch, step.local, group=pmesh.dp_group, extra=extra, check_tokens=checks.tokens,
                    check_finite=checks.finite, check_parameters=checks.parameters, stop_request=stop,
                    grad_sync=step.grad_sync,
                )  # fmt: skip

            return step.finish(agree_across_lanes(reduce, pmesh, batch.step))
        shards = LocalShards(named)  # the flat sync: DTensors as their local shards
        owners = self.options.owners

        def reduce_shards() -> StepResult:
            result = sync_step(
                shards.named, batch, step.local, group=pmesh.dp_group, extra=extra, check_tokens=checks.tokens,
                check_finite=checks.finite, check_parameters=checks.parameters, stop_request=stop,
                owners=None if owners is None else shards.rekey(owners),
            )  # fmt: skip
            shards.write_back()
            return result

        return step.finish(agree_across_lanes(reduce_shards, pmesh, batch.step))

    def evaluate(
        self, model: nn.Module, batch: StepBatch, *, compute: Compute, name: str = "evaluation"
    ) -> LocalResult:
        """The plan check, every FSDP2 unit gathered once, ``compute.forward`` on each micro-batch, resharded after."""
        plan_check = start_step_check(batch, self.pmesh)
        self.fsdp.begin_step()
        try:
            return micro_batch_loop(
                model, batch.micro_batches, batch.step, compute, StepChecks(finite_gradients=False), None,
                plan_check, None,
            )  # fmt: skip
        finally:
            for unit in self.fsdp.units:
                unit.reshard()

    def close(self) -> None:
        close = getattr(self.options.buckets, "close", None)
        if callable(close):
            close()


def run_parallel_step(
    model: nn.Module,
    step: StepBatch,
    pmesh: ParallelMesh,
    *,
    fsdp: FSDPStepDriver | None = None,
    forward: ForwardFn | None = None,
    backward: BackwardFn | None = None,
    micro_batch_context: ContextFactory | None = None,
    extra: torch.Tensor | None = None,
    sync_timing: bool = False,
    check_plan: bool = True,
    check_tokens: bool = True,
    check_finite: bool = True,
    check_loss_scaling: bool = False,
    check_parameters: bool = False,
    locate_non_finite: bool = False,
    stop_request: bool = False,
    on_phase: Callable[[str], None] | None = None,
    grad_owners: Mapping[int, int] | None = None,
    grad_sync: BucketedGradSync | None = None,
) -> StepResult:
    """One HDP step of ``model`` (tensor-parallel, FSDP2-sharded, both or neither) on ``pmesh``.

    ``step`` is this rank's share of the plan over HDP ranks, built for its lane
    (``build_step(plan, pmesh.hdp_rank, tokens, ring_ranks=pmesh.ring_ranks)``).  Gradients
    accumulate into ``p.grad`` (zero them before the step); afterwards every trained parameter
    holds the gradient of the global token-mean loss, as a shard where the parameter is one.
    The checks are :func:`~lightning_bytescale.engine.executor.run_step`'s, raised on every rank.
    It is :class:`MeshRunner`'s ``run`` then ``sync``.

    ``grad_owners`` (ZeRO-2 on the mesh: ``id(parameter) -> global rank`` of the lane's HDP rank
    that keeps its optimizer state) reduces each gradient to its owner over the lane's
    data-parallel group instead of summing it everywhere; the other ranks hold ``None``.  Clip
    afterwards with ``clip_grad_norm_(..., group=pmesh.dp_group)``.

    ``grad_sync`` (a :class:`~lightning_bytescale.engine.grad_sync.BucketedGradSync` of exactly
    the trained parameters FSDP does not manage, in ``model.named_parameters()`` order, on
    ``pmesh.dp_group``; made once and reused): the gradients are summed in buckets overlapped
    with the last micro-batch's backward instead of one flat buffer after the loop; ZeRO-2's
    owners then belong to the sync (``BucketedGradSync(..., owners=...)``), not ``grad_owners``.
    """
    named = trained(model)
    if grad_sync is not None:
        check_grad_sync(grad_sync, [p for _, p in fsdp_or_none(fsdp).unmanaged(named)], pmesh, grad_owners)
    sync = SyncOptions(
        buckets=lambda _params: grad_sync, owners=grad_owners, stop_requested=lambda: stop_request
    )
    runner = MeshRunner(pmesh, fsdp, sync)
    compute = Compute(
        forward=forward, backward=backward, micro_batch_context=micro_batch_context, sync_timing=sync_timing,
        on_phase=on_phase,
    )  # fmt: skip
    checks = StepChecks.of_flags(
        check_plan, check_tokens, check_finite, locate_non_finite, check_loss_scaling, check_parameters
    )
    return runner.sync(runner.run(model, step, compute=compute, checks=checks, params=named), extra=extra)


def check_grad_sync(
    grad_sync: BucketedGradSync,
    params: list[torch.Tensor],
    pmesh: ParallelMesh,
    grad_owners: Mapping[int, int] | None = None,
) -> None:
    """Refuse a bucketed sync that does not hold exactly ``params`` (in order) on ``pmesh.dp_group``, or owners twice.

    ``sync_step`` leaves a gradient the sync did not produce at ``None``, so a parameter missing
    from the sync would silently lose its gradient; a sync on another group would sum shards
    of other lanes (or stages).
    """
    ranks = dist.get_process_group_ranks(grad_sync.group if grad_sync.group is not None else dist.group.WORLD)
    if ranks != dist.get_process_group_ranks(pmesh.dp_group):
        raise ConfigError(
            f"grad_sync sums over the ranks {ranks}, not over this rank's data-parallel group "
            f"{dist.get_process_group_ranks(pmesh.dp_group)} (the same lane and stage of every HDP rank); build it "
            "with BucketedGradSync(..., group=pmesh.dp_group)"
        )
    if [id(p) for p in grad_sync.params] != [id(p) for p in params]:
        raise ConfigError(
            f"grad_sync holds {len(grad_sync.params)} parameters but the step trains {len(params)} others (or in "
            "another order); build it as BucketedGradSync([p for _, p in model.named_parameters() if "
            "p.requires_grad], group=pmesh.dp_group) (without FSDP's: driver.unmanaged(...)) after the model is "
            "sharded, and again when the trained parameters change"
        )
    if grad_owners is not None:
        raise ConfigError(
            "grad_owners and grad_sync were both given: a bucketed sync reduces to its own owners "
            "(BucketedGradSync(..., owners=...)); pass owners there"
        )


__all__ = [
    "MeshRunner",
    "agree_across_lanes",
    "check_grad_sync",
    "fsdp_or_none",
    "run_parallel_step",
    "start_step_check",
]
