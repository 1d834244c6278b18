"""ZeRO levels: which rank owns which parameter, and gradient clipping over sharded gradients.

``ByteScaleStrategy(zero=1)`` shards optimizer state with ``ZeroRedundancyOptimizer`` (each
parameter's state lives on one rank; after the step that rank broadcasts the parameter).
:func:`shard_optimizers` does the wrapping.  ``zero=2`` also shards the *gradients*: the gradient sync reduces each parameter's gradient to
the rank that owns its optimizer state (:class:`~lightning_bytescale.engine.grad_sync.BucketedGradSync`
with ``owners``) and the other ranks drop it.  Both levels share one optimizer-state layout
(the ``ZeroRedundancyOptimizer`` partition) and so one checkpoint format.

Without buckets (the step's flat sync; on the tensor-parallel mesh, where gradients are summed
after the micro-batch loop), :func:`reduce_gradients_to_owners` reduces each owner's gradients
to it in one ``dist.reduce``.

With sharded gradients a rank's local gradient norm covers its shard only, so clipping by norm
needs the norms of all shards: :func:`clip_grad_norm_` combines them with one all-reduce of
one number (clipping by value needs nothing: each rank clips the gradients it holds).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_bytescale.engine.comm_device import HOST, comm_device
from lightning_bytescale.errors import ConfigError

ZERO_LEVELS = (0, 1, 2)


def resolve_zero_level(zero: Any, zero1: Any = None) -> int:
    """The ZeRO level from ``zero`` and the older ``zero1`` flag (an alias for ``zero=1``).

    ``zero1=True`` with the default ``zero=0`` means ``zero=1``; ``zero1=True`` with
    ``zero=2``, or ``zero1=False`` with ``zero`` 1 or 2, contradict each other and are refused.
    """
    if isinstance(zero, bool) or not isinstance(zero, int) or zero not in ZERO_LEVELS:
        raise ConfigError(
            f"zero must be 0 (no sharding), 1 (optimizer state sharded) or 2 (optimizer state and gradients "
            f"sharded), got {zero!r}"
        )
    if zero1 is None:
        return zero
    if not isinstance(zero1, bool):
        raise ConfigError(f"zero1 must be True or False (an alias for zero=1), got {zero1!r}")
    if zero1 and zero in (0, 1):
        return 1
    if not zero1 and zero == 0:
        return 0
    raise ConfigError(
        f"zero1={zero1} contradicts zero={zero}: zero1=True is the older spelling of zero=1. Pass only zero "
        "(0, 1 or 2) and drop zero1."
    )


def shard_optimizers(optimizers: Sequence[Optimizer], schedulers: Iterable[Any] = ()) -> list[Optimizer]:
    """Each optimizer as a ``ZeroRedundancyOptimizer`` over the default group (ZeRO-1 and ZeRO-2 share it).

    The wrapper keeps the optimizer's class, parameter groups and defaults (those its
    constructor accepts); an optimizer that already is one is kept.  Every LR scheduler in
    ``schedulers`` that steps a wrapped optimizer is pointed at its wrapper, and the wrapper's
    ``step`` is marked the way schedulers expect (:func:`mark_step_calls`).
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    schedulers = list(schedulers)
    wrapped: list[Optimizer] = []
    for opt in optimizers:
        if isinstance(opt, ZeroRedundancyOptimizer):
            wrapped.append(opt)
            continue
        accepted = inspect.signature(type(opt).__init__).parameters
        defaults = {k: v for k, v in opt.defaults.items() if k in accepted}
        zero = ZeroRedundancyOptimizer(
            [dict(g) for g in opt.param_groups], optimizer_class=type(opt), **defaults
        )
        mark_step_calls(zero)
        for scheduler in schedulers:
            if getattr(scheduler, "optimizer", None) is opt:
                scheduler.optimizer = zero
        wrapped.append(zero)
    return wrapped


def mark_step_calls(optimizer: Optimizer) -> None:
    """Mark ``optimizer.step`` the way LR schedulers expect, so they do not warn about call order."""
    step = optimizer.step

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    wrapped._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapped  # type: ignore[method-assign]


