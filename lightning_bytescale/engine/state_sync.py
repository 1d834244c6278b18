"""Make every rank start from rank 0's parameters and buffers, as DDP does when it wraps a model.

HDP does not wrap the model in ``DistributedDataParallel``, so nothing else would make the
ranks start equal: a model built without a seed would differ on every rank, and since every
rank applies the same summed gradient, the ranks would train different models silently.
:func:`broadcast_module_state` copies rank 0's tensors to all ranks in a few coalesced
broadcasts (one flat buffer per dtype, bounded in size), with public ``torch.distributed``
calls only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from lightning_bytescale.engine.comm_device import comm_device

BUCKET_BYTES = 256 * 1024 * 1024


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Parameters then buffers of ``module``, each once, in a fixed order."""
    seen: set[int] = set()
    out = []
    for t in (*module.parameters(), *module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _buckets(tensors: Iterable[torch.Tensor], limit: int) -> Iterable[list[torch.Tensor]]:
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for group in by_kind.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > limit:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            yield bucket


@torch.no_grad()
def broadcast_tensors(
    tensors: Iterable[torch.Tensor],
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    bucket_bytes: int = BUCKET_BYTES,
) -> int:
    """Overwrite ``tensors`` on every rank with ``src``'s values; returns the number of broadcasts.

    Each bucket travels on the group's device (:func:`~lightning_bytescale.engine.comm_device.comm_device`),
    whatever device its tensors live on: a host tensor (AdamW's ``step``) goes over NCCL through
    the GPU and back.  Without an initialised process group (a single process) nothing happens.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    device = comm_device(group)
    calls = 0
    for bucket in _buckets([t for t in tensors if t.numel() > 0], bucket_bytes):
        flat = torch.cat([t.detach().reshape(-1).to(device) for t in bucket])
        dist.broadcast(flat, src=src, group=group)
        calls += 1
        offset = 0
        for t in bucket:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n
    return calls


def broadcast_module_state(module: nn.Module, src: int = 0, group: dist.ProcessGroup | None = None) -> int:
    """Give every rank ``src``'s parameters and buffers (in place); returns the broadcast count."""
    return broadcast_tensors(module_tensors(module), src=src, group=group)


__all__ = ["BUCKET_BYTES", "broadcast_module_state", "broadcast_tensors", "module_tensors"]
