"""How much of the gradient sync the cross-communicator rule keeps hidden behind the last backward.

Run: ``python benchmarks/grad_sync_overlap.py`` (about 20 minutes on 2 shared cores; ``--mesh-only``
about 10); writes
``benchmarks/results/grad_sync_overlap.json``.

The rule (docs/engine.md): gradient buckets launch from the hooks of a rank's last backward only
when that backward has no ring exchange; after a ring's backward they all launch when it ends.
The planner puts a local micro-batch last where that costs no estimated step time
(``planner/sync_order.py``).  Two parts:

* ``plans``: on plans of the real planners (``balance``, ``naive``, ``static`` with rings of 4)
  for long-tailed data (the ``byted`` mix, documents up to 4 capacities long) and all-short data
  (64..C tokens), C = 8192, 2 capacities a rank, the paper's cost model, 20 global batches each,
  for 4 to 64 ranks: how often a rank's last micro-batch is a ring as placed and after the
  reordering, how often the slowest rank's is (the one whose sync the step waits for), how many
  ranks the reordering moved, the plan's estimated step time before and after, and the
  reordering's planning time.
* ``measured``: 4 gloo ranks (on this machine's 2 cores) train a Llama of 5M float32 parameters
  (25 MB buckets: two, the first 1 MiB) on global batches of 4 capacities a rank (C = 256, the
  same data for every way) in four ways, interleaved step by step:
  ``old`` (buckets from the hooks of every last backward, ring or not: the code before the rule,
  unsafe on NCCL), ``rule`` (the rule on the plans as placed), ``rule_ordered`` (the rule on
  the reordered plans, what ``make_plan`` now gives) and ``no_overlap`` (every bucket launched
  after every rank's last backward).  Per step the exposed sync is the time from the last rank's
  end of backward to the last rank's end of the bucket all-reduces (the scalars are not in it);
  ``hidden`` is ``1 - exposed / exposed(no_overlap)`` on medians over steps.

* ``mesh``: the same Llama sharded by ``parallelize_llama`` on a ``(data_parallel=2,
  tensor_parallel=2)`` mesh of 4 gloo ranks, ``run_parallel_step`` on the balance planner's plans
  for 2 HDP ranks (4 capacities each, long-tailed data with rings of 2, and all-short data), in
  three ways interleaved step by step: ``flat`` (every lane's gradient shards in one all-reduce
  after the loop: the mesh before its sync was bucketed), ``bucketed`` (the buckets of local
  shards from the last backward's hooks, on the lane's data-parallel group: what the strategy
  runs now) and ``no_overlap`` (the same buckets, all launched after the last backward).  Per
  step the exposed sync is the time from the last rank's end of backward to the last rank's
  return from ``run_parallel_step`` (gradients summed, scalars agreed, the lanes agreed);
  ``hidden`` as above, against ``no_overlap``, and ``hidden_vs_flat`` against ``flat``.
  ``--mesh-only`` measures this part alone and merges it into the result file.

CPU numbers are about scheduling, not speed: the ranks share 2 cores, so a gloo all-reduce
competes with the backward it hides behind.  On a GPU the all-reduce runs on its own stream and
the share kept hidden is what matters.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import _common as common
import torch
import torch.distributed as dist

WORLD = 4
CAPACITY = 256
TOKENS_PER_STEP = WORLD * CAPACITY * 4
BUCKET_BYTES = 25 * 2**20
MODES = ("old", "rule", "rule_ordered", "no_overlap")
MESH_WORLD, MESH_TP = 4, 2
MESH_MODES = ("flat", "bucketed", "no_overlap")
DATA = ("long_tail", "all_short")
PLANNERS = {"long_tail": ("balance", "naive", "static"), "all_short": ("balance",)}


def global_batch(data: str, step: int, capacity: int, tokens: int, world: int) -> list[int]:
    """One global batch of ``tokens`` tokens: long-tailed up to ``min(4, world)`` capacities, or 64..C."""
    from lightning_bytescale.planner import distributions

    if data == "long_tail":
        return distributions.sample_global_batch(
            "byted", tokens=tokens, context_length=min(4, world) * capacity, seed=1000 + step
        )
    import random

    rng, out = random.Random(2000 + step), []
    while sum(out) < tokens:
        out.append(rng.randint(64, capacity))
    out[-1] -= sum(out) - tokens
    return [x for x in out if x > 0]


def plans_for(data: str, planner: str, step: int, world: int, capacity: int, tokens: int):
    """The step's plan as placed and as ``make_plan`` gives it (local micro-batch last where it costs nothing)."""
    from lightning_bytescale.planner import make_plan
    from lightning_bytescale.planner.planners import _place

    options = dict(world_size=world, capacity=capacity, planner=planner, seed=step)
    if planner == "static":
        options["cp_size"] = min(4, world)
    lengths = global_batch(data, step, capacity, tokens, world)
    return lengths, _place(lengths, **options), make_plan(lengths, **options)


