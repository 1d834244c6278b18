"""Forward+backward time of zigzag ring attention on gloo ranks vs local attention, on CPU.

For each configuration (total tokens, sequences, heads) the script times, with one thread per
process:

* ``local_sdpa``: one process, all tokens, the public ``attention`` on a local layout
  (per-sequence ``scaled_dot_product_attention``);
* ``local_blocks``: one process, all tokens, the ring code path with a ring of one (the same
  block kernels the ring uses, no communication);
* ``loopback_N``: one process and thread, all N members of a ring run one after the other by
  the loopback ring (the P2P code path with in-memory transfers): the ring's compute and
  merge overhead with no network, as ``loopback_fraction_of_local_N = local_sdpa / loopback_N``
  (1.0: the ring costs nothing beyond the attention itself);
* ``ring_N``: N gloo ranks, each holding its zigzag share, with transfers posted before compute
  (``overlap``) and after it (``serial``).  Per rank it records step time, time blocked in
  transfer waits, bytes sent.

Modes alternate step by step and the minimum over steps is reported (the machine may be
shared).  Overlap: ``hidden_s = serial - overlap`` (step time saved by posting transfers first) and
``exposed_wait_fraction = wait(overlap) / wait(serial)`` (share of the transfer time still
visible).  Results go to ``benchmarks/results/ring_attention.json``.

    python benchmarks/ring_attention.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from _common import free_port, init_gloo

from lightning_bytescale.packed_attention import (
    AttentionLayout,
    attention,
    attention_context,
    comm_stats,
    loopback_ring_attention,
    reset_comm_stats,
    ring_attention,
    set_overlap,
)
from lightning_bytescale.packed_attention.loopback import ring_layouts, zigzag_shard
from lightning_bytescale.planner import zigzag

RESULTS = Path(__file__).resolve().parent / "results" / "ring_attention.json"
LOOPBACK_SIZES = (2, 4, 8)


def _inputs(num_slots: int, heads: int, kv_heads: int, dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_slots, heads, dim, generator=gen)
    k = torch.randn(num_slots, kv_heads, dim, generator=gen)
    v = torch.randn(num_slots, kv_heads, dim, generator=gen)
    dout = torch.randn(num_slots, heads, dim, generator=gen)
    return q, k, v, dout


def _ring_layout(seq_lens: list[int], ring: tuple[int, ...], member: int) -> AttentionLayout:
    slots = [zigzag.slots_per_member(s, len(ring)) for s in seq_lens]
    return AttentionLayout(torch.tensor([0, *slots]).cumsum(0), tuple(seq_lens), ring=ring, member=member)


def _time_alternating(fns: dict, iters: int) -> dict[str, float]:
    """Minimum time of each function over ``iters`` rounds, alternating them, after one warm-up."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for it in range(iters + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if it:
                times[name].append(time.perf_counter() - start)
    return {name: min(ts) for name, ts in times.items()}


def _fwd_bwd(run, q, k, v, dout):
    def step():
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        run(qq, kk, vv).backward(dout)

    return step


def _local(cfg: dict, iters: int) -> dict:
    torch.set_num_threads(1)
    lens = cfg["seq_lens"]
    q, k, v, dout = _inputs(sum(lens), cfg["heads"], cfg["kv_heads"], cfg["dim"])
    layout = AttentionLayout(torch.tensor([0, *lens]).cumsum(0), tuple(lens))

    def sdpa(qq, kk, vv):
        with attention_context(layout):
            return attention(qq, kk, vv)

    one = _ring_layout(lens, (0,), 0)
    q1, k1, v1, d1 = _inputs(int(one.cu_seqlens[-1]), cfg["heads"], cfg["kv_heads"], cfg["dim"])
    scale = cfg["dim"] ** -0.5
    fns = {
        "local_sdpa_s": _fwd_bwd(sdpa, q, k, v, dout),
        "local_blocks_s": _fwd_bwd(lambda a, b, c: ring_attention(a, b, c, one, scale=scale), q1, k1, v1, d1),
    }
    for n in LOOPBACK_SIZES:
        fns[f"loopback_{n}_s"] = _loopback_step(lens, n, q, k, v, dout)
    best = _time_alternating(fns, iters)
    for n in LOOPBACK_SIZES:
        best[f"loopback_fraction_of_local_{n}"] = best["local_sdpa_s"] / best[f"loopback_{n}_s"]
    return best


