"""This process as one rank of torch's fake process group, leaving nothing of it behind.

torch's fake process group (``torch.testing._internal.distributed.fake_pg``) lets one process
issue the collectives of one rank of a larger world.  Leaving it takes more than
``destroy_process_group``: DTensor caches its sharding propagation per op and input specs
(one cache in Python, one in the C++ dispatch fast path), and a cached result holds the output
``DeviceMesh`` object of the first call.  ``DeviceMesh`` equality ignores the process groups, so
a later mesh of the same layout, on a new process group, hits those entries and gets DTensors on
the fake world's mesh: its group names no longer resolve (``Could not resolve the process group
registered under the name 3``) or name another group.  Ranks forked from the pytest process (the
fork launcher, ``tests/_ranks.py``) inherit the caches, so a fake-group test broke a later
Trainer test.  :func:`fake_world` empties them whenever it leaves a fake world; the
``fake_process_group`` fixture (``tests/conftest.py``) is this for one test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


def forget_sharding_propagation() -> None:
    """Empty DTensor's sharding-propagation caches (Python and, where torch has it, the C++ fast path)."""
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if fast_path is not None:
        fast_path()


def leave() -> None:
    """Destroy this process's process group, if any, and forget the meshes DTensor cached on it."""
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_sharding_propagation()


@contextlib.contextmanager
def fake_world() -> Iterator[Callable[[int, int], None]]:
    """``join(rank, world)`` makes this process rank ``rank`` of a fake world (leaving the one before).

    On exit, even by an error, the process holds no process group and DTensor no mesh of it.
    """

    def join(rank: int, world: int) -> None:
        leave()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    try:
        yield join
    finally:
        leave()