# ----------------------------------------------------------------------------------- plans
def plan_statistics(batches: int) -> dict:
    from lightning_bytescale.planner.sync_order import local_last, ring_last_ranks

    out = {}
    for data in DATA:
        for planner in PLANNERS[data]:
            for world in (4, 8, 16, 64):
                capacity = 8192
                rows = {"ranks": 0, "ring_last_placed": 0, "ring_last_ordered": 0, "moved": 0}
                rows |= {"slowest_ring_last_placed": 0, "slowest_ring_last_ordered": 0, "plans": 0}
                est_placed, est_ordered, order_ms = [], [], []
                for step in range(batches):
                    lengths, placed, ordered = plans_for(
                        data, planner, step, world, capacity, world * capacity * 4
                    )
                    again = copy.deepcopy(placed)
                    t0 = time.perf_counter()
                    local_last(again)
                    order_ms.append((time.perf_counter() - t0) * 1e3)
                    rows["plans"] += 1
                    rows["ranks"] += world
                    rows["ring_last_placed"] += len(ring_last_ranks(placed))
                    rows["ring_last_ordered"] += len(ring_last_ranks(ordered))
                    rows["moved"] += sum(
                        bool(a) and a[-1].ring is not None and b[-1].ring is None
                        for a, b in zip(placed.ranks, ordered.ranks)
                    )
                    for plan, key, est in ((placed, "placed", est_placed), (ordered, "ordered", est_ordered)):
                        finish = plan.finish_times()
                        slowest = max(range(world), key=lambda r: finish[r])
                        rows[f"slowest_ring_last_{key}"] += int(slowest in ring_last_ranks(plan))
                        est.append(max(finish))
                rows["ring_last_share_placed"] = rows["ring_last_placed"] / rows["ranks"]
                rows["ring_last_share_ordered"] = rows["ring_last_ordered"] / rows["ranks"]
                rows["est_step_s_placed_mean"] = statistics.fmean(est_placed)
                rows["est_step_s_ordered_mean"] = statistics.fmean(est_ordered)
                rows["est_step_longer"] = sum(b > a * (1 + 1e-9) for a, b in zip(est_placed, est_ordered))
                rows["reorder_ms_median"] = statistics.median(order_ms)
                out[f"{data}/{planner}/w{world}"] = rows
    return out


