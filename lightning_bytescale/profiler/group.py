"""Profiling an HDP rank that is a tensor-parallel group: its processes, its mesh, its figures.

Under tensor parallelism an HDP rank is a group of ``N`` devices (``ByteScaleStrategy(
tensor_parallel_size=N)``), and the planner balances HDP ranks, so the cost model it needs is a
group's: ``T(s)`` is the time of the group's layer (the slowest rank's: the lanes wait for each
other in every layer's all-reduce), ``Act(s)`` the bytes one lane saves (each device's memory is
what bounds the capacity), ``C`` the tokens one HDP rank, every lane of it, holds.

This module holds what a profile of such a group needs beyond the one-device profiler: running
a function in ``N`` processes (:func:`run_in_group`: the process group that exists, or ``N``
processes it starts on this host with explicit timeouts), the 1-D tensor-parallel mesh and the
sharding (:func:`shard_model`: ``parallelize_llama`` for the reference Llama, the caller's
function otherwise), the group's reductions of per-rank figures (:func:`group_reduce`) and the
parameters a rank holds (:func:`local_numel`).
"""

from __future__ import annotations

import datetime
import os
import queue
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_bytescale.engine.comm_device import comm_device
from lightning_bytescale.models.llama import LlamaModel
from lightning_bytescale.parallel.tensor_parallel import parallelize_llama
from lightning_bytescale.profiler.errors import ProfileError
from lightning_bytescale.profiler.processes import LOOPBACK, end_workers, start_workers


def check_tensor_parallel(tensor_parallel: Any) -> int:
    """``tensor_parallel`` as a positive int, or a :class:`ProfileError` naming the value."""
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ProfileError(
            f"tensor_parallel must be a positive integer (the devices of one HDP rank), got {tensor_parallel!r}"
        )
    return tensor_parallel


def in_group() -> bool:
    """Whether this process is a rank of an initialised default process group."""
    return dist.is_available() and dist.is_initialized()


def group_device(device: torch.device) -> torch.device:
    """This rank's device: the CPU, or its own CUDA device (``LOCAL_RANK``, else the rank modulo the devices)."""
    if device.type != "cuda":
        return device
    if device.index is not None:
        return device
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % max(1, torch.cuda.device_count())))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def tp_mesh(tensor_parallel: int, device: torch.device) -> DeviceMesh:
    """The 1-D mesh over the whole process group, named as the strategy's ``device_mesh["tensor_parallel"]``."""
    world = dist.get_world_size()
    if world != tensor_parallel:
        raise ProfileError(
            f"tensor_parallel={tensor_parallel}, but the process group that exists has {world} ranks; profile "
            f"one TP group: run {tensor_parallel} processes (torchrun --nproc-per-node {tensor_parallel}), or none "
            "and let the profiler start them"
        )
    return init_device_mesh(device.type, (tensor_parallel,), mesh_dim_names=("tensor_parallel",))


def shard_model(
    model: nn.Module, mesh: DeviceMesh, parallelize: Callable[[nn.Module, DeviceMesh], Any] | None
) -> nn.Module:
    """``model`` sharded over ``mesh`` by ``parallelize(model, mesh)`` (default: ``parallelize_llama``)."""
    if parallelize is None:
        if not isinstance(model, LlamaModel):
            raise ProfileError(
                f"cannot shard a {type(model).__name__} for tensor parallelism: pass parallelize=fn(model, tp_mesh) "
                "(lightning_bytescale.hf.parallelize_hf for a Hugging Face model); the reference LlamaModel uses "
                "parallelize_llama"
            )
        parallelize = parallelize_llama
    out = parallelize(model, mesh)
    return out if isinstance(out, nn.Module) else model


def group_reduce(values: Sequence[float], op: str) -> list[float]:
    """Every rank's ``values`` reduced element-wise over the process group (``op``: ``"max"`` or ``"min"``)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN)
    return [float(v) for v in t.tolist()]  # one copy back


def local_numel(module: nn.Module) -> int:
    """The parameter elements this rank holds: a DTensor's local shard, a plain tensor whole."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters())


def _rank_main(
    rank: int,
    port: int,
    world: int,
    device_type: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    out: Any,
) -> None:
    """One rank of the group: join it, run ``fn``, hand rank 0's result (or any rank's error) back."""
    try:
        os.environ["LOCAL_RANK"] = str(rank)
        if device_type == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo",
            init_method=f"tcp://{LOOPBACK}:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        result = fn(*args, **kwargs)
        if rank == 0:
            out.put(("ok", result))
        dist.destroy_process_group()
    except BaseException as err:  # report, never hang the parent  # noqa: BLE001
        out.put(("error", f"rank {rank}: {type(err).__name__}: {err}"))


def run_in_group(
    fn: Callable[..., Any],
    world: int,
    device_type: str,
    *args: Any,
    timeout_s: float = 600.0,
    **kwargs: Any,
) -> Any:
    """``fn(*args, **kwargs)`` in ``world`` new processes on this host (gloo on 127.0.0.1 for the CPU,
    NCCL with one CUDA device each); rank 0's return value.

    CUDA processes are spawned, CPU ones forked where the platform can
    (:func:`~lightning_bytescale.profiler.processes.start_method`): ``fn`` and its arguments (the
    model or its factory) must then pickle, which is checked before any process starts.  The
    process group's timeout is ``timeout_s``, and the whole run ends within about twice it: a
    rank's error, or no result by then, is a :class:`ProfileError`, and every process still
    running is killed.
    """
    if device_type == "cuda" and torch.cuda.device_count() < world:
        raise ProfileError(
            f"tensor_parallel={world} needs {world} CUDA devices on this host, found {torch.cuda.device_count()}; "
            "run on a node with enough devices, or under torchrun across them"
        )
    procs, out = start_workers(
        _rank_main, world, world, device_type, timeout_s, fn, args, kwargs, device_type=device_type
    )
    status, result = "error", "interrupted"
    try:
        status, result = out.get(timeout=2 * timeout_s + 30)
    except queue.Empty:
        status, result = "error", f"no result within {2 * timeout_s + 30:.0f} s"
    finally:
        end_workers(procs, 10 if status == "ok" else 1)
    if status != "ok":
        raise ProfileError(f"profiling a tensor-parallel group of {world} processes failed: {result}")
    return result


__all__ = [
    "check_tensor_parallel",
    "group_device",
    "group_reduce",
    "in_group",
    "local_numel",
    "run_in_group",
    "shard_model",
    "tp_mesh",
]
