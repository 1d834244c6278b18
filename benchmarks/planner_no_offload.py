"""Planner comparison without offload (issue 16): ``balance`` against Megatron-DCP and plain LPT.

Every cell plans the same global batches with ``balance`` (``offload=False``), the
Megatron-DCP-style planner (``megatron_dcp``) and the longest-processing-time greedy on minimal
rings (``lpt``), and times each plan with the simulator (``lightning_bytescale.sim``: slowest
rank, ring waits and exposed ring transfers included, plus the gradient all-reduce).  Beside
them: ``balance_min_rings``, ``balance`` restricted to the paper's ``D(s)`` ranks per sequence
(what ``balance`` was before rings could grow).

Grid: every shipped length distribution x world sizes 8, 64, 256, 1,024 x two cost models
(``paper`` and ``slow-link``, :mod:`lightning_bytescale.planner.cost_presets`), ``C = 8K``,
8 micro-batches' worth of tokens a rank, context ``min(2M, ranks x C / 2)``, two global
batches per cell; plus the simulator scenarios ``paper-70b-github-2m`` and
``paper-8x22b-github-2m`` (pipelines of 4, their own model).  Also the planning CPU time of
``balance`` for 32M tokens on 16,384 ranks.

Each grid cell also gets the lower bound of :mod:`lightning_bytescale.sim.bounds`: no plan
without offload ends a step sooner in the simulator's model (the longest sequence on its best
ring, or all the work spread evenly, then the all-reduce).  Where two planners tie at the
bound, neither can be beaten there.

Writes ``benchmarks/results/planner_no_offload.{json,md,png}``.

Run: ``.venv/bin/python benchmarks/planner_no_offload.py`` (about 10 minutes on one core);
``--worlds 8,64 --steps 1`` for a quick look.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from lightning_bytescale.planner import distributions, make_plan
from lightning_bytescale.planner.cost_presets import PRESETS
from lightning_bytescale.sim.bounds import step_lower_bound
from lightning_bytescale.sim.compare import NO_OFFLOAD_PLANNERS, Case, compare, compare_case
from lightning_bytescale.sim.run import draw_batch
from lightning_bytescale.sim.scenario import SCENARIOS

RESULTS = Path(__file__).resolve().parent / "results"
PLANNERS = (*NO_OFFLOAD_PLANNERS, "balance_min_rings")
PEERS = ("megatron_dcp", "lpt")
WORLDS = (8, 64, 256, 1024)
SIM_SCENARIOS = ("paper-70b-github-2m", "paper-8x22b-github-2m")
PLAN_TIME_RANKS = 16384
PLAN_TIME_TOKENS = 32 * 2**20


def _row(label: dict, result: dict) -> dict:
    bal = result["balance_no_offload"]["step_time_s"]
    row = dict(label)
    row["step_time_s"] = {p: r["step_time_s"] for p, r in result.items()}
    row["compute_finish_s"] = {p: r["compute_finish_s"] for p, r in result.items()}
    row["plan_ms"] = {p: r["plan_ms"] for p, r in result.items()}
    row["peer_over_balance"] = {p: result[p]["step_time_s"] / bal for p in PEERS}
    row["balance_ahead_of_both"] = all(result[p]["step_time_s"] >= bal * (1 - 1e-9) for p in PEERS)
    return row


def lower_bound(case: Case) -> dict:
    """The mean over the cell's global batches of the step lower bound, and which part binds."""
    scenario, cm = case.scenario(), case.model()
    bounds = [step_lower_bound(draw_batch(scenario, step), scenario, cm) for step in range(scenario.steps)]
    return {
        "step_s": statistics.fmean(b.step_s for b in bounds),
        "longest_sequence_s": statistics.fmean(b.longest_sequence_s for b in bounds),
        "work_s": statistics.fmean(b.work_s for b in bounds),
        "allreduce_s": statistics.fmean(b.allreduce_s for b in bounds),
    }


