"""PP-Balance against equal micro-batch counts per pipeline on 4 CPU ranks, measured and simulated.

Run: ``python benchmarks/pipeline_balance.py`` (about 5-10 min on 2 shared cores); writes
``benchmarks/results/pipeline_balance.json`` and ``pipeline_balance.png``.
``bytescale-sim --measured benchmarks/results/pipeline_balance.json`` prints the measured bubble
of every variant and pipeline next to the simulator's for the same plans.

Set-up: ``ParallelDims(4, pipeline=2)``: two pipelines (HDP ranks) of two stages, gloo on
127.0.0.1, one thread per rank; the reference Llama "small" (dim 128, 4 blocks, vocab 512,
untied embeddings: two blocks per stage), float32, AdamW; ``run_pipeline_step`` (torch's
``Schedule1F1B``, ``ScheduleGPipe`` below two micro-batches).  Data: the ``byted`` length mix
scaled to a context of 2 x C (a sequence may span both pipelines: those longer than C are ring
items over both), ``--tokens`` tokens per global batch, one batch per step, the same batches for
both variants.

Variants (same batches, same cost model, ``offload=False``, ``pipeline_degree=2``):

* ``pp_balance``: ``make_plan(planner="balance")``, PP-Balance: the least-loaded pipeline by
  its 1F1B time draws the next micro-batch, so a pipeline of cheaper micro-batches gets more.
* ``equal_counts``: ``make_plan(planner="naive")`` (Alg. 1): the same number of micro-batches
  on every pipeline (to within one), blind to their cost, each long sequence on ``D(s)`` ranks.
  The planner has no switch that turns off only PP-Balance's count balancing; ``naive`` is its
  own A/B baseline for what the balance scheduler adds (docs/planner.md), and with two pipelines
  its ring sizes are the same as ``balance``'s (``D(s)`` = 2 for every sequence longer than C).

Measured per step and per rank: the step's wall time (from a barrier to the end of the
optimizer step; the step time is the slowest rank's), the schedule's wall time (torch's
``schedule.step``), and the stage's compute inside it (the stage's ``forward_one_chunk``,
``backward_one_chunk`` and, on the last stage, the loss; wrapped on the instance, timed with
``perf_counter``).  A stage's *bubble* is ``1 - compute / schedule wall``; a pipeline's is the
mean over its stages.  Ring K/V exchanges run inside the stages' forward and backward, so a
wait for the partner pipeline counts as compute here (as in the simulator, which does not
synchronise ring partners across pipelines).  Tokens/s: the batch's real tokens over the step
time; per pipeline (``pipeline_tokens_per_s``), its own tokens (its share of a ring item's) over
its schedule's wall time.

Simulated, for the same plans (:func:`lightning_bytescale.sim.pipeline_bubble.pipeline_bubbles`):
each pipeline's 1F1B makespan in the executed order with the cost model the profiler fitted on
this CPU for this model (``benchmarks/results/strategy_comm_aware.json``'s ``cost_model``: Llama
"small", float32, one process alone), once as the simulator costs micro-batches (their tokens)
and once padded to C as the executor runs them.

Variants run ``--rounds`` times, interleaved (their order alternates every round); the figures
are medians over rounds and steps, with the spread.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import free_port, init_gloo, parts_folder, remove_parts, run_parser, run_ranks, write_rank

from lightning_bytescale.planner import make_plan
from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.distributions import sample_global_batch
from lightning_bytescale.planner.plan import Plan
from lightning_bytescale.sim.pipeline_bubble import compare_measured, pipeline_bubbles

WORLD = 4
STAGES = 2
PIPELINES = WORLD // STAGES
CAPACITY = 512
TOKENS = 8192
LR = 1e-3
TIMEOUT_S = 300.0
VARIANTS = {"pp_balance": "balance", "equal_counts": "naive"}
FITTED = Path(__file__).parent / "results" / "strategy_comm_aware.json"


def step_lengths(step: int, tokens: int) -> list[int]:
    """One global batch's lengths: ``byted`` scaled to a context of ``PIPELINES x C``."""
    lengths = sample_global_batch(
        "byted", tokens, context_length=PIPELINES * CAPACITY, seed=step, mode="scale"
    )
    return [max(2, int(s)) for s in lengths]


def plans_for(variant: str, steps: int, tokens: int, cost: CostModel) -> list[Plan]:
    return [
        make_plan(
            step_lengths(s, tokens),
            world_size=PIPELINES,
            capacity=CAPACITY,
            planner=VARIANTS[variant],
            pipeline_degree=STAGES,
            cost_model=cost,
            offload=False,
            seed=s,
        )
        for s in range(steps)
    ]


