"""The fake-NCCL tier's own checks can fail: it refuses what NCCL refuses, and its values and records are right.

A host tensor in a collective, a point-to-point exchange or on a mesh sub-group raises NCCL's
own error; the same calls on fake CUDA tensors run.  Values follow the tier's world (a
reduction leaves this rank's, a gather repeats them, a broadcast leaves the receive buffer) and
come back to the host through recorded copies (``.tolist()`` is one copy, as on CUDA).  Every
collective is recorded with the package function that called it.  And the device rule itself,
:func:`~lightning_bytescale.engine.comm_device.comm_device`: the host without a process group
and on gloo (also a group with gloo for the host next to an accelerator backend), the current
CUDA device on a backend registered for ``cuda`` only, for the default group and a sub-group.
Two kinds of state must not outlive a fake world or lie about memory: DTensor's cached sharding
propagation (a later world gets DTensors on its own mesh, not on the one before), and the
addresses of fake tensors (distinct per storage, as on a GPU, so code that asks whether a tensor
is a view of another gets the answer a GPU gives).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _fake_nccl import BACKEND, CUDA, RECORDED, fake_nccl, register_backend
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_bytescale.engine.comm_device import comm_device
from lightning_bytescale.parallel.dims import ParallelDims

NCCL_REFUSES_HOST = "No backend type associated with device type cpu"
D2H = "a device-to-host copy"


def test_a_host_tensor_fails_as_on_nccl_and_a_gpu_tensor_runs():
    with fake_nccl(world_size=4, rank=1) as mode:
        pmesh = ParallelDims(4, tensor_parallel=2).build("cuda")
        for group in (None, pmesh.dp_group, pmesh.tp_group):
            with pytest.raises(RuntimeError, match=NCCL_REFUSES_HOST):
                dist.all_reduce(torch.zeros(3), group=group)
            dist.all_reduce(torch.zeros(3, device=CUDA), group=group)
        with pytest.raises(RuntimeError, match=NCCL_REFUSES_HOST):
            dist.broadcast(torch.zeros(2), src=0)
        host, gpu = torch.zeros(4), mode.cuda(torch.zeros(4))
        with pytest.raises(RuntimeError, match=NCCL_REFUSES_HOST):
            dist.batch_isend_irecv([dist.P2POp(dist.isend, host, 2), dist.P2POp(dist.irecv, host.clone(), 0)])
        for work in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, gpu, 2), dist.P2POp(dist.irecv, gpu.clone(), 0)]
        ):
            work.wait()
    assert [c.kind for c in RECORDED] == ["all_reduce"] * 3 + ["p2p"] * 2  # only what ran


def test_values_follow_the_tiers_world_and_come_back_through_recorded_copies():
    with fake_nccl(world_size=3, rank=1) as mode:
        x = mode.cuda(torch.tensor([1.0, 2.0]))
        dist.all_reduce(x)  # the other ranks add nothing
        gathered = [torch.empty(2, device=CUDA) for _ in range(3)]
        dist.all_gather(gathered, x)  # the other ranks hold the same
        received = torch.full((2,), 7.0, device=CUDA)
        dist.broadcast(received, src=0)  # nothing arrives
        mode.syncs.clear()
        rows = torch.stack(gathered).tolist()
        host = (x * 10).cpu()
        kinds = [s.kind for s in mode.syncs]
        assert received.tolist() == [7.0, 7.0]
    assert rows == [[1.0, 2.0]] * 3 and host.tolist() == [10.0, 20.0] and type(host) is torch.Tensor
    assert kinds == [D2H, D2H]  # .tolist() is one copy, as on CUDA


def test_a_collective_is_recorded_with_the_package_function_that_called_it():
    from lightning_bytescale.profiler.group import group_reduce

    with fake_nccl(world_size=2, rank=0):
        group_reduce([1.0], "max")
        dist.all_reduce(torch.zeros(1, device=CUDA))
    assert [(c.module, c.function, c.kind) for c in RECORDED] == [
        ("profiler/group.py", "group_reduce", "all_reduce"),
        ("", "", "all_reduce"),  # the test's own call: no package frame
    ]


def test_comm_device_is_the_host_without_a_process_group_and_on_gloo():
    assert not dist.is_initialized() and comm_device() == torch.device("cpu")
    for backend in (
        "gloo",
        f"cpu:gloo,cuda:{BACKEND}",
    ):  # a host backend: the host, also beside an accelerator
        register_backend()
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        try:
            assert comm_device() == torch.device("cpu")
            assert comm_device(dist.new_group([0])) == torch.device("cpu")
        finally:
            dist.destroy_process_group()


def test_comm_device_is_the_current_gpu_on_a_backend_for_cuda_only():
    with fake_nccl(world_size=4, rank=3):
        pmesh = ParallelDims(4, tensor_parallel=2).build("cuda")
        devices = {comm_device(), comm_device(pmesh.dp_group), comm_device(pmesh.tp_group)}
    assert devices == {CUDA}


def test_a_later_world_builds_its_dtensors_on_its_own_mesh():
    """A fake world's cached sharding propagation holds its mesh; leaving the world forgets it.

    The first world's mesh is on a sub-group of its own (named ``"1"``), the second's, of the
    same layout, on its world group (``"0"``): equal meshes to DTensor's cache.  Kept, the cache
    would give the second world's op an output on the first world's mesh, whose group no longer
    exists (and a rank forked later from this process would inherit it: ``tests/_fake_pg.py``).
    """
    names = ("tensor_parallel",)
    with fake_nccl(world_size=2) as mode:
        mesh = DeviceMesh.from_group(dist.new_group([0, 1]), "cuda", mesh_dim_names=names)
        assert distribute_tensor(mode.cuda(torch.ones(4, 3)), mesh, [Shard(0)]).double().device_mesh is mesh
    with fake_nccl(world_size=2) as mode:
        mesh = init_device_mesh("cuda", (2,), mesh_dim_names=names)
        out = distribute_tensor(mode.cuda(torch.ones(4, 3)), mesh, [Shard(0)]).double()
        assert out.device_mesh is mesh and out.device_mesh.get_group() is dist.group.WORLD


def test_fake_tensors_have_addresses_of_their_own():
    """torch gives every fake storage the address 0; the tier gives each its own, views offset as on a GPU."""
    with fake_nccl() as mode:
        a, b = mode.cuda(torch.zeros(6)), torch.zeros(6, device=CUDA)
        view = a[2:]
        addresses = (a.data_ptr(), b.data_ptr(), view.data_ptr(), a.view(2, 3).data_ptr())
    assert addresses[0] != addresses[1]
    assert addresses[2] == addresses[0] + 2 * 4 and addresses[3] == addresses[0]
