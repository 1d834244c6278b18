"""Simulator report: the paper's evaluation (bytescale-paper.md §6) re-run on our planners.

Writes under ``benchmarks/results/``:

* ``sim_scenarios/<name>.json``   one ``bytescale-sim --json`` style result per scenario (cached;
  ``--force`` recomputes);
* ``sim_report.json``             everything below in one file;
* ``sim_tables.md``               the markdown tables quoted in docs/benchmarks.md;
* ``sim_speedup_vs_context.png``  speedup over static against context, one panel per model;
* ``sim_case_load_bars.png``      per-rank busy time of one step per planner (case study);
* ``sim_plan_time.png``           planning time against ranks (32M tokens).

Run: ``.venv/bin/python benchmarks/sim_report.py`` (about 10 minutes on 2 busy cores; the
scenario cache makes re-runs fast).  ``--only case,comm,plantime,paper`` picks parts;
``--refresh balance,balance_no_offload`` recomputes those planners in every cached scenario
(after a planner change), ``--force`` recomputes everything.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from lightning_bytescale.sim import costs
from lightning_bytescale.sim.run import draw_batch, make_variant_plan, run_scenario, simulate_plan
from lightning_bytescale.sim.scenario import CONTEXTS, DATASETS, MODELS, SCENARIOS, Scenario

RESULTS = Path(__file__).resolve().parent / "results"
CACHE = RESULTS / "sim_scenarios"
PAPER_PLANNERS = ("static", "naive", "balance", "balance_no_offload", "megatron_dcp", "verl_kk", "lpt")
CASE_PLANNERS = (
    "static",
    "naive",
    "naive_offload_min_ranks",
    "naive_offload",
    "balance_no_offload",
    "balance",
)
COMM_PLANNERS = ("static", "megatron_dcp", "balance_compute_only", "balance")
# naive's two offload readings (paper Fig. 20's "+offload" step), also run on the comm scenarios
ABLATION_PLANNERS = ("static", "naive", "naive_offload_min_ranks", "naive_offload", "balance")
PLAN_TIME_RANKS = (1024, 2048, 4096, 8192, 16384)
PLAN_TIME_PLANNERS = ("naive", "balance", "megatron_dcp")


REFRESH: set[str] = set()  # planners to recompute in every cached scenario (--refresh)


def cached_run(sc: Scenario, planners, force: bool) -> dict:
    """``run_scenario`` with a per-scenario cache; planners missing from the cache are added.

    Batches are drawn from the scenario's seed, so planners run later see the same batches.
    """
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"{sc.name}.json"
    data = None if force or not path.exists() else json.loads(path.read_text())
    if data is not None:
        for p in REFRESH:
            data["planners"].pop(p, None)
    missing = list(planners) if data is None else [p for p in planners if p not in data["planners"]]
    if not missing:
        return data
    t0 = time.perf_counter()
    new = run_scenario(sc, planners=missing)
    wall = time.perf_counter() - t0
    if data is None:
        data, data["wall_s"] = new, wall
    else:
        data["planners"].update(new["planners"])
        data["wall_s"] = data.get("wall_s", 0.0) + wall
        base = data["planners"].get("static")
        for row in data["planners"].values():
            row["speedup_vs_static"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
    path.write_text(json.dumps(data, indent=1))
    print(f"{sc.name}: {wall:.1f} s ({','.join(missing)})", flush=True)
    return data


def paper_part(force: bool) -> dict:
    rows = {}
    for name, sc in SCENARIOS.items():
        if name.startswith("paper-"):
            rows[name] = cached_run(sc, PAPER_PLANNERS, force)
    # throughput drop per context doubling (geometric mean over models and doublings)
    ctxs = list(CONTEXTS)
    drop: dict[str, dict[str, float]] = {}
    for ds in DATASETS:
        drop[ds] = {}
        for p in PAPER_PLANNERS:
            ratios = []
            for m in MODELS:
                for c0, c1 in zip(ctxs, ctxs[1:]):
                    a = rows[f"paper-{m}-{ds}-{c0}"]["planners"][p]["tokens_per_s"]
                    b = rows[f"paper-{m}-{ds}-{c1}"]["planners"][p]["tokens_per_s"]
                    ratios.append(a / b)
            drop[ds][p] = math.exp(statistics.fmean(math.log(r) for r in ratios))
    behind: dict[str, list] = {"balance": [], "balance_no_offload": []}
    for name, r in rows.items():
        for ours, found in behind.items():
            bal = r["planners"][ours]["tokens_per_s"]
            for p in ("static", "megatron_dcp", "verl_kk", "lpt"):
                if r["planners"][p]["tokens_per_s"] > bal:
                    found.append((name, p, r["planners"][p]["tokens_per_s"] / bal))
    return {"scenarios": rows, "drop_per_doubling": drop, "balance_behind": behind}


def case_part(force: bool) -> dict:
    sc = SCENARIOS["case-7b-byted-2m"]
    data = cached_run(sc, CASE_PLANNERS, force)
    # one step in detail: per-rank busy and idle time
    cm = costs.cost_model_for(sc)
    lengths = draw_batch(sc, 0)
    detail = {}
    for p in CASE_PLANNERS:
        plan = make_variant_plan(p, lengths, sc, cm, sc.seed)
        res = simulate_plan(plan, sc, cm)
        idle = [res.compute_finish_s - b for b in res.busy]
        cost = costs.CostFunction(plan, sc, cm)
        shares = [cost(0, mb).exposed_comm / cost(0, mb).duration for mb in plan.ranks[0] if mb.ring]
        detail[p] = {
            "step_time_s": res.step_time_s,
            "busy_min_s": min(res.busy),
            "busy_max_s": max(res.busy),
            "busy_std_s": statistics.pstdev(res.busy),
            "idle_max_s": max(idle),
            "idle_mean_s": statistics.fmean(idle),
            "micro_batches_min": min(res.micro_batches),
            "micro_batches_max": max(res.micro_batches),
            "exposed_comm_share": res.exposed_comm_s / max(sum(res.busy), 1e-30),
            "rank0_max_item_comm_share": max(shares, default=0.0),
            "busy": res.busy,
        }
    return {"summary": data, "detail": detail}


def comm_part(force: bool) -> dict:
    out = {}
    for ds in DATASETS:
        for cap in (4, 8):
            sc = SCENARIOS[f"comm-7b-{ds}-{cap}k"]
            out[sc.name] = cached_run(sc, COMM_PLANNERS + ABLATION_PLANNERS[1:4], force)
    return out


def plan_time_part() -> dict:
    """Planning time of 32M tokens (byted, 2M context) against ranks, one core, median of 3."""
    base = SCENARIOS["paper-7b-byted-2m"]
    out: dict[str, dict[int, float]] = {p: {} for p in PLAN_TIME_PLANNERS}
    lengths = draw_batch(base, 0)
    for ranks in PLAN_TIME_RANKS:
        sc = base.with_(gpus=ranks * base.tensor_parallel)
        cm = costs.cost_model_for(sc)
        for p in PLAN_TIME_PLANNERS:
            times = []
            for rep in range(3):
                plan = make_variant_plan(p, lengths, sc, cm, rep)
                times.append(plan.options["_plan_ms"])
            out[p][ranks] = statistics.median(times)
            print(f"plan time {p} {ranks}: {out[p][ranks]:.1f} ms", flush=True)
    return {"sequences": len(lengths), "tokens": sum(lengths), "plan_ms": out}


# ---------------------------------------------------------------------------- plots and tables


def plots(report: dict) -> None:
    try:
        import matplotlib
    except ImportError as err:
        raise SystemExit(
            'the figures need matplotlib: pip install -e ".[bench]" (or pip install matplotlib)'
        ) from err

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "paper" in report:
        rows = report["paper"]["scenarios"]
        fig, axes = plt.subplots(2, 3, figsize=(13, 7), sharex=True)
        xs = [CONTEXTS[c] // 1024 for c in CONTEXTS]
        for ax, m in zip(axes.flat, MODELS):
            for p, color in zip(
                ("naive", "balance", "balance_no_offload", "megatron_dcp", "verl_kk"),
                ("C0", "C1", "C4", "C2", "C3"),
            ):
                for ds, style in (("github", "-"), ("byted", "--")):
                    ys = [rows[f"paper-{m}-{ds}-{c}"]["planners"][p]["speedup_vs_static"] for c in CONTEXTS]
                    ax.plot(xs, ys, style, color=color, marker="o", label=f"{p} ({ds})")
            ax.set_xscale("log", base=2)
            ax.set_title(MODELS[m].name)
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xticks(xs, [f"{x}K" for x in xs])
        axes[0, 0].set_ylabel("speedup over static")
        axes[1, 0].set_ylabel("speedup over static")
        axes[0, 0].legend(fontsize=6)
        fig.suptitle("Simulated speedup over the static DP x CP mesh (32M tokens/step, C=8K)")
        fig.tight_layout()
        fig.savefig(RESULTS / "sim_speedup_vs_context.png", dpi=110)
        plt.close(fig)
    if "case" in report:
        det = report["case"]["detail"]
        fig, axes = plt.subplots(len(det), 1, figsize=(11, 2.0 * len(det)), sharex=True, sharey=True)
        for ax, (p, d) in zip(axes, det.items()):
            ax.bar(range(len(d["busy"])), d["busy"], width=1.0, color="C0")
            ax.axhline(d["step_time_s"], color="C3", lw=1, label="step time")
            ax.set_ylabel("busy s")
            ax.set_title(f"{p}: step {d['step_time_s']:.0f} s, idle max {d['idle_max_s']:.0f} s", fontsize=9)
        axes[-1].set_xlabel("rank")
        fig.suptitle("Case study (LLaMA-7B, 2M, byted, 1,024 GPUs): per-rank busy time of one step")
        fig.tight_layout()
        fig.savefig(RESULTS / "sim_case_load_bars.png", dpi=100)
        plt.close(fig)
    if "plantime" in report:
        pt = report["plantime"]["plan_ms"]
        fig, ax = plt.subplots(figsize=(6, 4))
        for p, series in pt.items():
            ks = sorted(int(k) for k in series)
            ax.plot(ks, [series[k] if k in series else series[str(k)] for k in ks], marker="o", label=p)
        ax.axhline(100, color="gray", ls="--", lw=0.8, label="100 ms goal")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_ylabel("plan time (ms)")
        ax.set_title("Planning 32M tokens (byted, 2M context), one core")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / "sim_plan_time.png", dpi=110)
        plt.close(fig)


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def tables(report: dict) -> str:
    out = []
    if "paper" in report:
        rows = report["paper"]["scenarios"]
        for ds in DATASETS:
            out.append(f"\n#### Speedup over static, {ds}\n")
            out.append("| model | planner | " + " | ".join(c.upper() for c in CONTEXTS) + " |")
            out.append("|---|---|" + "---|" * len(CONTEXTS))
            for m in MODELS:
                for p in ("naive", "balance", "balance_no_offload", "megatron_dcp", "verl_kk", "lpt"):
                    cells = [
                        _f(rows[f"paper-{m}-{ds}-{c}"]["planners"][p]["speedup_vs_static"]) for c in CONTEXTS
                    ]
                    out.append(f"| {MODELS[m].name} | {p} | " + " | ".join(cells) + " |")
        out.append("\n#### Throughput drop per context doubling (geometric mean over models, 256K->2M)\n")
        out.append("| dataset | " + " | ".join(PAPER_PLANNERS) + " |")
        out.append("|---|" + "---|" * len(PAPER_PLANNERS))
        for ds, d in report["paper"]["drop_per_doubling"].items():
            out.append(f"| {ds} | " + " | ".join(f"{d[p]:.2f}x" for p in PAPER_PLANNERS) + " |")
        out.append("| paper | ~2x | 1.23x | 1.08x | - | - | - | - |")
        for ours, beh in report["paper"]["balance_behind"].items():
            out.append(f"\nScenarios where a baseline beats `{ours}`: {len(beh)}")
            for name, p, ratio in beh:
                out.append(f"- {name}: {p} is {ratio:.3f}x {ours}'s throughput")
        out.append("\n#### Step time (s), all planners\n")
        out.append("| scenario | ranks | " + " | ".join(PAPER_PLANNERS) + " | balance plan ms |")
        out.append("|---|---|" + "---|" * len(PAPER_PLANNERS) + "---|")
        for name, r in rows.items():
            sc = SCENARIOS[name]
            cells = [_f(r["planners"][p]["step_time_s"], ".1f") for p in PAPER_PLANNERS]
            out.append(
                f"| {name} | {sc.ranks} | "
                + " | ".join(cells)
                + f" | {r['planners']['balance']['plan_ms']:.0f} |"
            )
    if "case" in report:
        det = report["case"]["detail"]
        out.append("\n#### Case study and ablation (LLaMA-7B, 2M, byted, 1,024 GPUs = 512 HDP ranks)\n")
        out.append(
            "| planner | step s | speedup | busy min / max / std s | longest idle s | micro-batches min-max | exposed comm share (all / rank 0's worst ring micro-batch) |"
        )
        out.append("|---|---|---|---|---|---|---|")
        base = det["static"]["step_time_s"]
        for p, d in det.items():
            out.append(
                f"| {p} | {d['step_time_s']:.1f} | {base / d['step_time_s']:.2f}x | "
                f"{d['busy_min_s']:.1f} / {d['busy_max_s']:.1f} / {d['busy_std_s']:.1f} | {d['idle_max_s']:.1f} | "
                f"{d['micro_batches_min']}-{d['micro_batches_max']} | {d['exposed_comm_share']:.1%} / {d.get('rank0_max_item_comm_share', 0):.1%} |"
            )
        out.append(
            "| paper (static / naive / +offload / balance) | 520 / 272 / - / 157 | 1.00 / 1.59 / 2.01 / 3.69x | naive 60 / 279 / 68 | naive 171 | static 8 each | static 97.6% |"
        )
    if "case" in report and "comm" in report:
        out.append("\n#### naive + offload, both readings (speedup over static)\n")
        out.append("| scenario | " + " | ".join(ABLATION_PLANNERS) + " |")
        out.append("|---|" + "---|" * len(ABLATION_PLANNERS))
        runs = {"case-7b-byted-2m": report["case"]["summary"], **report["comm"]}
        for name, r in runs.items():
            pl = r["planners"]
            cells = [_f(pl[p]["speedup_vs_static"]) + "x" if p in pl else "-" for p in ABLATION_PLANNERS]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    if "comm" in report:
        out.append(
            "\n#### Communication-aware vs compute-only balance (LLaMA-7B, 256 ranks, 4M tokens, 256K context)\n"
        )
        out.append(
            "| scenario | "
            + " | ".join(f"{p} step s" for p in COMM_PLANNERS)
            + " | comm-aware / compute-only |"
        )
        out.append("|---|" + "---|" * (len(COMM_PLANNERS) + 1))
        for name, r in report["comm"].items():
            pl = r["planners"]
            cells = [_f(pl[p]["step_time_s"], ".2f") for p in COMM_PLANNERS]
            ratio = pl["balance_compute_only"]["step_time_s"] / pl["balance"]["step_time_s"]
            out.append(f"| {name} | " + " | ".join(cells) + f" | {ratio:.3f}x |")
    if "plantime" in report:
        pt = report["plantime"]
        out.append(
            f"\n#### Plan time, {pt['tokens'] / 2**20:.0f}M tokens ({pt['sequences']} sequences, byted, 2M context), ms\n"
        )
        out.append("| planner | " + " | ".join(str(r) for r in PLAN_TIME_RANKS) + " |")
        out.append("|---|" + "---|" * len(PLAN_TIME_RANKS))
        for p, series in pt["plan_ms"].items():
            out.append(f"| {p} | " + " | ".join(f"{series[r]:.0f}" for r in PLAN_TIME_RANKS) + " |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="case,comm,plantime,paper")
    ap.add_argument("--force", action="store_true", help="recompute cached scenario results")
    ap.add_argument("--refresh", default="", help="comma-separated planners to recompute in cached scenarios")
    args = ap.parse_args()
    REFRESH.update(p for p in args.refresh.split(",") if p)
    parts = set(args.only.split(","))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "sim_report.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    if "plantime" in report:  # JSON turned the rank keys into strings
        report["plantime"]["plan_ms"] = {
            p: {int(k): v for k, v in s.items()} for p, s in report["plantime"]["plan_ms"].items()
        }
    if "case" in parts:
        report["case"] = case_part(args.force)
    if "comm" in parts:
        report["comm"] = comm_part(args.force)
    if "plantime" in parts:
        report["plantime"] = plan_time_part()
    if "paper" in parts:
        report["paper"] = paper_part(args.force)
    path.write_text(json.dumps(report, indent=1))
    (RESULTS / "sim_tables.md").write_text(tables(report))
    plots(report)
    print(tables(report))


if __name__ == "__main__":
    main()