class StageTimer:
    """Wraps a step's schedule on the instance: the schedule's wall time and the stage's compute in it."""

    def __init__(self) -> None:
        self.compute = 0.0
        self.wall = 0.0

    def _timed(self, fn, field: str):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - t0)

        return wrapper

    def attach(self, schedule) -> None:
        if schedule is None:
            return
        stage = schedule._stage
        stage.forward_one_chunk = self._timed(stage.forward_one_chunk, "compute")
        stage.backward_one_chunk = self._timed(stage.backward_one_chunk, "compute")
        schedule._compute_loss = self._timed(schedule._compute_loss, "compute")
        schedule.step = self._timed(schedule.step, "wall")


def worker(rank: int, port: int, parts: str, variant: str, plan_dicts: list[dict], seed: int) -> None:
    from lightning_bytescale.models.llama import LlamaConfig, LlamaModel
    from lightning_bytescale.parallel import LlamaStage, ParallelDims, build_pipeline_step, run_pipeline_step

    torch.set_num_threads(1)
    init_gloo(rank, WORLD, port, TIMEOUT_S)
    pmesh = ParallelDims(WORLD, pipeline=STAGES).build("cpu")
    torch.manual_seed(0)
    cfg = LlamaConfig.preset("small", tie_embeddings=False)
    stage = LlamaStage(LlamaModel(cfg), pmesh.stage, STAGES)
    opt = torch.optim.AdamW(stage.parameters(), lr=LR)
    rows = []
    for s, plan_dict in enumerate(plan_dicts):
        plan = Plan.from_json_dict(plan_dict)
        g = torch.Generator().manual_seed(seed * 1000 + s)
        seqs = [torch.randint(0, cfg.vocab, (n,), generator=g) for n in plan.lengths]
        batch = build_pipeline_step(
            plan,
            pmesh.hdp_rank,
            lambda j, seqs=seqs: seqs[j],
            stages=STAGES,
            step=s,
            ring_ranks=pmesh.ring_ranks,
        )
        timer = StageTimer()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        result = run_pipeline_step(stage, batch, pmesh, on_schedule=timer.attach)
        opt.step()
        step_s = time.perf_counter() - t0
        rows.append(
            {
                "step_s": step_s,
                "schedule_s": timer.wall,
                "compute_s": timer.compute,
                "counts": batch.counts,
                "padding": batch.padding,
                "loss": result.loss,
            }
        )
    write_rank(parts, "pp", rank, {"stage": pmesh.stage, "pipeline": pmesh.hdp_rank, "steps": rows})
    dist.destroy_process_group()


def run_variant(variant: str, plans: list[Plan], round_: int, out: str) -> list[dict]:
    """One run of ``variant`` on 4 fresh ranks; per step, the per-pipeline figures."""
    parts = parts_folder(out)
    load = os.getloadavg()[0]
    ranks = run_ranks(
        worker,
        (free_port(), str(parts), variant, [p.to_json_dict() for p in plans], round_),
        WORLD,
        parts,
        "pp",
    )
    remove_parts(parts)
    steps = []
    for s, plan in enumerate(plans):
        rows = [(r["stage"], r["pipeline"], r["steps"][s]) for r in ranks]
        step_s = max(row["step_s"] for _, _, row in rows)
        bubble, step_bubble, schedule, compute = [], [], [], []
        for p in range(PIPELINES):
            mine = [row for _, q, row in sorted(rows, key=lambda x: x[0]) if q == p]  # by stage
            stage_b = [
                1.0 - row["compute_s"] / row["schedule_s"] if row["schedule_s"] > 0 else 0.0 for row in mine
            ]
            bubble.append(statistics.fmean(stage_b))
            step_bubble.append(statistics.fmean(1.0 - row["compute_s"] / step_s for row in mine))
            schedule.append(max(row["schedule_s"] for row in mine))
            compute.append([row["compute_s"] for row in mine])
        steps.append(
            {
                "step_s": step_s,
                "tokens_per_s": sum(plan.lengths) / step_s,
                "bubble": bubble,
                "step_bubble": step_bubble,
                "schedule_s": schedule,
                "compute_s": compute,
                "counts": rows[0][2]["counts"],
                "loss": rows[0][2]["loss"],
                "load_avg_1m": load,
                "round": round_,
            }
        )
    return steps


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def simulated(plans: list[Plan], cost: CostModel) -> list[dict]:
    out = []
    for plan in plans:
        plain = pipeline_bubbles(plan, cost)
        padded = pipeline_bubbles(plan, cost, pad_to_capacity=True)
        out.append(
            {
                "counts": [b.micro_batches for b in plain],
                "bubble": [b.bubble for b in plain],
                "step_bubble": [b.step_bubble for b in plain],
                "step_s": max(b.makespan_s for b in plain),
                "bubble_padded": [b.bubble for b in padded],
                "step_s_padded": max(b.makespan_s for b in padded),
                "tokens_per_s": sum(plan.lengths) / max(b.makespan_s for b in plain),
            }
        )
    return out


