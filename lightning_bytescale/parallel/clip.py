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
a gradient has on other HDP ranks are equal and not counted again.  Not for ZeRO-2's sharded
plain gradients, whose owners each hold a different part:
:func:`lightning_bytescale.engine.zero.clip_grad_norm_` is for those.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _kind(grad: torch.Tensor) -> tuple:
    """Gradients whose norms torch computes together: DTensors by mesh, plain tensors by device."""
    if isinstance(grad, DTensor):
        return ("dtensor", grad.device_mesh)
    return ("plain", grad.device)


def _over_stages(norm: torch.Tensor, norm_type: float, pipeline_group: dist.ProcessGroup) -> torch.Tensor:
    """The norm over every stage of the pipeline from each stage's own norm (one all-reduce)."""
    if norm_type == float("inf"):
        total = norm.clone()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pipeline_group)
        return total
    total = norm.double() ** norm_type
    dist.all_reduce(total, group=pipeline_group)
    return (total ** (1.0 / norm_type)).to(norm.dtype)


@torch.no_grad()
def global_grad_norm(
    parameters: Iterable[nn.Parameter],
    norm_type: float = 2.0,
    *,
    pipeline_group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The norm of all gradients as one vector, each element counted once; call on every rank.

    ``pipeline_group``: the parameters are one stage's, and the norm is over every stage's.
    ``device``: where the norm of a rank without gradients is made (default the CPU).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        empty = torch.zeros((), dtype=torch.float64, device=device)
        return empty if pipeline_group is None else _over_stages(empty, norm_type, pipeline_group)
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault(_kind(g), []).append(g)
    device = grads[0].to_local().device if isinstance(grads[0], DTensor) else grads[0].device
    norms = []
    for group in by_kind.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norms.append(norm.to(device))
    total = torch.nn.utils.get_total_norm(norms, norm_type)
    return total if pipeline_group is None else _over_stages(total, norm_type, pipeline_group)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    pipeline_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over DTensor and plain gradients alike; returns the total norm.

    Every rank of the run must call it (DTensor norms are collectives on their meshes), with
    its parameters in the same order.  ``pipeline_group``: as for :func:`global_grad_norm`.
    """
    params = [p for p in parameters if p.grad is not None]
    total = global_grad_norm(params, norm_type, pipeline_group=pipeline_group)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    by_device: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        by_device.setdefault((local.device, local.dtype), []).append(local)
    for (device, _), locals_ in by_device.items():
        torch._foreach_mul_(locals_, coef.to(device))  # as torch's clip_grads_with_norm_
    return total


__all__ = ["clip_grad_norm_", "global_grad_norm"]
