"""The process groups ``ByteScaleStrategy`` makes itself: the default group, and plain HDP's bucket group.

The strategy does not wrap the model in ``DistributedDataParallel``, so it makes the groups DDP's
strategy would: the default group at set-up (NCCL on CUDA, gloo on CPU, with the rank's device
named, so NCCL binds it at once instead of guessing), and, for plain HDP, a second group of every
rank on which the gradient buckets run beside the ring exchanges of the global group.  The
strategy keeps what these return; nothing here reads the strategy.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment

from lightning_bytescale.lightning import compat as compat


def init_default_group(
    environment: ClusterEnvironment, *, backend: str | None, device: torch.device, timeout: timedelta | None
) -> str:
    """Initialise the default process group on ``device`` (once per process); the backend it runs.

    ``backend=None`` picks NCCL on CUDA and gloo on CPU.  The accelerator has set the CUDA device
    before this call (Lightning's ``setup_environment``), so no NCCL call runs on another device.
    """
    backend = backend or compat._get_default_process_group_backend_for_device(device)
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    compat._init_dist_connection(environment, backend, **kwargs)
    return backend


def new_bucket_group(*, backend: str | None, timeout: timedelta | None, world_size: int) -> Any:
    """Plain HDP's bucket group: a group of every rank (to be created on every rank, once), ``None`` without peers.

    The bucket all-reduces may be in flight while other ranks' ring exchanges run
    point-to-point on the global group (each rank issues its own ring transfers before its
    buckets: docs/engine.md).  It gets the global group's timeout (a new group's default is
    the backend's, 30 min on gloo), so a peer stuck before its last bucket fails the others
    as fast as one stuck elsewhere.  On the mesh the buckets run on the lane's data-parallel group.
    """
    if not compat._distributed_is_initialized() or world_size <= 1:
        return None
    return dist.new_group(backend=backend, timeout=timeout)


__all__ = ["init_default_group", "new_bucket_group"]
