"""Where the tensors of a collective or point-to-point call live: the process group's backend decides.

NCCL takes CUDA tensors only (a host tensor fails with ``No backend type associated with
device type cpu``); gloo takes host tensors (and copies CUDA ones through the host).  So a
tensor the package *builds* for a collective -- a flat gradient buffer, the step's scalars, a
plan digest, a flag, a norm, a broadcast buffer -- is made on :func:`comm_device` of the group
it travels on, never on the device of some other tensor that happens to be at hand (a host
``extra``, an empty parameter list, a host optimizer ``step``).  Gradients and parameters stay
where they are; values the host needs are copied back once per collective.

The rule is torch's own for object collectives: a group with a host backend (gloo, or a
``"cpu:gloo,cuda:nccl"`` pair) communicates on the host; a group registered for one
accelerator only (NCCL, or any backend registered with ``devices=["cuda"]``) on that
accelerator's current device, the one Lightning's accelerator set for this rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

HOST = torch.device("cpu")


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device of the tensors a collective on ``group`` (``None``: the default group) takes.

    The host without an initialised process group (a single process: nothing travels).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return HOST
    pg = group if group is not None else dist.group.WORLD
    types = {d.type for d in pg._device_types}
    if not types or "cpu" in types:
        return HOST
    kind = min(types)  # one accelerator type per group in practice
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    current = getattr(getattr(torch, kind, None), "current_device", None)
    return torch.device(kind, current()) if callable(current) else torch.device(kind)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """``dist.barrier`` on ``group`` with its device named (NCCL's barrier would guess it otherwise)."""
    device = comm_device(group)
    if device.type == "cpu" or device.index is None:
        dist.barrier(group=group)
    else:
        dist.barrier(group=group, device_ids=[device.index])


__all__ = ["HOST", "barrier", "comm_device"]