def pipeline_tokens_per_s(variant: dict) -> list[list[float]]:
    """Per pipeline, for every measured step: its own real tokens (ring shares) over its schedule's wall time."""
    out: list[list[float]] = [[] for _ in range(PIPELINES)]
    for step in variant["steps"]:
        plan = Plan.from_json_dict(step["plan"])
        tokens = [sum(mb.num_tokens for mb in mbs) for mbs in plan.ranks]
        for m in step["measured"]:
            for p in range(PIPELINES):
                if m["schedule_s"][p] > 0:
                    out[p].append(tokens[p] / m["schedule_s"][p])
    return out


def summarise(variant: dict) -> dict:
    measured = [m for step in variant["steps"] for m in step["measured"]]
    sims = [step["simulated"] for step in variant["steps"]]
    return {
        "tokens_per_s": spread([m["tokens_per_s"] for m in measured]),
        "pipeline_tokens_per_s": [spread(x) for x in pipeline_tokens_per_s(variant)],
        "step_s": spread([m["step_s"] for m in measured]),
        "bubble": [spread([m["bubble"][p] for m in measured]) for p in range(PIPELINES)],
        "step_bubble": [spread([m["step_bubble"][p] for m in measured]) for p in range(PIPELINES)],
        "micro_batches": [statistics.fmean(s["counts"][p] for s in sims) for p in range(PIPELINES)],
        "simulated_bubble": [statistics.fmean(s["bubble"][p] for s in sims) for p in range(PIPELINES)],
        "simulated_bubble_padded": [
            statistics.fmean(s["bubble_padded"][p] for s in sims) for p in range(PIPELINES)
        ],
        "simulated_step_s": statistics.fmean(s["step_s"] for s in sims),
        "simulated_step_s_padded": statistics.fmean(s["step_s_padded"] for s in sims),
        "simulated_tokens_per_s": statistics.fmean(s["tokens_per_s"] for s in sims),
        "stage1_over_stage0_compute": spread(
            [
                m["compute_s"][p][1] / m["compute_s"][p][0]
                for m in measured
                for p in range(PIPELINES)
                if m["compute_s"][p][0] > 0
            ]
        ),
    }


