"""Peak memory of the gradient sync above the gradients themselves: flat all-reduce vs buckets.

Run: ``python benchmarks/grad_sync_memory.py`` (a few minutes on 2 cores, most of it the mesh case); writes
``benchmarks/results/grad_sync_memory.json``.

Two gloo ranks on loopback each hold a model of about 100M float32 parameters: six 4096 x 4096
linear layers (every parameter larger than a bucket) or 400 512 x 512 ones (small parameters
sharing buckets).  For each way of syncing, a fresh pair of processes runs one backward and the
sync, and reads the process's peak resident memory (``VmHWM``, reset through
``/proc/self/clear_refs`` just before; the bucketed sync's gradients, allocated as its buckets
before that, are added back).  The same backward without any sync is the baseline:
it holds the activations and the gradients once.  What the sync adds above that baseline:

* ``flat``: ``engine.allreduce_gradients`` copies every gradient into one flat buffer (the
  first landing's sync): about the gradients' size again;
* ``bucketed``: ``engine.grad_sync.BucketedGradSync`` (25 MB buckets, the strategy's default):
  the gradients are views of the buckets and each bucket is all-reduced in place.

The ``mesh`` case is the same on four gloo ranks as a ``(data_parallel=2, tensor_parallel=2)``
mesh: twelve pairs of 1024 x 4096 and 4096 x 1024 linear layers (about 100M parameters), each
pair sharded as a Megatron MLP (``ColwiseParallel``, ``RowwiseParallel``), so each rank holds
half of every weight (8 MiB shards, three to a bucket); the sync sums the shards over the rank's
lane of the data-parallel dimension.  ``flat`` is what the mesh did before its sync was
bucketed (the local shards, ``parallel.LocalShards``, flattened into one buffer by
``engine.allreduce_gradients``), ``bucketed`` the sync on DTensor gradients it does now.
``--mesh-only`` measures this case alone and merges it into the result file.

CPU memory is what this machine has; the same accounting holds for device memory.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as common
import torch
import torch.distributed as dist
from torch import nn

# (layers, width): 6 x 4096^2 (each parameter larger than a bucket: buckets of their own) and
# 400 x 512^2 (many small parameters sharing buckets); both about 100M parameters
MODELS = {"large_parameters": (6, 4096), "small_parameters": (400, 512)}
BATCH = 8
BUCKET_BYTES = 25 * 2**20
MESH_WORLD, MESH_TP = 4, 2
MESH_PAIRS, MESH_WIDTH = 12, 1024  # 12 x (1024 x 4096 + 4096 x 1024): about 100M parameters


def _one_step(model: nn.Module, group: Any, mode: str, width: int, flat: Callable[[], None]) -> dict:
    """A warm-up backward, then one backward and the sync of ``mode`` (``flat()`` for "flat"): its peak and buckets.

    The peak is above the resident memory just before the backward; the bucketed sync's gradients,
    allocated as its buckets before that, are counted in it, as the others' are.
    """
    from lightning_bytescale.engine.grad_sync import BucketedGradSync

    params = list(model.parameters())
    x = torch.randn(BATCH, width)
    model(x).square().mean().backward()  # warm-up: allocator and autograd set-up
    model.zero_grad(set_to_none=True)
    sync = BucketedGradSync(params, group=group, bucket_bytes=BUCKET_BYTES) if mode == "bucketed" else None
    if sync is not None:
        sync.prepare()  # the gradients are allocated here, as the buckets
    dist.barrier()
    common.reset_peak()
    base = common.status_kib("VmHWM")
    if sync is not None:
        sync.arm()
    model(x).square().mean().backward()
    if mode == "flat":
        flat()
    elif sync is not None:
        sync.finish()
    peak = common.status_kib("VmHWM")
    prealloc = 0
    if sync is not None:
        prealloc = sum(
            b.buffer.numel() * b.buffer.element_size() for b in sync.buckets if b.buffer is not None
        )
    return {
        "mode": mode,
        "peak_above_start_mib": (peak - base) / 1024 + prealloc / 2**20,
        "params": sum(p.numel() for p in params),
        "buckets": len(sync.buckets) if sync is not None else 0,
        "launched_in_backward": sync.launched_in_backward if sync is not None else 0,
    }


def _worker(rank: int, port: int, mode: str, out: str, layers: int, width: int) -> None:
    from lightning_bytescale.engine.executor import allreduce_gradients

    torch.set_num_threads(1)
    common.init_gloo(rank, 2, port, timeout_s=120)
    group = dist.new_group([0, 1])
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    params = list(model.parameters())
    result = _one_step(model, group, mode, width, lambda: allreduce_gradients(params, group=group))
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
    common.write_rank(out, mode, rank, {"rank": rank, **result, "gradients_mib": grads / 2**20})
    dist.destroy_process_group()


def _mesh_worker(rank: int, port: int, mode: str, out: str) -> None:
    """One rank of the ``(2, 2)`` mesh: a backward of the TP-sharded MLP stack and the lane's gradient sync."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lightning_bytescale.engine.executor import allreduce_gradients
    from lightning_bytescale.parallel import LocalShards, ParallelDims

    torch.set_num_threads(1)
    common.init_gloo(rank, MESH_WORLD, port, timeout_s=300)
    pmesh = ParallelDims(MESH_WORLD, tensor_parallel=MESH_TP).build("cpu")
    torch.manual_seed(0)
    width = MESH_WIDTH
    shapes = [(width, 4 * width) if i % 2 == 0 else (4 * width, width) for i in range(2 * MESH_PAIRS)]
    model = nn.Sequential(*[nn.Linear(*shape, bias=False) for shape in shapes])
    plan = {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(2 * MESH_PAIRS)}
    parallelize_module(model, pmesh.tp_mesh, plan)
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]

    def flat() -> None:  # the mesh's sync before: the local shards in one flat buffer
        shards = LocalShards(list(model.named_parameters()))
        allreduce_gradients([p for _, p in shards.named], group=pmesh.dp_group)
        shards.write_back()

    result = _one_step(model, pmesh.dp_group, mode, width, flat)
    grads = sum(t.numel() * t.element_size() for t in local)
    result |= {"rank": rank, "gradients_mib": grads / 2**20, "local_params": sum(t.numel() for t in local)}
    common.write_rank(out, mode, rank, result)
    dist.destroy_process_group()