def owner_ranks(optimizers: Iterable[Any]) -> dict[int, int]:
    """``id(parameter) -> global rank`` that keeps its optimizer state, for every sharded optimizer.

    Reads the partition of each ``ZeroRedundancyOptimizer`` (ranks of its process group,
    translated to global ranks); other optimizers shard nothing and are skipped.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    owners: dict[int, int] = {}
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)  # a LightningOptimizer
        if not isinstance(opt, ZeroRedundancyOptimizer):
            continue
        group = opt.process_group
        for param, rank in opt._param_to_rank.items():  # the partition its step and state_dict use
            owners[id(param)] = dist.get_global_rank(group, rank) if group is not None else rank
    return owners


def drop_unowned_gradients(params: Iterable[nn.Parameter], owners: Mapping[int, int], rank: int) -> int:
    """Set ``p.grad = None`` where another rank owns ``p`` (after a full all-reduce); returns bytes freed."""
    freed = 0
    for p in params:
        owner = owners.get(id(p))
        if owner is not None and owner != rank and p.grad is not None:
            freed += p.grad.numel() * p.grad.element_size()
            p.grad = None
    return freed


@torch.no_grad()
def reduce_gradients_to_owners(
    params: Sequence[nn.Parameter], owners: Mapping[int, int], group: Any = None
) -> None:
    """Sum each gradient over ``group`` onto the rank that owns it (ZeRO-2); the other ranks drop it.

    ``owners`` maps ``id(parameter)`` to the *global* rank of ``group`` that keeps it.  The
    parameters of one owner travel in one flat buffer (float32, or the gradients' dtype where it
    is wider, so narrow gradients are summed in float32), one ``dist.reduce`` per owner in rank
    order; a parameter without a gradient on a rank contributes zeros, so every rank sends the
    same shapes.  Parameters without an owner are all-reduced (one more collective, first).
    Afterwards the owner's ``p.grad`` holds the sum in the parameter's dtype (in place where it
    had a gradient), every other rank's is ``None``.  Call it on every rank of ``group`` with
    the parameters in the same order.  Without an initialised process group each rank owns all.
    """
    initialised = dist.is_available() and dist.is_initialized()
    me = dist.get_rank() if initialised else None
    by_owner: dict[int, list[nn.Parameter]] = {}
    for p in params:
        by_owner.setdefault(owners.get(id(p), -1), []).append(p)
    for owner in sorted(by_owner):  # -1 (no owner: all-reduced) first, then by rank
        members = by_owner[owner]
        dtype = functools.reduce(torch.promote_types, [p.dtype for p in members], torch.float32)
        device = comm_device(group) if initialised else members[0].device
        flat = torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(device, dtype)
                for p in members
            ]
        )
        if initialised and owner < 0:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        elif initialised:
            dist.reduce(flat, dst=owner, op=dist.ReduceOp.SUM, group=group)
        keep = not initialised or owner < 0 or owner == me
        offset = 0
        for p in members:
            n = p.numel()
            if not keep:
                p.grad = None
            elif p.grad is None:
                p.grad = flat[offset : offset + n].view_as(p).to(p.device, p.dtype, copy=True)
            else:
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n
        del flat


def _local_norm(grads: Sequence[Tensor], norm_type: float) -> Tensor:
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if get_total_norm is not None:
        return get_total_norm(grads, norm_type)
    norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    group: Any = None,
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` when each gradient is held by exactly one rank of ``group``.

    Every rank computes the norm of the gradients it holds; one all-reduce combines them (sum
    of ``norm ** p``, or the maximum for the infinity norm) into the norm of the whole
    gradient, and each rank scales its own gradients by the same factor,
    ``min(1, max_norm / (total + 1e-6))``, as one process would.  Call it on every rank of
    ``group``.  Returns the total norm.
    """
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    initialised = dist.is_available() and dist.is_initialized()
    # the group's device: a rank without gradients still sends its zero norm there
    device = comm_device(group) if initialised else (grads[0].device if grads else HOST)
    norm_type = float(norm_type)
    local = _local_norm(grads, norm_type) if grads else torch.zeros((), device=device)
    dtype = local.dtype if grads else torch.float32
    wide = local.to(device=device, dtype=torch.promote_types(local.dtype, torch.float32))
    if math.isinf(norm_type):
        if initialised:
            dist.all_reduce(wide, op=dist.ReduceOp.MAX, group=group)
        total = wide
    else:
        powered = wide.pow(norm_type)
        if initialised:
            dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
        total = powered.pow(1.0 / norm_type)
    total = total.to(dtype)
    if grads:
        clip_coef = float(max_norm) / (total + 1e-6)
        coef = torch.clamp(clip_coef, max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device, g.dtype))
    return total


__all__ = [
    "ZERO_LEVELS",
    "clip_grad_norm_",
    "drop_unowned_gradients",
    "mark_step_calls",
    "owner_ranks",
    "reduce_gradients_to_owners",
    "resolve_zero_level",
    "shard_optimizers",
]