# -------------------------------------------------------------------------------- measured
def _worker(rank: int, port: int, parts: str, steps: int, warmup: int) -> None:
    from lightning_bytescale.engine import build_step
    from lightning_bytescale.engine.executor import check_step, run_micro_batches, sync_step
    from lightning_bytescale.engine.grad_sync import BucketedGradSync
    from lightning_bytescale.models import LlamaConfig, LlamaModel

    torch.set_num_threads(1)
    common.init_gloo(rank, WORLD, port, timeout_s=300)
    grad_group = dist.new_group(list(range(WORLD)))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab=4096, dim=256, layers=4, heads=8, kv_heads=4, ffn_dim=688, tie_embeddings=False
    )
    model = LlamaModel(config)

    class TimedSync(BucketedGradSync):
        """The strategy's sync, with the mode's arming rule and timestamps."""

        mode = "rule"

        def arm(self) -> None:
            if self.mode != "no_overlap":
                super().arm()

        def finish(self) -> None:
            super().finish()
            self.done_at = time.perf_counter()

    sync = TimedSync(list(model.parameters()), group=grad_group, bucket_bytes=BUCKET_BYTES)
    rows = []
    for step in range(steps):
        for data in DATA:
            for planner in PLANNERS[data]:
                lengths, placed, ordered = plans_for(data, planner, step, WORLD, CAPACITY, TOKENS_PER_STEP)
                g = torch.Generator().manual_seed(step)
                tokens = [torch.randint(0, config.vocab, (s,), generator=g) for s in lengths]
                order = MODES[step % len(MODES) :] + MODES[: step % len(MODES)]  # each mode takes turns first
                for mode in order:
                    plan = ordered if mode == "rule_ordered" else placed
                    batch = build_step(plan, rank, lambda j, tokens=tokens: tokens[j], step=step)
                    sync.mode = mode
                    mbs = batch.micro_batches
                    ended = {}

                    def backward(loss, mbs=mbs, ended=ended, mode=mode) -> None:
                        ended["n"] = ended.get("n", 0) + 1
                        if mode == "old" and ended["n"] == len(mbs):
                            sync.arm()  # the code before the rule: hooks also in a ring's backward
                        loss.backward()
                        ended["at"] = time.perf_counter()

                    model.zero_grad(set_to_none=True)
                    dist.barrier()
                    check = check_step(batch, wait=False)
                    local = run_micro_batches(
                        model, mbs, backward=backward, grad_sync=sync, plan_check=check, step=step
                    )
                    sync_step(list(model.parameters()), batch, local, grad_sync=sync)
                    rows.append(
                        {
                            "step": step,
                            "data": data,
                            "planner": planner,
                            "mode": mode,
                            "last": "none"
                            if not mbs
                            else ("local" if mbs[-1].layout.ring is None else "ring"),
                            "backward_end": ended.get("at"),
                            "sync_done": sync.done_at,
                            "launched_in_backward": sync.launched_in_backward,
                            "bytes_launched_in_backward": sum(
                                4 * b.numel for b in sync.buckets[: sync.launched_in_backward]
                            ),
                            "bytes": sum(4 * b.numel for b in sync.buckets),
                        }
                    )
    common.write_rank(parts, "overlap", rank, {"rows": rows, "warmup": warmup})
    dist.destroy_process_group()


