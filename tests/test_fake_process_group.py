"""A fake-process-group test leaves nothing to the ranks a later test forks (``tests/_fake_pg.py``).

One process runs DTensor on a fake world, as the fake-group tests do, then forks two gloo ranks,
as the Trainer tests' fork launcher does.  The fake world's mesh is built on a group of its own
(named ``"1"``), each rank's mesh of the same layout on the world group (``"0"``): equal meshes
to DTensor's sharding-propagation cache, which the ranks inherit.  Each rank runs the op the fake
world ran, the ``.double()`` of ``precision="64-true"``, and its result must live on the rank's
own mesh; a cached fake-world mesh fails with ``Could not resolve the process group registered
under the name 1`` (the failure of ``test_2x1x2_tensor_parallel_stages_equal_one_process``
after ``tests/parallel/test_mesh_grad_sync.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _fake_pg import fake_world
from _ranks import free_port, init_gloo, run_ranks
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

pytestmark = pytest.mark.multiprocess

WORLD = 2
NAMES = ("tensor_parallel",)


def _sharded_double(mesh: DeviceMesh) -> torch.Tensor:
    return distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)]).double()


def _rank(rank: int, port: int) -> None:
    init_gloo(rank, WORLD, port, timeout_s=30)
    try:
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=NAMES)
        out = _sharded_double(mesh)
        assert out.device_mesh.get_group() is mesh.get_group()
        assert out.device_mesh.get_local_rank() == rank
    finally:
        dist.destroy_process_group()


def test_ranks_forked_after_a_fake_world_build_their_dtensors_on_their_own_mesh():
    with fake_world() as join:
        join(0, WORLD)
        mesh = DeviceMesh.from_group(dist.new_group(list(range(WORLD))), "cpu", mesh_dim_names=NAMES)
        assert mesh.get_group().group_name != dist.group.WORLD.group_name
        assert _sharded_double(mesh).device_mesh is mesh  # DTensor cached this op's output on the fake mesh
    run_ranks(_rank, WORLD, free_port(), timeout_s=60, method="fork")  # what the Trainer tests' launcher does