def measure_mesh(tmp: Path) -> dict:
    """The ``mesh`` case: peak above the backward, flat against bucketed, on the ``(2, 2)`` mesh.

    The ranks run with glibc's mmap threshold fixed at 1 MiB (``MALLOC_MMAP_THRESHOLD_``): with
    its default, which rises to the size of the largest block freed, the warm-up's 8 MiB
    gradient shards would stay resident in the heap after they are freed and the next ones reuse
    them unseen, so the peak would not count live tensors.
    """
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(2**20)  # read by each spawned rank when it starts
    try:
        runs = {
            mode: common.run_ranks(_mesh_worker, (common.free_port(), mode, str(tmp)), MESH_WORLD, tmp, mode)
            for mode in ("none", "flat", "bucketed")
        }
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    summary = _above_backward(runs)
    return {
        "mesh": [MESH_WORLD // MESH_TP, MESH_TP],
        "pairs": MESH_PAIRS,
        "width": MESH_WIDTH,
        "model_params": runs["flat"][0]["params"],
        "rank_params": runs["flat"][0]["local_params"],
        "rank_gradients_mib": runs["flat"][0]["gradients_mib"],
        **summary,
        "bucketed_extra_over_one_bucket": summary["bucketed"]["extra_above_backward_mib"]
        / (BUCKET_BYTES / 2**20),
    }


def _above_backward(runs: dict[str, list[dict]]) -> dict:
    """The backward-only peak (``"none"``), and for each sync the most any rank's peak exceeds it."""
    base = max(r["peak_above_start_mib"] for r in runs["none"])
    return {
        "backward_only_peak_above_start_mib": base,
        **{
            mode: {
                "extra_above_backward_mib": max(r["peak_above_start_mib"] for r in runs[mode]) - base,
                "per_rank": runs[mode],
            }
            for mode in ("flat", "bucketed")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "grad_sync_memory.json"))
    parser.add_argument(
        "--mesh-only", action="store_true", help="measure the mesh case alone, merged into --out"
    )
    args = parser.parse_args()
    tmp = common.parts_folder(args.out)
    bucket_mib = BUCKET_BYTES / 2**20
    if args.mesh_only:
        result = json.loads(Path(args.out).read_text())
        result["mesh"] = measure_mesh(tmp) | {"machine": common.machine()}
        common.remove_parts(tmp)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        for mode in ("flat", "bucketed"):
            print(
                f"mesh {mode:9s} extra above the backward: {result['mesh'][mode]['extra_above_backward_mib']:8.1f} MiB"
            )
        return
    result: dict = {
        "what": "peak resident memory of backward + gradient sync above the same backward without a sync",
        "bucket_mib": bucket_mib,
        "machine": common.machine(),
    }
    for name, (layers, width) in MODELS.items():
        runs = {}
        for mode in ("none", "flat", "bucketed"):
            runs[mode] = common.run_ranks(
                _worker, (common.free_port(), mode, str(tmp), layers, width), 2, tmp, mode
            )
        summary = _above_backward(runs)
        result[name] = {
            "layers": layers,
            "width": width,
            "model_params": runs["flat"][0]["params"],
            "gradients_mib": runs["flat"][0]["gradients_mib"],
            **summary,
            "bucketed_extra_over_one_bucket": summary["bucketed"]["extra_above_backward_mib"] / bucket_mib,
        }
        for mode in ("flat", "bucketed"):
            extra = summary[mode]["extra_above_backward_mib"]
            print(f"{name:17s} {mode:9s} extra above the backward: {extra:8.1f} MiB")
    result["mesh"] = measure_mesh(tmp)
    for mode in ("flat", "bucketed"):
        print(
            f"mesh              {mode:9s} extra above the backward: {result['mesh'][mode]['extra_above_backward_mib']:8.1f} MiB"
        )
    common.remove_parts(tmp)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"one bucket {bucket_mib:.0f} MiB; wrote {args.out}")


if __name__ == "__main__":
    main()
