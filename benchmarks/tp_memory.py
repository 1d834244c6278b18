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
  (``parallel.zero.LaneZero`` around AdamW: each parameter's optimizer state on one HDP rank of
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

After the steps, the tensor-parallel layouts gather the model's and the optimizer's state for a
consolidated checkpoint twice, each time reporting the peak resident memory above its start and
the bytes it leaves the rank holding: as the strategy saves (``parallel.full_state.model_state`` /
``optimizer_state``: one tensor at a time onto global rank 0's host, ``consolidated_save_*``) and
with the options it used before (``full_state_dict=True, cpu_offload=False``: every rank keeps
every whole tensor, ``consolidated_save_gathered_everywhere_*``).  On a GPU the first keeps the
device at one gathered tensor and rank 0's state in host memory; on this machine host and device
are one memory, so rank 0 holds the whole state either way and the other ranks show the difference.

``embedding_gradient`` (``--embedding``, on by default): two ranks as one HDP rank of
``tensor_parallel=2`` run one micro-batch of the same preset with *untied* embeddings, so the
embedding is vocabulary-sharded (``RowwiseParallel``), and report per lane the bytes of the
embedding's gradient when autograd accumulates it and after the step's sync, with its placement:
a whole ``[V, dim]`` on every lane while DTensor has no row-wise embedding backward, half of it
once the gradient stays a shard.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from contextlib import nullcontext
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
SAVES = ("consolidated_save", "consolidated_save_gathered_everywhere")
EMBEDDING_WORLD = 2


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


def _consolidated_saves(model, opt) -> dict:
    """Peak resident memory above the start of each consolidated gather, what it leaves held, and its time."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.utils._pytree import tree_leaves

    from lightning_bytescale.parallel import full_state

    def as_the_strategy_saves():
        return full_state.model_state(model), full_state.optimizer_state(model, opt)

    def gathered_everywhere():  # the strategy's options before issue 35, item 6
        options = StateDictOptions(full_state_dict=True, cpu_offload=False)
        zero = getattr(opt, "_bytescale_lane_zero", None)
        with zero.materialized() if zero is not None else nullcontext():
            return get_model_state_dict(model, options=options), get_optimizer_state_dict(
                model, opt, options=options
            )

    row: dict = {}
    for key, save in zip(SAVES, (as_the_strategy_saves, gathered_everywhere)):
        gc.collect()
        dist.barrier()
        start = common.reset_peak()
        t0 = time.perf_counter()
        held = save()
        row[f"{key}_s"] = time.perf_counter() - t0
        row[f"{key}_peak_mib"] = (common.status_kib("VmHWM") - start) / 1024
        row[f"{key}_held_mib"] = _local_bytes(t for t in tree_leaves(held) if torch.is_tensor(t)) / MIB
        del held
    return row


def _embedding_worker(rank: int, port: int, preset: str, out: str) -> None:
    """One HDP rank of two lanes, untied embeddings: the embedding gradient each lane holds."""
    from lightning_bytescale.engine import build_step
    from lightning_bytescale.models import LlamaConfig, LlamaModel
    from lightning_bytescale.parallel import ParallelDims, parallelize_llama, run_parallel_step
    from lightning_bytescale.planner import make_plan

    torch.set_num_threads(1)
    common.init_gloo(rank, EMBEDDING_WORLD, port, timeout_s=600)
    pmesh = ParallelDims(EMBEDDING_WORLD, tensor_parallel=EMBEDDING_WORLD).build("cpu")
    cfg = LlamaConfig.preset(preset, tie_embeddings=False)
    torch.manual_seed(0)
    model = parallelize_llama(LlamaModel(cfg), pmesh.tp_mesh)
    weight = model.embed.weight
    accumulated: dict = {}

    def record(p) -> None:
        accumulated.update(bytes=_local_bytes([p.grad]), placements=str(getattr(p.grad, "placements", None)))

    weight.register_post_accumulate_grad_hook(record)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, cfg.vocab, (n,), generator=g) for n in LENGTHS[:4]]
    plan = make_plan([len(q) for q in seqs], world_size=1, capacity=CAPACITY * 2, planner="balance", seed=0)
    step = build_step(plan, pmesh.hdp_rank, lambda j: seqs[j], step=0, ring_ranks=pmesh.ring_ranks)
    run_parallel_step(model, step, pmesh)
    row = {
        "rank": rank,
        "lane": pmesh.lane,
        "weight_shape": list(weight.shape),
        "weight_placements": str(weight.placements),
        "weight_local_mib": _local_bytes([weight]) / MIB,
        "whole_mib": weight.numel() * weight.element_size() / MIB,
        "gradient_accumulated_mib": accumulated["bytes"] / MIB,
        "gradient_accumulated_placements": accumulated["placements"],
        "gradient_after_sync_mib": _local_bytes([weight.grad]) / MIB,
        "gradient_after_sync_placements": str(getattr(weight.grad, "placements", None)),
    }
    common.write_rank(out, "embedding", rank, row)
    dist.destroy_process_group()


def _worker(rank: int, port: int, layout: str, preset: str, out: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lightning_bytescale.engine import build_step, run_step
    from lightning_bytescale.engine.grad_sync import BucketedGradSync
    from lightning_bytescale.engine.zero import clip_grad_norm_ as zero_clip
    from lightning_bytescale.engine.zero import owner_ranks
    from lightning_bytescale.models import LlamaConfig, LlamaModel
    from lightning_bytescale.parallel import (
        FSDPStepDriver,
        ParallelDims,
        clip_grad_norm_,
        parallelize_llama,
        run_parallel_step,
    )
    from lightning_bytescale.parallel.zero import LaneZero
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
    if lane_zero is not None:
        opt._bytescale_lane_zero = (
            lane_zero  # as lightning.mesh.lane_zero marks it: a save materialises the state
        )
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
    if tp > 1:
        row.update(_consolidated_saves(model, opt))
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
    parser.add_argument(
        "--embedding",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the vocabulary-sharded embedding's gradient per lane (untied, 2 ranks)",
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
        saves = {
            key: {
                f"{who}_{what}": max(
                    r[f"{key}_{what}"] for r in ranks if (r["rank"] == 0) == (who == "rank_0")
                )
                for who in ("rank_0", "other_ranks")
                for what in ("peak_mib", "held_mib", "s")
            }
            for key in SAVES
            if f"{key}_peak_mib" in ranks[0]
        }
        result["layouts"][layout] = {
            "max_over_ranks": summary,
            **({"consolidated_saves": saves} if saves else {}),
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
        for key, save in saves.items():
            print(
                f"{'':13s} {key}: peak above its start rank 0 {save['rank_0_peak_mib']:6.0f} MiB, other ranks "
                f"{save['other_ranks_peak_mib']:6.0f} MiB; held rank 0 {save['rank_0_held_mib']:6.0f}, "
                f"others {save['other_ranks_held_mib']:6.0f} MiB",
                flush=True,
            )
    if args.embedding:
        t0 = time.perf_counter()
        lanes = common.run_ranks(
            _embedding_worker, (common.free_port(), args.preset, str(tmp)), EMBEDDING_WORLD, tmp, "embedding"
        )
        result["embedding_gradient"] = {
            "what": "the vocabulary-sharded embedding's gradient per lane: one HDP rank of tensor_parallel=2, "
            "the preset with untied embeddings, one micro-batch",
            "per_lane": lanes,
            "wall_s": time.perf_counter() - t0,
            "measured_at": {
                "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                "machine": common.machine(),
            },
        }
        for lane in lanes:
            print(
                f"embedding {lane['weight_shape']} lane {lane['lane']}: shard {lane['weight_local_mib']:.0f} MiB, "
                f"gradient accumulated {lane['gradient_accumulated_mib']:.0f} MiB "
                f"({lane['gradient_accumulated_placements']}), after the sync {lane['gradient_after_sync_mib']:.0f} MiB",
                flush=True,
            )
    common.remove_parts(tmp)
    result["layouts"] = {k: result["layouts"][k] for k in LAYOUTS if k in result["layouts"]}  # table order
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