def _mesh_worker(rank: int, port: int, parts: str, steps: int, warmup: int) -> None:
    from lightning_bytescale.engine import build_step
    from lightning_bytescale.engine.grad_sync import BucketedGradSync
    from lightning_bytescale.models import LlamaConfig, LlamaModel
    from lightning_bytescale.parallel import ParallelDims, parallelize_llama, run_parallel_step

    torch.set_num_threads(1)
    common.init_gloo(rank, MESH_WORLD, port, timeout_s=300)
    pmesh = ParallelDims(MESH_WORLD, tensor_parallel=MESH_TP).build("cpu")
    hdp = pmesh.dims.data_parallel
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab=4096, dim=256, layers=4, heads=8, kv_heads=4, ffn_dim=688, tie_embeddings=False
    )
    model = LlamaModel(config)
    parallelize_llama(model, pmesh.tp_mesh)

    class TimedSync(BucketedGradSync):
        """The strategy's sync on the lane's data-parallel group; ``overlap=False`` never arms it."""

        overlap = True

        def arm(self) -> None:
            if self.overlap:
                super().arm()

    params = [p for p in model.parameters() if p.requires_grad]
    sync = TimedSync(params, group=pmesh.dp_group, bucket_bytes=BUCKET_BYTES)
    tokens_per_step = hdp * CAPACITY * 4
    rows = []
    for step in range(steps):
        for data in DATA:
            lengths, _, plan = plans_for(data, "balance", step, hdp, CAPACITY, tokens_per_step)
            g = torch.Generator().manual_seed(step)
            tokens = [torch.randint(0, config.vocab, (s,), generator=g) for s in lengths]
            batch = build_step(
                plan,
                pmesh.hdp_rank,
                lambda j, tokens=tokens: tokens[j],
                step=step,
                ring_ranks=pmesh.ring_ranks,
            )
            mbs = batch.micro_batches
            order = MESH_MODES[step % len(MESH_MODES) :] + MESH_MODES[: step % len(MESH_MODES)]
            for mode in order:
                ended: dict = {}

                def backward(loss, ended=ended) -> None:
                    loss.backward()
                    ended["at"] = time.perf_counter()

                sync.overlap = mode == "bucketed"
                model.zero_grad(set_to_none=True)
                dist.barrier()
                run_parallel_step(
                    model, batch, pmesh, backward=backward, grad_sync=None if mode == "flat" else sync
                )
                rows.append(
                    {
                        "step": step,
                        "data": data,
                        "mode": mode,
                        "last": "none" if not mbs else ("local" if mbs[-1].layout.ring is None else "ring"),
                        "backward_end": ended.get("at"),
                        "sync_done": time.perf_counter(),
                        "launched_in_backward": sync.launched_in_backward if mode != "flat" else 0,
                        "buckets": len(sync.buckets),
                    }
                )
    common.write_rank(parts, "mesh", rank, {"rows": rows, "warmup": warmup})
    dist.destroy_process_group()


def summarise_mesh(ranks: list[dict], warmup: int) -> dict:
    """Per data: each mode's exposed sync (median over steps), hidden against no_overlap and against flat."""
    steps: dict[tuple, list[dict]] = {}
    for rank, rep in enumerate(ranks):
        for row in rep["rows"]:
            if row["step"] >= warmup:
                steps.setdefault((row["data"], row["mode"], row["step"]), []).append(row | {"rank": rank})
    out: dict = {}
    for (data, mode, _step), rows in sorted(steps.items()):
        ends = [r["backward_end"] for r in rows if r["backward_end"] is not None]
        slowest = max((r for r in rows if r["backward_end"] is not None), key=lambda r: r["backward_end"])
        cell = out.setdefault(data, {}).setdefault(
            mode, {"exposed_ms": [], "slowest_last_ring": 0, "slowest_launched_in_backward": []}
        )
        cell["exposed_ms"].append((max(r["sync_done"] for r in rows) - max(ends)) * 1e3)
        cell["slowest_last_ring"] += int(slowest["last"] == "ring")
        cell["slowest_launched_in_backward"].append(slowest["launched_in_backward"])
    for modes in out.values():
        base = statistics.median(modes["no_overlap"]["exposed_ms"])
        flat = statistics.median(modes["flat"]["exposed_ms"])
        for cell in modes.values():
            cell["exposed_ms_median"] = statistics.median(cell["exposed_ms"])
            cell["hidden"] = 1.0 - cell["exposed_ms_median"] / base if base > 0 else 0.0
            cell["hidden_vs_flat"] = 1.0 - cell["exposed_ms_median"] / flat if flat > 0 else 0.0
            cell["steps"] = len(cell["exposed_ms"])
    return out


