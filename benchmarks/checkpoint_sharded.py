"""Checkpoints under ZeRO: sharded (every rank writes its part) against consolidated (rank 0 writes all).

Run: ``python benchmarks/checkpoint_sharded.py``; writes ``benchmarks/results/checkpoint_sharded.json``
and prints a table.  On 2 busy cores it takes a few minutes, most of them in the
consolidated save.

Four gloo ranks on loopback each hold the project's Llama ``125m`` preset in float32 (100.1M
parameters) and Adam wrapped in ``ZeroRedundancyOptimizer``, after one step (so each rank holds
the Adam state of its partition, 0.8 GB in all).  For each path a fresh set of processes saves
once and loads once, with what ``ByteScaleStrategy`` runs for it:

* ``sharded``: ``sharded_optimizer_state`` and ``save_sharded`` (torch.distributed.checkpoint:
  each rank writes its own optimizer entries and a share of the replicated model), then
  ``load_sharded`` (each rank reads the model and the entries its partition owns);
* ``consolidated``: ``ZeroRedundancyOptimizer.consolidate_state_dict`` (Lightning's
  ``Strategy.optimizer_state``) and rank 0 writing one file through Lightning's
  ``TorchCheckpointIO``; loading reads the whole file on every rank (Lightning's
  ``Strategy.load_checkpoint``) and the optimizer keeps its own partition.

Times are wall seconds until every rank is done (the slowest rank, barrier included).  Memory
is each rank's peak resident set above its resident set just before (``VmHWM`` reset through
``/proc/self/clear_refs``).  After loading, every rank checks that its optimizer state and the
model equal what was saved.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import free_port, init_gloo, machine, reset_peak, run_ranks, status_kib, write_rank

WORLD = 4
PRESET = "125m"
MODES = ("sharded", "consolidated")


@torch.no_grad()
def _fingerprint(model: torch.nn.Module, zero) -> list[float]:
    """Sums of the model and of this rank's optimizer state (float64), to check a load."""
    opt = sum(
        float(v.double().sum())
        for state in zero.optim.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    return [sum(float(p.double().sum()) for p in model.parameters()), opt]


def _worker(rank: int, port: int, mode: str, folder: str, out: str) -> None:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lightning_bytescale.lightning.checkpoint import load_sharded, save_sharded, sharded_optimizer_state
    from lightning_bytescale.models.llama import LlamaConfig, LlamaModel

    torch.set_num_threads(1)
    init_gloo(rank, WORLD, port, timeout_s=600)
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig.preset(PRESET))
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, 1e-3 * (1 + i % 7))
    zero.step()
    for p in model.parameters():
        p.grad = None
    saved = _fingerprint(model, zero)
    gc.collect()
    io = TorchCheckpointIO()
    path = Path(folder) / ("sharded.ckpt" if mode == "sharded" else "consolidated.ckpt")

    dist.barrier()
    base = reset_peak()
    start = time.perf_counter()
    if mode == "sharded":
        checkpoint = {
            "state_dict": model.state_dict(),
            "optimizer_states": [sharded_optimizer_state(zero, model)],
            "global_step": 1,
        }
        save_sharded(checkpoint, path, rank=rank, barrier=dist.barrier)
    else:
        zero.consolidate_state_dict(to=0)  # Lightning's Strategy.optimizer_state
        checkpoint = {"state_dict": model.state_dict(), "global_step": 1}
        if rank == 0:
            checkpoint["optimizer_states"] = [zero.state_dict()]
            io.save_checkpoint(checkpoint, path)  # Lightning's Strategy.save_checkpoint: rank 0 only
        dist.barrier()
    save_s = time.perf_counter() - start
    save_peak = status_kib("VmHWM") - base
    del checkpoint
    zero._all_state_dicts = []  # what the consolidation left on rank 0
    gc.collect()

    with torch.no_grad():  # forget the state, so that only the load can bring it back
        for p in model.parameters():
            p.zero_()
        for state in zero.optim.state.values():
            for v in state.values():
                v.zero_()
    dist.barrier()
    base = reset_peak()
    start = time.perf_counter()
    if mode == "sharded":
        loaded = load_sharded(path, model, [zero])
    else:
        loaded = io.load_checkpoint(path, weights_only=False)  # every rank reads the whole file
    model.load_state_dict(loaded["state_dict"])
    zero.load_state_dict(loaded["optimizer_states"][0])
    del loaded
    dist.barrier()
    load_s = time.perf_counter() - start
    load_peak = status_kib("VmHWM") - base

    result = {
        "rank": rank,
        "save_s": save_s,
        "save_peak_above_start_mib": save_peak / 1024,
        "load_s": load_s,
        "load_peak_above_start_mib": load_peak / 1024,
        "optimizer_state_mib": sum(
            v.numel() * v.element_size()
            for state in zero.optim.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )
        / 2**20,
        "params": sum(p.numel() for p in model.parameters()),
        "restored": _fingerprint(model, zero) == saved,
    }
    write_rank(out, mode, rank, result)
    dist.destroy_process_group()


