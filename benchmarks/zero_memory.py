"""Memory per rank at ZeRO levels 0, 1 and 2: gradients after the sync, optimizer state, resident memory.

Run: ``python benchmarks/zero_memory.py`` (about a minute on 2 cores); writes
``benchmarks/results/zero_memory.json``.

Four gloo ranks on loopback each hold a model of about 50M float32 parameters (twelve
2048 x 2048 linear layers) and run three steps of: backward, the bucketed gradient sync the
strategy uses (``engine.grad_sync.BucketedGradSync``, 25 MB buckets), clipping by norm, AdamW.
Level 0 is plain AdamW with all-reduced gradients; level 1 wraps AdamW in
``ZeroRedundancyOptimizer``; level 2 also reduces each bucket to the rank that owns its
optimizer state (``owners=engine.zero.owner_ranks(...)``), whose non-owners free it, and clips
with ``engine.zero.clip_grad_norm_``.  For the last step each rank reports the bytes of
gradients it holds after the sync, the bytes of its optimizer state, its resident memory after
the sync (``VmRSS``) and its peak resident memory from the sync's end through the optimizer
step (``VmHWM``, reset through ``/proc/self/clear_refs`` after the sync).  The ranks run with
``MALLOC_MMAP_THRESHOLD_`` at 1 MiB, so every large tensor is its own mapping and a freed one
leaves the resident set at once (glibc's default threshold rises to 32 MiB after the first
free, and 25 MB buckets freed inside the heap would stay resident, hiding what ZeRO-2 frees).
CPU memory is what this machine has; the same accounting holds for device memory.
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
from torch import nn

WORLD = 4
LAYERS, WIDTH = 12, 2048
BATCH = 8
STEPS = 3
BUCKET_BYTES = 25 * 2**20
MIB = 2**20


def _worker(rank: int, port: int, level: int, out: str) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lightning_bytescale.engine.grad_sync import BucketedGradSync
    from lightning_bytescale.engine.zero import clip_grad_norm_, owner_ranks

    torch.set_num_threads(1)
    common.init_gloo(rank, WORLD, port, timeout_s=300)
    grad_group = dist.new_group(list(range(WORLD)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    params = list(model.parameters())
    if level == 0:
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=1e-4)
    else:
        opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-4)
    owners = owner_ranks([opt]) if level == 2 else None
    sync = BucketedGradSync(params, group=grad_group, bucket_bytes=BUCKET_BYTES, owners=owners)
    x = torch.randn(BATCH, WIDTH)
    row: dict = {}
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        sync.prepare()
        sync.arm()
        model(x).square().mean().backward()
        dist.barrier()
        t0 = time.perf_counter()
        sync.finish()
        sync_s = time.perf_counter() - t0
        rss_after_sync = common.status_kib("VmRSS")
        common.reset_peak()
        if level == 2:
            clip_grad_norm_(params, 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        opt.step()
        peak = common.status_kib("VmHWM")
        local = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
        state = sum(
            v.numel() * v.element_size()
            for s in local.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.dim() > 0
        )
        row = {
            "rank": rank,
            "gradients_after_sync_mib": grads / MIB,
            "optimizer_state_mib": state / MIB,
            "rss_after_sync_mib": rss_after_sync / 1024,
            "peak_rss_clip_and_step_mib": peak / 1024,
            "sync_s": sync_s,
            "buckets": len(sync.buckets),
        }
    row["parameters_mib"] = sum(p.numel() * p.element_size() for p in params) / MIB
    common.write_rank(out, f"zero{level}", rank, row)
    sync.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "zero_memory.json"))
    args = parser.parse_args()
    tmp = common.parts_folder(args.out)
    result: dict = {
        "what": "memory per rank after the gradient sync and through the optimizer step, per ZeRO level",
        "world_size": WORLD,
        "model": {"layers": LAYERS, "width": WIDTH, "params": LAYERS * WIDTH * WIDTH, "dtype": "float32"},
        "optimizer": "AdamW",
        "bucket_mib": BUCKET_BYTES / MIB,
        "malloc_mmap_threshold_mib": 1,
        "machine": common.machine(),
        "levels": {},
    }
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MIB)  # read by each spawned rank's C library at start
    for level in (0, 1, 2):
        ranks = common.run_ranks(_worker, (common.free_port(), level, str(tmp)), WORLD, tmp, f"zero{level}")
        summary = {
            key: max(r[key] for r in ranks)
            for key in (
                "gradients_after_sync_mib",
                "optimizer_state_mib",
                "rss_after_sync_mib",
                "peak_rss_clip_and_step_mib",
            )
        }
        result["levels"][str(level)] = {"max_over_ranks": summary, "per_rank": ranks}
        print(
            f"zero={level}: gradients after the sync {summary['gradients_after_sync_mib']:7.1f} MiB, "
            f"optimizer state {summary['optimizer_state_mib']:7.1f} MiB, resident after the sync "
            f"{summary['rss_after_sync_mib']:7.1f} MiB, peak through the step "
            f"{summary['peak_rss_clip_and_step_mib']:7.1f} MiB (max over ranks)"
        )
    common.remove_parts(tmp)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