def grid(worlds: list[int], steps: int) -> list[dict]:
    rows = []
    for cost in PRESETS:
        for dist in distributions.SYNTHETIC:
            for world in worlds:
                case = Case(dist, world, cost, steps=steps)
                t0 = time.perf_counter()
                res = compare_case(case, PLANNERS)
                row = _row(
                    {
                        "distribution": dist,
                        "world_size": world,
                        "cost_model": cost,
                        "context": case.context_length,
                    },
                    res,
                )
                row["lower_bound"] = lower_bound(case)
                row["balance_over_bound"] = (
                    row["step_time_s"]["balance_no_offload"] / row["lower_bound"]["step_s"]
                )
                rows.append(row)
                ratios = " ".join(f"{p} {row['peer_over_balance'][p]:.3f}" for p in PEERS)
                print(f"{case.name}: {ratios} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def scenarios(steps: int) -> list[dict]:
    rows = []
    for name in SIM_SCENARIOS:
        sc = SCENARIOS[name].with_(steps=steps)
        res = compare(sc, planners=PLANNERS)
        rows.append(
            _row(
                {
                    "scenario": name,
                    "world_size": sc.ranks,
                    "pipeline_degree": sc.pipeline_degree,
                    "cost_model": "scenario",
                },
                res,
            )
        )
        print(
            f"{name}: " + " ".join(f"{p} {rows[-1]['peer_over_balance'][p]:.3f}" for p in PEERS), flush=True
        )
    return rows


def plan_time() -> dict:
    """CPU time (one core, min of 3) of ``balance`` without offload: 32M tokens on 16,384 ranks."""
    out = {}
    for dist in ("github", "byted"):
        for ctx in (256 * 1024, 2**21):
            lengths = distributions.sample_global_batch(dist, PLAN_TIME_TOKENS, ctx, seed=0)
            times = []
            for _ in range(3):
                t0 = time.process_time()
                make_plan(
                    lengths, world_size=PLAN_TIME_RANKS, capacity=8192, planner="balance", offload=False
                )
                times.append(time.process_time() - t0)
            out[f"{dist}-{ctx // 1024}k"] = min(times) * 1e3
            print(f"plan time {dist} {ctx // 1024}K: {out[f'{dist}-{ctx // 1024}k']:.0f} ms", flush=True)
    return out


def table(report: dict) -> str:
    head = (
        "| distribution | ranks | cost model | balance s | megatron_dcp s | lpt s | balance (D(s) rings) s "
        "| dcp / balance | lpt / balance | lower bound s | balance / bound |"
    )
    out = [head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["grid"] + report["scenarios"]:
        st = r["step_time_s"]
        name = r.get("distribution") or r["scenario"]
        out.append(
            f"| {name} | {r['world_size']} | {r['cost_model']} | {st['balance_no_offload']:.2f} | "
            f"{st['megatron_dcp']:.2f} | {st['lpt']:.2f} | {st['balance_min_rings']:.2f} | "
            f"{r['peer_over_balance']['megatron_dcp']:.3f}x | {r['peer_over_balance']['lpt']:.3f}x | "
            + (
                f"{r['lower_bound']['step_s']:.2f} | {r['balance_over_bound']:.4f}x |"
                if "lower_bound" in r
                else "- | - |"
            )
        )
    s = report["summary"]
    out.append("")
    out.append(
        f"`balance` is at least level with both peers in {s['ahead_of_both']} of {s['cases']} cases; "
        f"smallest margin over megatron_dcp {s['min_dcp']:.3f}x, over lpt {s['min_lpt']:.3f}x "
        f"(geometric means {s['geomean_dcp']:.3f}x and {s['geomean_lpt']:.3f}x)."
    )
    out.append(
        f"Where `balance` and `lpt` are within 0.2% of each other ({s['level_with_lpt']}), `balance` is within "
        f"{s['level_over_bound_max']:.4f}x of the lower bound that no plan without offload can beat "
        f"(pipeline scenarios have no bound). Over the whole grid `balance` is within "
        f"{s['bound_max']:.4f}x of the bound (median {s['bound_median']:.4f}x)."
    )
    pt = report["plan_time_ms"]
    out.append(
        f"Planning 32M tokens on {PLAN_TIME_RANKS:,} ranks without offload (CPU, one core, min of 3): "
        + ", ".join(f"{k} {v:.0f} ms" for k, v in pt.items())
        + "."
    )
    return "\n".join(out) + "\n"


def plot(report: dict) -> None:
    try:
        import matplotlib
    except ImportError as err:
        raise SystemExit(
            'the figures need matplotlib: pip install -e ".[bench]" (or pip install matplotlib)'
        ) from err

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["grid"] + report["scenarios"]
    labels = [
        f"{r['distribution']}/{r['world_size']}/{r['cost_model']}" if "distribution" in r else r["scenario"]
        for r in rows
    ]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(10, 0.32 * len(rows)), 5))
    w = 0.4
    ax.bar(
        [x - w / 2 for x in xs],
        [r["peer_over_balance"]["megatron_dcp"] for r in rows],
        w,
        label="megatron_dcp",
    )
    ax.bar([x + w / 2 for x in xs], [r["peer_over_balance"]["lpt"] for r in rows], w, label="lpt")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs), labels, rotation=90, fontsize=7)
    ax.set_ylabel("peer step time / balance step time")
    ax.set_ylim(0.9, None)
    ax.set_title("Without offload: simulated step time of each peer over balance's (above 1: balance ahead)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "planner_no_offload.png", dpi=110)
    plt.close(fig)


def summarise(report: dict) -> dict:
    """Counts and margins over all cells, and how far ``balance`` is from the lower bound."""
    rows = report["grid"] + report["scenarios"]
    dcp = [r["peer_over_balance"]["megatron_dcp"] for r in rows]
    lpt = [r["peer_over_balance"]["lpt"] for r in rows]
    summary = {
        "cases": len(rows),
        "ahead_of_both": sum(r["balance_ahead_of_both"] for r in rows),
        "min_dcp": min(dcp),
        "min_lpt": min(lpt),
        "geomean_dcp": statistics.geometric_mean(dcp),
        "geomean_lpt": statistics.geometric_mean(lpt),
    }
    level = [r for r in report["grid"] if r["peer_over_balance"]["lpt"] < 1.002]
    summary["level_with_lpt"] = (
        ", ".join(f"{r['distribution']}/{r['world_size']}/{r['cost_model']}" for r in level) or "none"
    )
    summary["level_over_bound_max"] = max((r["balance_over_bound"] for r in level), default=float("nan"))
    over = [r["balance_over_bound"] for r in report["grid"]]
    summary["bound_max"] = max(over)
    summary["bound_median"] = statistics.median(over)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default=",".join(str(w) for w in WORLDS), help="world sizes of the grid")
    ap.add_argument("--steps", type=int, default=2, help="global batches per cell")
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    t0 = time.perf_counter()
    report: dict = {
        "setup": {
            "planners": list(PLANNERS),
            "capacity": 8192,
            "micro_batches_per_rank": 8,
            "ranks_per_node": 8,
            "steps": args.steps,
            "cost_models": {name: fn().to_json_dict() for name, fn in PRESETS.items()},
            "machine": f"{platform.machine()}, python {platform.python_version()}",
        },
        "grid": grid(worlds, args.steps),
        "scenarios": scenarios(args.steps),
        "plan_time_ms": plan_time(),
    }
    report["summary"] = summarise(report)
    report["wall_s"] = time.perf_counter() - t0
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "planner_no_offload.json").write_text(json.dumps(report, indent=1))
    (RESULTS / "planner_no_offload.md").write_text(table(report))
    plot(report)
    print(table(report))


if __name__ == "__main__":
    main()