def _size(path: Path) -> int:
    return (
        sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        if path.is_dir()
        else path.stat().st_size
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "checkpoint_sharded.json"))
    parser.add_argument(
        "--dir", default=None, help="where the checkpoints are written (default: a temporary folder)"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bytescale-ckpt-", dir=args.dir))
    parts = work / "parts"
    parts.mkdir()
    result: dict = {
        "what": "save and load of a ZeRO-1 checkpoint on 4 CPU ranks: sharded (torch.distributed.checkpoint) "
        "against consolidated on rank 0",
        "model": f"LlamaModel preset {PRESET!r}, float32, Adam in ZeroRedundancyOptimizer",
        "world_size": WORLD,
        "machine": machine(),
    }
    try:
        for mode in MODES:
            folder = work / mode
            folder.mkdir()
            ranks = run_ranks(_worker, (free_port(), mode, str(folder), str(parts)), WORLD, parts, mode)
            written = next(folder.iterdir())
            result[mode] = {
                "save_s": max(r["save_s"] for r in ranks),
                "load_s": max(r["load_s"] for r in ranks),
                "save_peak_above_start_mib": [round(r["save_peak_above_start_mib"], 1) for r in ranks],
                "load_peak_above_start_mib": [round(r["load_peak_above_start_mib"], 1) for r in ranks],
                "bytes_written": _size(written),
                "files": sorted(f.name for f in written.iterdir()) if written.is_dir() else [written.name],
                "restored_on_every_rank": all(r["restored"] for r in ranks),
                "per_rank": ranks,
            }
            result["params"] = ranks[0]["params"]
            result["optimizer_state_mib_per_rank"] = [round(r["optimizer_state_mib"], 1) for r in ranks]
            shutil.rmtree(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    s, c = result["sharded"], result["consolidated"]
    result["consolidated_over_sharded"] = {
        "save_s": c["save_s"] / s["save_s"],
        "save_peak_rank0": c["save_peak_above_start_mib"][0] / max(s["save_peak_above_start_mib"][0], 1e-9),
        "save_peak_max_rank": max(c["save_peak_above_start_mib"])
        / max(max(s["save_peak_above_start_mib"]), 1e-9),
        "load_s": c["load_s"] / s["load_s"],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"{result['params'] / 1e6:.1f}M parameters, {WORLD} ranks, Adam state per rank (MiB): "
          f"{result['optimizer_state_mib_per_rank']}")  # fmt: skip
    header = "| path | save (s) | save: peak above start per rank (MiB) | load (s) | load: peak above start per rank (MiB) | written (MB) |"
    print(header)
    print("|---|---|---|---|---|---|")
    for mode in MODES:
        r = result[mode]
        save_mem = " / ".join(f"{x:.0f}" for x in r["save_peak_above_start_mib"])
        load_mem = " / ".join(f"{x:.0f}" for x in r["load_peak_above_start_mib"])
        print(
            f"| {mode} | {r['save_s']:.2f} | {save_mem} | {r['load_s']:.2f} | {load_mem} | "
            f"{r['bytes_written'] / 1e6:.0f} |"
        )
    ok = all(result[m]["restored_on_every_rank"] for m in MODES)
    print(f"restored exactly on every rank: {ok}; wrote {out}")


if __name__ == "__main__":
    main()
