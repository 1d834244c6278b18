"""Peak memory of the gradient sync above the gradients themselves: flat all-reduce vs buckets.

Run: ``python benchmarks/grad_sync_memory.py`` (about a minute on 2 cores); writes
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

CPU memory is what this machine has; the same accounting holds for device memory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import _common as common
import torch
import torch.distributed as dist
from torch import nn

# (layers, width): 6 x 4096^2 (each parameter larger than a bucket: buckets of their own) and
# 400 x 512^2 (many small parameters sharing buckets); both about 100M parameters
MODELS = {"large_parameters": (6, 4096), "small_parameters": (400, 512)}
BATCH = 8
BUCKET_BYTES = 25 * 2**20


def _worker(rank: int, port: int, mode: str, out: str, layers: int, width: int) -> None:
    from lightning_bytescale.engine.executor import allreduce_gradients
    from lightning_bytescale.engine.grad_sync import BucketedGradSync

    torch.set_num_threads(1)
    common.init_gloo(rank, 2, port, timeout_s=120)
    group = dist.new_group([0, 1])
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
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
        allreduce_gradients(params, group=group)
    elif sync is not None:
        sync.finish()
    peak = common.status_kib("VmHWM")
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
    prealloc = 0
    if sync is not None:
        prealloc = sum(
            b.buffer.numel() * b.buffer.element_size() for b in sync.buckets if b.buffer is not None
        )
    result = {
        "rank": rank,
        "mode": mode,
        # the shared buckets (= those gradients) exist before the window: count them, as the others' are
        "peak_above_start_mib": (peak - base) / 1024 + prealloc / 2**20,
        "gradients_mib": grads / 2**20,
        "params": sum(p.numel() for p in params),
        "buckets": len(sync.buckets) if sync is not None else 0,
        "launched_in_backward": sync.launched_in_backward if sync is not None else 0,
    }
    common.write_rank(out, mode, rank, result)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "grad_sync_memory.json"))
    args = parser.parse_args()
    tmp = common.parts_folder(args.out)
    bucket_mib = BUCKET_BYTES / 2**20
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
        base = max(r["peak_above_start_mib"] for r in runs["none"])
        summary = {
            mode: {
                "extra_above_backward_mib": max(r["peak_above_start_mib"] for r in runs[mode]) - base,
                "per_rank": runs[mode],
            }
            for mode in ("flat", "bucketed")
        }
        result[name] = {
            "layers": layers,
            "width": width,
            "model_params": runs["flat"][0]["params"],
            "gradients_mib": runs["flat"][0]["gradients_mib"],
            "backward_only_peak_above_start_mib": base,
            **summary,
            "bucketed_extra_over_one_bucket": summary["bucketed"]["extra_above_backward_mib"] / bucket_mib,
        }
        for mode in ("flat", "bucketed"):
            extra = summary[mode]["extra_above_backward_mib"]
            print(f"{name:17s} {mode:9s} extra above the backward: {extra:8.1f} MiB")
    common.remove_parts(tmp)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"one bucket {bucket_mib:.0f} MiB; wrote {args.out}")


if __name__ == "__main__":
    main()