def measure_mesh(steps: int, warmup: int, out: str) -> dict:
    parts = common.parts_folder(out)
    ranks = common.run_ranks(
        _mesh_worker, (common.free_port(), str(parts), steps, warmup), MESH_WORLD, parts, "mesh"
    )
    common.remove_parts(parts)
    return {
        "setup": {"mesh": [MESH_WORLD // MESH_TP, MESH_TP], "capacity": CAPACITY, "planner": "balance"},
        "buckets": ranks[0]["rows"][0]["buckets"],
        "measured": summarise_mesh(ranks, warmup),
    }


def summarise(ranks: list[dict], warmup: int) -> dict:
    steps: dict[tuple, list[dict]] = {}
    for rank, rep in enumerate(ranks):
        for row in rep["rows"]:
            if row["step"] >= warmup:
                steps.setdefault((row["data"], row["planner"], row["mode"], row["step"]), []).append(
                    row | {"rank": rank}
                )
    out: dict = {}
    for (data, planner, mode, _step), rows in sorted(steps.items()):
        ends = [r["backward_end"] for r in rows if r["backward_end"] is not None]
        slowest = max((r for r in rows if r["backward_end"] is not None), key=lambda r: r["backward_end"])
        cell = out.setdefault(f"{data}/{planner}", {}).setdefault(
            mode,
            {
                "exposed_ms": [],
                "ring_last_ranks": [],
                "slowest_ring_last": 0,
                "slowest_bytes_in_backward": [],
            },
        )
        cell["exposed_ms"].append((max(r["sync_done"] for r in rows) - max(ends)) * 1e3)
        cell["ring_last_ranks"].append(sum(r["last"] == "ring" for r in rows))
        cell["slowest_ring_last"] += int(slowest["last"] == "ring")
        # the share of the gradient bytes whose all-reduce the slowest rank started inside its backward
        cell["slowest_bytes_in_backward"].append(slowest["bytes_launched_in_backward"] / slowest["bytes"])
    for modes in out.values():
        base = statistics.median(modes["no_overlap"]["exposed_ms"])
        for cell in modes.values():
            cell["exposed_ms_median"] = statistics.median(cell["exposed_ms"])
            cell["hidden"] = 1.0 - cell["exposed_ms_median"] / base if base > 0 else 0.0
            cell["steps"] = len(cell["exposed_ms"])
            cell["slowest_bytes_in_backward_mean"] = statistics.fmean(cell["slowest_bytes_in_backward"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batches", type=int, default=20, help="global batches per planning setting")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "grad_sync_overlap.json"))
    parser.add_argument(
        "--mesh-only", action="store_true", help="measure the mesh part alone, merged into --out"
    )
    args = parser.parse_args()
    if args.mesh_only:
        t0 = time.perf_counter()
        result = json.loads(Path(args.out).read_text())
        result["mesh"] = measure_mesh(args.steps, args.warmup, args.out)
        result["mesh"] |= {"machine": common.machine(), "wall_s": time.perf_counter() - t0}
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        for key, modes in result["mesh"]["measured"].items():
            print(
                "mesh",
                key,
                {m: (round(c["exposed_ms_median"], 1), round(c["hidden"], 2)) for m, c in modes.items()},
            )
        return
    setup = {k: v for k, v in vars(args).items() if k != "out"} | {"world": WORLD, "capacity": CAPACITY}
    result: dict = {"machine": common.machine(), "setup": setup | {"tokens_per_step": TOKENS_PER_STEP}}
    t0 = time.perf_counter()
    result["plans"] = plan_statistics(args.batches)
    parts = common.parts_folder(args.out)
    ranks = common.run_ranks(
        _worker, (common.free_port(), str(parts), args.steps, args.warmup), WORLD, parts, "overlap"
    )
    common.remove_parts(parts)
    result["measured"] = summarise(ranks, args.warmup)
    result["mesh"] = measure_mesh(args.steps, args.warmup, args.out)
    result["wall_s"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for key, modes in result["measured"].items():
        print(key, {m: (round(c["exposed_ms_median"], 1), round(c["hidden"], 2)) for m, c in modes.items()})
    for key, row in result["plans"].items():
        print(
            key,
            f"ring last {row['ring_last_share_placed']:.2f} -> {row['ring_last_share_ordered']:.2f}",
            row["moved"],
        )


if __name__ == "__main__":
    main()