def figure(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["variants"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.25
    for k, name in enumerate(names):
        summ = results["variants"][name]["summary"]
        for p in range(PIPELINES):
            x = k * (PIPELINES + 1) + p
            m = summ["bubble"][p]
            ax1.bar(x - width, m["median"], width, color="C0", label="measured" if k == p == 0 else None)
            ax1.errorbar(
                x - width,
                m["median"],
                [[m["median"] - m["min"]], [m["max"] - m["median"]]],
                color="k",
                capsize=3,
            )
            ax1.bar(
                x, summ["simulated_bubble"][p], width, color="C1", label="simulated" if k == p == 0 else None
            )
            ax1.bar(x + width, summ["simulated_bubble_padded"][p], width, color="C2",
                    label="simulated, padded to C" if k == p == 0 else None)  # fmt: skip
    ax1.set_xticks([k * (PIPELINES + 1) + p for k in range(len(names)) for p in range(PIPELINES)])
    ax1.set_xticklabels([f"{n}\npipeline {p}" for n in names for p in range(PIPELINES)], fontsize=8)
    ax1.set_ylabel("pipeline bubble (1 - compute / schedule wall)")
    ax1.legend(fontsize=8)
    for k, name in enumerate(names):
        t = results["variants"][name]["summary"]["tokens_per_s"]
        ax2.bar(k, t["median"], 0.6, color=f"C{k}")
        ax2.errorbar(
            k, t["median"], [[t["median"] - t["min"]], [t["max"] - t["median"]]], color="k", capsize=4
        )
    ax2.set_xticks(range(len(names)))
    ax2.set_xticklabels(names)
    ax2.set_ylabel("tokens/s (median, min-max)")
    fig.suptitle(
        f"PP-Balance vs equal counts, (pipeline=2, data_parallel=2) on {os.cpu_count()} shared CPU cores"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = run_parser(__doc__, "pipeline_balance", steps=6, warmup=1, rounds=5)
    parser.add_argument("--tokens", type=int, default=TOKENS, help="tokens per global batch")
    parser.add_argument("--summarise", action="store_true", help="redo --out's summaries and figure only")
    args = parser.parse_args()
    if args.summarise:  # the measured steps are in the file: recompute what is derived from them
        finish(json.loads(Path(args.out).read_text()), Path(args.out))
        return
    if args.warmup >= args.steps:
        parser.error(
            f"--warmup ({args.warmup}) must be below --steps ({args.steps}): nothing would be measured"
        )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cost = CostModel.from_json_dict(json.loads(FITTED.read_text())["cost_model"])
    plans = {v: plans_for(v, args.steps, args.tokens, cost) for v in VARIANTS}
    variants: dict = {
        v: {"planner": VARIANTS[v], "steps": [{"plan": p.to_json_dict(with_stats=False)} for p in plans[v]]}
        for v in VARIANTS
    }
    for v in VARIANTS:
        for step, sim in zip(variants[v]["steps"], simulated(plans[v], cost), strict=True):
            step["simulated"] = sim
            step["measured"] = []
    start = time.perf_counter()
    for r in range(args.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for v in order:
            for k, m in enumerate(run_variant(v, plans[v], r, args.out)):
                if m["counts"] != variants[v]["steps"][k]["simulated"]["counts"]:
                    raise RuntimeError(
                        f"{v} step {k}: executed counts {m['counts']} differ from the simulated order's"
                    )
                if k >= args.warmup:
                    variants[v]["steps"][k]["measured"].append(m)
            last = variants[v]["steps"][-1]["measured"][-1]
            print(
                f"round {r} {v}: {last['tokens_per_s']:.0f} tokens/s, bubble {last['bubble']}",
                file=sys.stderr,
            )
    for v in VARIANTS:
        variants[v]["steps"] = variants[v]["steps"][args.warmup :]
    results = {
        "setup": {
            "mesh": "ParallelDims(4, pipeline=2): 2 pipelines (HDP ranks) x 2 stages, gloo on 127.0.0.1",
            "model": "llama small (dim 128, 4 blocks, 2 KV heads x 16, vocab 512, untied), float32, AdamW",
            "capacity": CAPACITY,
            "pipeline_degree": STAGES,
            "tokens_per_step": args.tokens,
            "data": "byted length mix scaled to a context of 2 x C (sample_global_batch mode='scale')",
            "steps_per_run": args.steps,
            "warmup_steps": args.warmup,
            "rounds": args.rounds,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), torch {torch.__version__}, gloo",
            "cost_model_source": "benchmarks/results/strategy_comm_aware.json (profiler fit on this CPU)",
            "wall_s": time.perf_counter() - start,
        },
        "cost_model": cost.to_json_dict(),
        "variants": variants,
    }
    finish(results, Path(args.out))


def per_round_ratios(variants: dict) -> list[float]:
    """Per round, PP-Balance's median tokens/s over its steps divided by equal counts' (runs adjacent in time)."""
    by_round: dict[int, dict[str, list[float]]] = {}
    for v in VARIANTS:
        for step in variants[v]["steps"]:
            for m in step["measured"]:
                by_round.setdefault(m["round"], {}).setdefault(v, []).append(m["tokens_per_s"])
    return [
        statistics.median(r["pp_balance"]) / statistics.median(r["equal_counts"])
        for _, r in sorted(by_round.items())
    ]


def finish(results: dict, out: Path) -> None:
    """Summaries, ratios and the simulator's comparison from the measured steps; the JSON and the PNG."""
    variants = results["variants"]
    for v in VARIANTS:
        variants[v]["summary"] = summarise(variants[v])
    summ = {v: variants[v]["summary"] for v in VARIANTS}
    results["ratios"] = {
        "pp_balance_over_equal_counts_tokens_per_s": summ["pp_balance"]["tokens_per_s"]["median"]
        / summ["equal_counts"]["tokens_per_s"]["median"],
        "per_round": spread(per_round_ratios(variants)),
        "simulated_pp_balance_over_equal_counts_tokens_per_s": summ["pp_balance"]["simulated_tokens_per_s"]
        / summ["equal_counts"]["simulated_tokens_per_s"],
    }
    results["comparison"] = compare_measured(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, separators=(",", ":")) + "\n")  # compact: the plans are most of it
    figure(results, out.with_suffix(".png"))
    print(json.dumps(summ, indent=1))
    print(json.dumps(results["ratios"], indent=1))


if __name__ == "__main__":
    main()
