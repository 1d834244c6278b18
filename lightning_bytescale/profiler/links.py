"""The links a plan's costs depend on: the host link (offload) and the point-to-point link (rings).

The host link is timed with pinned asynchronous copies in both directions on CUDA (a memcpy on
the CPU); the point-to-point link with a ``batch_isend_irecv`` exchange between two gloo
processes on 127.0.0.1, both directions at once, as a ring step moves K/V.  They become the
cost model's offload bandwidths (Eq. 3) and its ``bandwidth_intra`` / ``bandwidth_inter``.
"""

from __future__ import annotations

import datetime
import math
import queue
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_bytescale.profiler.errors import ProfileError
from lightning_bytescale.profiler.processes import end_workers, start_workers
from lightning_bytescale.profiler.timing import fastest


def measure_bandwidth(
    device: torch.device | str, nbytes: int = 64 * 2**20, repeats: int = 5
) -> tuple[float, float]:
    """``(device->host, host->device)`` bytes/s: pinned async copies on CUDA, a memcpy on CPU."""
    device = torch.device(device)
    if nbytes <= 0:
        raise ProfileError(f"bandwidth probe size must be > 0 bytes, got {nbytes}")
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        d2h = fastest(lambda: host.copy_(dev, non_blocking=True), device, 1, repeats)
        h2d = fastest(lambda: dev.copy_(host, non_blocking=True), device, 1, repeats)
        return nbytes / d2h, nbytes / h2d
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    t = fastest(lambda: dst.copy_(src), device, 1, repeats)
    return nbytes / t, nbytes / t


@dataclass(frozen=True)
class P2PBandwidth:
    """A measured point-to-point link: bytes/s per rank and direction, and one exchange's latency."""

    bandwidth: float  # bytes/s, each rank sending and receiving ``nbytes`` at once
    latency_s: float  # seconds for a one-element exchange (the fixed cost of one ring step)
    nbytes: int
    backend: str = "gloo"
    host: str = "127.0.0.1"


def _p2p_worker(rank: int, port: int, nbytes: int, repeats: int, timeout_s: float, out: Any) -> None:
    """One side of the exchange: both ranks send ``nbytes`` to and receive from the other at once."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        peer = 1 - rank

        def best_of(n: int, reps: int) -> float:
            send = torch.ones(n, dtype=torch.uint8)
            recv = torch.empty_like(send)
            best = math.inf
            for i in range(reps + 1):  # the first exchange warms the connection up
                dist.barrier()
                start = time.perf_counter()
                ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
                took = time.perf_counter() - start
                if i > 0:
                    best = min(best, took)
            return best

        latency = best_of(1, max(repeats, 5))
        took = best_of(nbytes, repeats)
        if rank == 0:
            out.put(("ok", took, latency))
        dist.destroy_process_group()
    except Exception as err:  # report, never hang the parent
        out.put(("error", f"rank {rank}: {type(err).__name__}: {err}", 0.0))


def measure_p2p_bandwidth(nbytes: int = 4 * 2**20, repeats: int = 5, timeout_s: float = 60.0) -> P2PBandwidth:
    """Point-to-point bandwidth between two gloo processes on 127.0.0.1 (a few seconds).

    Both processes post a ``batch_isend_irecv`` of one send of ``nbytes`` to the other and one
    receive from it (the pattern of a ring step); the fastest of ``repeats`` exchanges gives
    ``nbytes / seconds``, bytes/s per rank and direction, as the cost model counts it.  The
    latency is the same exchange with one byte.  Host tensors only: the processes are forked where
    the platform can (:func:`~lightning_bytescale.profiler.processes.start_method`).
    """
    if nbytes < 1 or repeats < 1:
        raise ProfileError(f"P2P probe needs nbytes >= 1 and repeats >= 1, got {nbytes}, {repeats}")
    procs, out = start_workers(_p2p_worker, 2, nbytes, repeats, timeout_s)
    try:
        status, took, latency = out.get(timeout=timeout_s + 30)
    except queue.Empty:
        status, took, latency = "error", f"no result within {timeout_s + 30:.0f} s", 0.0
    finally:
        end_workers(procs, 10)
    if status != "ok":
        raise ProfileError(
            f"the gloo P2P bandwidth probe on 127.0.0.1 failed ({took}); run without --p2p and give "
            "--bandwidth-intra/--bandwidth-inter instead"
        )
    return P2PBandwidth(bandwidth=nbytes / took, latency_s=latency, nbytes=nbytes)
