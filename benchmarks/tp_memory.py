"""Peak memory per rank through an HDP step: (4, 1) with ZeRO against (2, 2) tensor parallel, with and without FSDP2.

Run: ``python benchmarks/tp_memory.py`` (a few minutes on 2 cores); writes
``benchmarks/results/tp_memory.json``.  ``--layouts 2x2_tp_zero1 --merge`` runs only the layouts
named and puts them into the existing file, keeping its other rows (each layout records its own
machine, load and time: ``measured_at``).  Not run in CI.

Four gloo ranks on loopback train the reference Llama's ``125m`` preset (124M float32
parameters, tied embeddings) on one global batch with a sequence long enough to need a ring,
planned by the balance planner for the HDP ranks of each layout:

* ``4x1_zero1`` / ``4x1_zero2``: every rank a whole replica, the existing path as it is
  (``engine.executor.run_step`` with ``engine.grad_sync.BucketedGradSync``,
  ``ZeroRedundancyOptimizer(AdamW)``; ZeRO-2 reduces each bucket to its owner and clips with
  ``engine.zero.clip_grad_norm_``);
* ``2x2_tp``: ``(data_parallel=2, tensor_parallel=2)``, ``parallelize_llama``, AdamW,
  ``parallel.run_parallel_step`` and ``parallel.clip_grad_norm_``;
* ``2x2_tp_fsdp2`` and ``4x1_fsdp2``: the same with ``fully_shard`` per block and at the root over
  ``"data_parallel"``, driven by ``parallel.FSDPStepDriver``.
* ``2x2_tp_zero1`` / ``2x2_tp_zero2``: ``2x2_tp`` with the strategy's ZeRO on the mesh
  (``lightning.mesh.LaneZero`` around AdamW: each parameter's optimizer state on one HDP rank of
  the lane, owners broadcast their updated shards); ZeRO-2 also reduces each gradient to its owner
  (``run_parallel_step(..., grad_owners=...)``) and clips with
  ``parallel.clip_grad_norm_(..., group=pmesh.dp_group)``.

Each rank runs two steps (the first allocates the optimizer state) and reports, for the second,
its peak resident memory from the start of the step through the optimizer step (``VmHWM``
reset through ``/proc/self/clear_refs`` at the step's start), its resident memory before the
model was built (the interpreter and torch), and the bytes it holds of parameters, gradients
(after the sync) and optimizer state.  The ranks run with ``MALLOC_MMAP_THRESHOLD_`` at 1 MiB,
so a freed large tensor leaves the resident set at once (as in ``zero_memory.py``).  CPU memory
is what this machine has; the same accounting holds for device memory.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import _common as common
import torch
import torch.distributed as dist

WORLD = 4
LENGTHS = (96, 40, 150, 64, 30, 500, 120, 80, 56, 200)  # 500 > capacity: a ring
CAPACITY = 256
STEPS = 2
MIB = 2**20
LAYOUTS = ("4x1_zero1", "4x1_zero2", "2x2_tp", "2x2_tp_zero1", "2x2_tp_zero2", "2x2_tp_fsdp2", "4x1_fsdp2")


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _optimizer_bytes(opt) -> int:
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer holds its shard's optimizer
    return _local_bytes(
        v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0
    )


def _worker(rank: int, port: int, layout: str, preset: str, out: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lightning_bytescale.engine import build_step, run_step
    from lightning_bytescale.engine.grad_sync import BucketedGradSync
    from lightning_bytescale.engine.zero import clip_grad_norm_ as zero_clip
    from lightning_bytescale.engine.zero import owner_ranks
    from lightning_bytescale.lightning.mesh import LaneZero
    from lightning_bytescale.models import LlamaConfig, LlamaModel
    from lightning_bytescale.parallel import (
        FSDPStepDriver,
        ParallelDims,
        clip_grad_norm_,
        parallelize_llama,
        run_parallel_step,
    )
    from lightning_bytescale.planner import make_plan

    torch.set_num_threads(1)
    common.init_gloo(rank, WORLD, port, timeout_s=600)
    baseline = common.status_kib("VmRSS")
    tp = 2 if layout.startswith("2x2") else 1
    pmesh = ParallelDims(WORLD, tensor_parallel=tp).build("cpu")
    cfg = LlamaConfig.preset(preset)
    torch.manual_seed(0)
    model = LlamaModel(cfg)
    zero = layout.startswith("4x1_zero")
    grad_group = dist.new_group(list(range(WORLD))) if zero else None
    if tp > 1:
        parallelize_llama(model, pmesh.tp_mesh)
    driver = None
    if layout.endswith("fsdp2"):
        for block in model.blocks:
            fully_shard(block, mesh=pmesh.dp_mesh, reshard_after_forward=False)
        fully_shard(model, mesh=pmesh.dp_mesh, reshard_after_forward=False)
        driver = FSDPStepDriver(model, pmesh.dp_group)
    params = list(model.parameters())
    if zero:
        opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-4)
        owners = owner_ranks([opt]) if layout == "4x1_zero2" else None
        sync = BucketedGradSync(params, group=grad_group, owners=owners)
    else:
        opt = torch.optim.AdamW(params, lr=1e-4)
    lane_zero = LaneZero(opt, pmesh) if "_tp_zero" in layout else None  # wraps opt.step
    grad_owners = lane_zero.gradient_owners if layout.endswith("_tp_zero2") else None
    clip_group = pmesh.dp_group if grad_owners is not None else None
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, cfg.vocab, (n,), generator=g) for n in LENGTHS]
    plan = make_plan(
        list(LENGTHS), world_size=pmesh.dims.data_parallel, capacity=CAPACITY, planner="balance", seed=0
    )
    row: dict = {}
    for s in range(STEPS):
        step = build_step(plan, pmesh.hdp_rank, lambda j: seqs[j], step=s, ring_ranks=pmesh.ring_ranks)
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        start_rss = common.reset_peak()
        t0 = time.perf_counter()
        if zero:
            run_step(model, step, grad_sync=sync)
            grads = _local_bytes(p.grad for p in params)
            if owners is not None:
                zero_clip(params, 1.0)
            else:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
        else:
            run_parallel_step(model, step, pmesh, fsdp=driver, grad_owners=grad_owners)
            grads = _local_bytes(p.grad for p in model.parameters())
            clip_grad_norm_(model.parameters(), 1.0, group=clip_group)
        opt.step()
        seconds = time.perf_counter() - t0
        row = {
            "rank": rank,
            "hdp_rank": pmesh.hdp_rank,
            "micro_batches": len(step.micro_batches),
            "tokens": sum(mb.layout.num_slots for mb in step.micro_batches),
            "peak_rss_step_mib": common.status_kib("VmHWM") / 1024,
            "rss_step_start_mib": start_rss / 1024,
            "rss_before_model_mib": baseline / 1024,
            "parameters_mib": _local_bytes(model.parameters()) / MIB,
            "gradients_after_sync_mib": grads / MIB,
            "optimizer_state_mib": _optimizer_bytes(opt) / MIB,
            "step_s": seconds,
        }
        row["peak_above_baseline_mib"] = row["peak_rss_step_mib"] - row["rss_before_model_mib"]
    if zero:
        sync.close()
    common.write_rank(out, layout, rank, row)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="125m", help="LlamaConfig preset (at least 100M parameters)")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "tp_memory.json"))
    parser.add_argument(
        "--merge",
        action="store_true",
        help="put the layouts run into the existing --out, keeping its other rows",
    )
    args = parser.parse_args()
    from lightning_bytescale.models import LlamaConfig

    cfg = LlamaConfig.preset(args.preset)
    tmp = common.parts_folder(args.out)
    result: dict = {
        "what": "peak resident memory per rank through one HDP step (the second), per parallel layout",
        "world_size": WORLD,
        "model": {
            "preset": args.preset,
            "params": cfg.num_params(),
            "dtype": "float32",
            "tied": cfg.tie_embeddings,
        },
        "global_batch": {"lengths": list(LENGTHS), "capacity": CAPACITY, "planner": "balance"},
        "optimizer": "AdamW",
        "malloc_mmap_threshold_mib": 1,
        "machine": common.machine(),
        "layouts": {},
    }
    if args.merge and Path(args.out).exists():
        result = json.loads(Path(args.out).read_text())
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MIB)  # read by each spawned rank's C library at start
    keys = (
        "peak_above_baseline_mib",
        "peak_rss_step_mib",
        "parameters_mib",
        "gradients_after_sync_mib",
        "optimizer_state_mib",
    )
    for layout in args.layouts:
        t0 = time.perf_counter()
        ranks = common.run_ranks(
            _worker, (common.free_port(), layout, args.preset, str(tmp)), WORLD, tmp, layout
        )
        summary = {k: max(r[k] for r in ranks) for k in keys}
        result["layouts"][layout] = {
            "max_over_ranks": summary,
            "per_rank": ranks,
            "wall_s": time.perf_counter() - t0,
            "measured_at": {
                "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                "machine": common.machine(),
            },
        }
        print(
            f"{layout:13s} peak above the bare interpreter {summary['peak_above_baseline_mib']:7.0f} MiB; holds "
            f"parameters {summary['parameters_mib']:6.0f}, gradients {summary['gradients_after_sync_mib']:6.0f}, "
            f"optimizer state {summary['optimizer_state_mib']:6.0f} MiB (max over ranks)",
            flush=True,
        )
    common.remove_parts(tmp)
    result["layouts"] = {k: result["layouts"][k] for k in LAYOUTS if k in result["layouts"]}  # table order
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
