"""Gradient clipping by the global norm when gradients are DTensor shards, plain replicas, or both.

``torch.nn.utils.clip_grad_norm_`` needs one kind of gradient: all plain tensors, or all
DTensors on one mesh.  A tensor-parallel model mixes them (sharded projections are DTensors on
the TP mesh; norms and tied embeddings stay plain, replicated on every lane), and FSDP2 adds
DTensors on the data-parallel (or the 2-D) mesh.  Here each kind's norm comes from torch
(:func:`torch.nn.utils.get_total_norm`): for DTensors of one mesh it is the norm of the whole
tensors, every element counted once however it is sharded or replicated (one collective per
mesh), and a plain gradient is the same on every rank that holds it, so its norm needs none.
Their combination is the norm one process would compute on the whole model, the same on every
rank; each rank then scales the gradients it holds by ``min(1, max_norm / (norm + 1e-6))``, as
``clip_grad_norm_`` does.

With pipelines each stage holds other parameters: ``pipeline_group`` (the ``"pipeline"`` group
of the mesh) combines the stages' norms (a sum of ``norm ** p``, a maximum for ``inf``), so every
element of every stage counts once.

Gradients must already be summed over the data-parallel group (the step's sync), so the copies
a gradient has on other HDP ranks are equal and not counted again.  Under ZeRO-2 on the mesh
each HDP rank of a lane holds the summed gradients of the parameters it owns only (every lane of
an HDP rank the same parameters): pass ``group`` (the lane's data-parallel group) and each rank's
norm, over what it holds as above, is combined with the others' by one all-reduce of one
number, the sum of ``norm ** p`` (the maximum for the infinity norm), so every element still
counts once.  (Without the mesh, ZeRO-2's plain gradients use
:func:`lightning_bytescale.engine.zero.clip_grad_norm_`.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_bytescale.engine.comm_device import HOST, comm_device


def _kind(grad: torch.Tensor) -> tuple:
    """Gradients whose norms torch computes together: DTensors by mesh, plain tensors by device."""
    if isinstance(grad, DTensor):
        return ("dtensor", grad.device_mesh)
    return ("plain", grad.device)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _held_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of the gradients this rank holds, DTensors whole (their collectives on their meshes)."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault(_kind(g), []).append(g)
    device = _local(grads[0]).device
    norms = []
    for group in by_kind.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norms.append(norm.to(device))
    return torch.nn.utils.get_total_norm(norms, norm_type)


def _combined(norm: torch.Tensor, norm_type: float, group: dist.ProcessGroup) -> torch.Tensor:
    """The norm of the whole from the norms of the disjoint parts the ranks of ``group`` hold (one all-reduce)."""
    if math.isinf(norm_type):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm.pow(norm_type)
    dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
    return powered.pow(1.0 / norm_type)


@torch.no_grad()
def global_grad_norm(
    parameters: Iterable[nn.Parameter],
    norm_type: float = 2.0,
    group: dist.ProcessGroup | None = None,
    *,
    pipeline_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The norm of all gradients as one vector, each element counted once; call on every rank.

    ``group``: each rank of it holds a different part of the gradients (ZeRO-2's owners, module
    docstring); ``pipeline_group``: the parameters are one stage's, and the norm is over every
    stage's.  The parts' norms are combined over each group given.
    """
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if group is None and pipeline_group is None:
        return _held_norm(grads, norm_type) if grads else torch.zeros(())
    norm_type = float(norm_type)
    locals_ = [_local(t) for t in (grads or params[:1])]
    device = locals_[0].device if locals_ else HOST  # where the norm is returned (the gradients' device)
    dtype = locals_[0].dtype if grads else torch.float32
    # float64 on every rank: ranks may hold gradients of other dtypes, or none at all
    held = _held_norm(grads, norm_type) if grads else torch.zeros(())
    total = held.to(torch.float64)
    for over in (group, pipeline_group):
        if over is not None:
            total = _combined(total.to(comm_device(over)), norm_type, over)
    return total.to(device, dtype)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    group: dist.ProcessGroup | None = None,
    *,
    pipeline_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over DTensor and plain gradients alike; returns the total norm.

    Every rank of the run must call it (DTensor norms are collectives on their meshes), with
    its parameters in the same order.  ``group`` (the ranks of it hold different parts of the
    gradients: ZeRO-2 on the mesh, the lane's data-parallel group) and ``pipeline_group`` (the
    stages of a pipeline): see :func:`global_grad_norm`.
    """
    every = list(parameters)
    params = [p for p in every if p.grad is not None]
    total = global_grad_norm(every, norm_type, group, pipeline_group=pipeline_group)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    by_device: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        local = _local(p.grad)
        by_device.setdefault((local.device, local.dtype), []).append(local)
    for (device, _), locals_ in by_device.items():
        torch._foreach_mul_(locals_, coef.to(device))  # as torch's clip_grads_with_norm_
    return total


__all__ = ["clip_grad_norm_", "global_grad_norm"]
