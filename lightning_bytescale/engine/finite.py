"""Whether gradients are all finite: one exact rule, and no host sync on a GPU.

The step checks its gradients for NaN and inf in two places (a rank's accumulated gradients
after its last micro-batch, and each gradient bucket as it is launched); both use this rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def all_finite(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A 0-d bool on the tensors' device: every element of every tensor is finite (``None``: no tensors).

    A max-abs norm is finite exactly when every element is: a NaN or inf propagates through the
    maximum, and a maximum of finite values cannot overflow.  A CPU computes it several times
    slower than an L2 norm, so there an L2 pass comes first: its norms are all finite only if
    every element is (they may also overflow on huge finite values), and only otherwise does
    the max-abs pass decide; reading that flag costs a CPU nothing.  On a GPU the one max-abs
    pass runs and the flag stays on the device.

    A DTensor counts by its local shard, with no collective: a rank answers for what it holds,
    and the step's all-reduce of the ranks' reports decides together.
    """
    tensors = [_local(t) for t in tensors]
    if not tensors:
        return None
    if tensors[0].device.type == "cpu" and bool(_norms_finite(tensors, 2)):
        return torch.ones((), dtype=torch.bool)
    return _norms_finite(tensors, math.inf)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (tensor-parallel or FSDP2 gradients): each rank checks what it holds."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _norms_finite(tensors: list[torch.Tensor], order: float) -> torch.Tensor:
    norms = torch._foreach_norm(tensors, order)
    return torch.isfinite(torch.stack([n.to(norms[0].dtype) for n in norms])).all()


__all__ = ["all_finite"]
