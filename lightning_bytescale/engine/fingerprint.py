"""Bit-exact fingerprints of parameters, to detect ranks that train different models.

Every rank of an HDP run must hold the same parameters: gradients are summed over ranks and
each rank applies the same update.  A model built without a seed, a checkpoint loaded on one
node only, or a non-deterministic update would otherwise make ranks drift apart silently.

A fingerprint is the sum of a tensor's bit patterns read as integers, modulo ``2**32``.
Integer addition modulo a power of two is associative, so the value does not depend on the
summation order or the device: equal tensors always give equal fingerprints, and a change
of any bit changes it (up to a ``2**-32`` chance of collision).  The step's one all-reduce
carries them as exact integers (see :func:`lightning_bytescale.engine.executor.sync_step`),
so checking costs one pass over the parameters and no extra collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

FINGERPRINT_BITS = 32
_MASK = (1 << FINGERPRINT_BITS) - 1
_CHUNK = 1 << 24  # elements summed at a time: bounds the int64 copy of a large parameter
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 tensor on the tensor's device: its bit patterns summed modulo ``2**32``.

    A DTensor's is its local shard's: what the ranks of a data-parallel group compare is the same
    shard on each of them.
    """
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    as_int = flat.view(_INT_VIEW[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for chunk in as_int.split(_CHUNK):
        total = total + chunk.to(torch.int64).sum()
    return total & _MASK


def fingerprints(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[len(tensors)]`` int64 fingerprints on the host (one device-to-host copy)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack([tensor_fingerprint(t).to(tensors[0].device) for t in tensors]).cpu()


def combine(values: torch.Tensor) -> int:
    """One fingerprint for many: their sum modulo ``2**32`` weighted by position (order matters)."""
    weights = torch.arange(1, values.numel() + 1, dtype=torch.int64)
    return int((values.to(torch.int64) * weights).sum()) & _MASK


__all__ = ["FINGERPRINT_BITS", "combine", "fingerprints", "tensor_fingerprint"]