def _loopback_step(lens: list[int], n: int, q, k, v, dout):
    """Forward+backward of all ``n`` members of a ring, in this thread, on the same tokens."""
    layouts = ring_layouts(lens, n)
    parts = [zigzag_shard(x, layouts) for x in (q, k, v)]
    douts = zigzag_shard(dout, layouts)

    def step():
        ps = [[p.detach().requires_grad_() for p in xs] for xs in parts]
        torch.autograd.backward(loopback_ring_attention(*ps, layouts), douts)

    return step


def _worker(rank: int, world: int, port: int, cfg: dict, iters: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_gloo(rank, world, port, timeout_s=120)
    ring = tuple(range(world))
    layout = _ring_layout(cfg["seq_lens"], ring, rank)
    q, k, v, dout = _inputs(int(layout.cu_seqlens[-1]), cfg["heads"], cfg["kv_heads"], cfg["dim"], seed=rank)
    scale = cfg["dim"] ** -0.5
    step = _fwd_bwd(lambda a, b, c: ring_attention(a, b, c, layout, scale=scale), q, k, v, dout)
    report: dict = {mode: {"times": [], "waits": []} for mode in ("serial", "overlap")}
    # modes alternate step by step so that load changes on a shared machine hit both alike
    for it in range(2 * (iters + 1)):
        mode = "overlap" if it % 2 else "serial"
        set_overlap(mode == "overlap")
        dist.barrier()
        reset_comm_stats()
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        if it >= 2:  # the first step of each mode is a warm-up
            report[mode]["times"].append(elapsed)
            report[mode]["waits"].append(comm_stats()["wait_s"])
            report[mode]["bytes_sent"] = comm_stats()["bytes_sent"]
    set_overlap(True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(report, fh)
    dist.barrier()
    dist.destroy_process_group()


def _ring(cfg: dict, world: int, iters: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker, args=(world, free_port(), cfg, iters, tmp), nprocs=world, join=True, start_method="fork"
        )
        reports = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    out: dict = {"ranks": world}
    for mode in ("serial", "overlap"):
        # a step's time is its slowest rank's time; the minimum over steps is the least disturbed
        times = [max(r[mode]["times"][i] for r in reports) for i in range(iters)]
        waits = [statistics.mean(r[mode]["waits"][i] for r in reports) for i in range(iters)]
        out[mode] = {
            "step_s": min(times),
            "step_median_s": statistics.median(times),
            "mean_wait_s": statistics.median(waits),
        }
    out["bytes_sent_per_rank"] = reports[0]["overlap"]["bytes_sent"]
    out["hidden_s"] = out["serial"]["step_s"] - out["overlap"]["step_s"]
    wait_serial = out["serial"]["mean_wait_s"]
    out["exposed_wait_fraction"] = out["overlap"]["mean_wait_s"] / wait_serial if wait_serial > 0 else None
    out["wait_share_of_step_overlap"] = out["overlap"]["mean_wait_s"] / out["overlap"]["step_s"]
    out["wait_share_of_step_serial"] = wait_serial / out["serial"]["step_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    total = 512 if args.quick else 2048
    configs = [
        {"name": "one_long_sequence_gqa", "seq_lens": [total - 3], "heads": 8, "kv_heads": 2, "dim": 64},
        {
            "name": "four_packed_sequences_mha",
            "seq_lens": [total // 2, total // 4, total // 8, total // 8 - 5],
            "heads": 8,
            "kv_heads": 8,
            "dim": 64,
        },
    ]
    results = {
        "dtype": "float32",
        "device": "cpu",
        "threads_per_process": 1,
        "cpu_count": os.cpu_count(),
        "load_average_at_start": list(os.getloadavg()),
        "note": "ranks share cpu_count cores with each other and with other load; see load averages",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "iters": args.iters,
        "configs": [],
    }
    t0 = time.perf_counter()
    for cfg in configs:
        entry = {**cfg, "total_tokens": sum(cfg["seq_lens"])}
        entry.update(_local(cfg, args.iters))
        for world in (2, 4):
            ring = _ring(cfg, world, args.iters)
            ring["speedup_vs_local_blocks"] = entry["local_blocks_s"] / ring["overlap"]["step_s"]
            entry[f"ring_{world}"] = ring
        results["configs"].append(entry)
        print(json.dumps(entry, indent=1))
    results["wall_s"] = time.perf_counter() - t0
    results["load_average_at_end"] = list(os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out} in {results['wall_s']:.1f} s")


if __name__ == "__main__":
    main()
