"""Attention modes (issue 39): what choosing ring, Ulysses or Ulysses x ring per sequence buys.

By simulation on the paper's network (150 GB/s a GPU inside a node of 8, 25 GB/s between
nodes), three parts:

* ``where``: one sequence of ``s`` tokens on a group of ``n`` ranks: one member's step time
  as a ring, as Ulysses and as the hybrid (Ulysses inside each node x ring across nodes), under
  the paper preset (the paper's per-layer table, LLaMA-7B's 32 query and 8 K/V heads); groups
  of up to 8 sit in one node, larger ones on whole nodes.  Where Ulysses wins and loses.
* ``histograms``: global batches drawn from the public length histograms (``pile`` and
  ``prolong512k`` from LongCA-bench, ``magi_long`` from MagiAttention;
  ``lightning_bytescale/planner/public_lengths.py`` has the sources), 64 and 256 ranks, C = 8K,
  8 micro-batches' worth of tokens a rank, context ``min(2M, ranks x C / 2)``, two batches a
  cell, the same paper preset: ``balance`` ring-only against ``balance`` choosing each item's
  mode, without and with offload.
* ``scenarios``: every simulator scenario (the 48 ``paper-*`` settings of Table 1's models, the
  case study, the comm scenarios, tiny), one batch each, with the scenario's own cost model
  (FLOP-based, one lane's heads): ``balance`` against ``balance_modes``.

Step time is the simulator's (slowest rank, ring waits, exposed communication of every mode,
the gradient all-reduce); the simulator charges the planner's own cost model.  Writes
``benchmarks/results/ulysses_modes.{json,md,png}``.

Run: ``.venv/bin/python benchmarks/ulysses_modes.py`` (about 15 minutes of one core, most of
it the 48 paper scenarios at 32M tokens); ``--only where,histograms`` for the quick parts.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

from lightning_bytescale.planner import CostModel
from lightning_bytescale.planner.modes import GroupLayout, allowed_modes, mode_time
from lightning_bytescale.sim import costs
from lightning_bytescale.sim.compare import Case
from lightning_bytescale.sim.run import draw_batch, make_variant_plan, simulate_plan
from lightning_bytescale.sim.scenario import SCENARIOS

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("ring", "ulysses", "hybrid")
CAPACITY = 8192
LENGTHS_K = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
GROUPS = (2, 4, 8, 16, 32, 64, 128, 256)
HISTOGRAMS = ("pile", "prolong512k", "magi_long")
WORLDS = (64, 256)
PAIRS = (("balance_no_offload", "balance_no_offload_modes"), ("balance", "balance_modes"))


def paper_model() -> CostModel:
    """The paper preset with LLaMA-7B's heads (32 query, 8 K/V): K/V 4,096 B a token and layer."""
    return CostModel.paper_preset().with_(attention_heads=32, kv_heads=8)


def where(cm: CostModel) -> list[dict]:
    rows = []
    rpn = cm.ranks_per_node
    for k in LENGTHS_K:
        s = k * 1024
        for n in GROUPS:
            layout = GroupLayout(n, True) if n <= rpn else GroupLayout(n, False, rpn)
            row = {
                "length": s,
                "group": n,
                "fits": s <= n * CAPACITY,
                "layout": "one node" if n <= rpn else "nodes",
            }
            for mode in MODES:
                if mode in allowed_modes(cm, layout):
                    t, exposed = mode_time(cm, mode, [s], layout)
                    row[mode] = {"time_s": t, "exposed_s": exposed}
            best = min((m for m in MODES if m in row), key=lambda m: row[m]["time_s"])
            row["best"] = best
            row["ring_over_best"] = row["ring"]["time_s"] / row[best]["time_s"]
            rows.append(row)
    return rows


def _run_pair(scenario, cm, ring: str, modes: str, steps: int, label: str, **fields) -> dict:
    """Plan and simulate ``steps`` batches with the ring-only and the modes variant; print one line."""
    t0 = time.perf_counter()
    out: dict = {**fields, "ring": ring, "modes": modes, "steps": []}
    for step in range(steps):
        lengths = draw_batch(scenario, step)
        row = {"sequences": len(lengths), "longest": max(lengths)}
        for tag, variant in (("ring", ring), ("modes", modes)):
            t_plan = time.process_time()
            plan = make_variant_plan(variant, lengths, scenario, cm, scenario.seed + step)
            plan_s = time.process_time() - t_plan
            res = simulate_plan(plan, scenario, cm)
            row[tag] = {
                "step_time_s": res.step_time_s,
                "exposed_comm_s_per_rank": {
                    m: v / scenario.ranks for m, v in res.exposed_comm_by_mode.items()
                },
                "mode_counts": res.mode_counts,
                "ring_bytes": res.ring_bytes,
                "plan_s": plan_s,
            }
        out["steps"].append(row)
    out["step_time_s"] = {
        tag: statistics.fmean(r[tag]["step_time_s"] for r in out["steps"]) for tag in ("ring", "modes")
    }
    out["speedup"] = out["step_time_s"]["ring"] / out["step_time_s"]["modes"]
    out["never_slower"] = all(
        r["modes"]["step_time_s"] <= r["ring"]["step_time_s"] * (1 + 1e-12) for r in out["steps"]
    )
    out["wall_s"] = time.perf_counter() - t0
    times = out["step_time_s"]
    print(f"{label:40s} {times['ring']:8.2f}s -> {times['modes']:8.2f}s ({out['speedup']:.3f}x)", flush=True)
    return out


def histograms(cm: CostModel, steps: int) -> list[dict]:
    rows = []
    for dist in HISTOGRAMS:
        for world in WORLDS:
            case = Case(dist, world, "paper", steps=steps)
            sc, model = case.scenario(), cm.with_(ranks_per_node=case.ranks_per_node)
            for ring, modes in PAIRS:
                fields = {"distribution": dist, "world_size": world, "context": case.context_length}
                rows.append(_run_pair(sc, model, ring, modes, steps, f"{dist} {world} {ring}", **fields))
    return rows


def scenarios(names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        sc = SCENARIOS[name]
        cm = costs.cost_model_for(sc)
        fields = {"scenario": name, "ranks": sc.ranks, "heads": [cm.attention_heads, cm.kv_heads]}
        rows.append(_run_pair(sc, cm, "balance", "balance_modes", 1, name, **fields))
    return rows


def _geomean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")


def _mean(steps: list[dict], tag: str, key: str) -> dict[str, float]:
    """Per mode, the mean over the steps of ``steps[i][tag][key]`` (a mode missing counts 0)."""
    return {m: statistics.fmean(st[tag][key].get(m, 0) for st in steps) for m in MODES}


def _modes_cell(steps: list[dict]) -> str:
    counts = _mean(steps, "modes", "mode_counts")
    return " / ".join(f"{counts[m]:.3g}" for m in MODES)


def _exposed_cell(steps: list[dict], tag: str) -> str:
    per_mode = _mean(steps, tag, "exposed_comm_s_per_rank")
    return ", ".join(f"{m} {v:.2f}" for m, v in per_mode.items() if v >= 0.005) or "0"


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(head) + " |",
        "|---" * len(head) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def _where_cell(r: dict) -> str:
    if not r["fits"]:
        return "-"
    tag = {"ring": "R", "ulysses": "U", "hybrid": "H"}[r["best"]]
    return "R" if tag == "R" else f"{tag} {r['ring_over_best']:.2f}x"


def _ulysses_cell(r: dict) -> str:
    return f"{r['ring']['time_s'] / r['ulysses']['time_s']:.2f}" if r["fits"] and "ulysses" in r else "-"


def markdown(data: dict) -> str:
    out = []
    if "where" in data:
        by = {(r["length"], r["group"]): r for r in data["where"]}
        head = ["s \\ n", *(str(n) for n in GROUPS)]
        for title, cell in (
            (
                "Ring time over the best mode's (U: Ulysses, H: Ulysses in nodes x ring across nodes, R: the ring); "
                "groups up to 8 in one node, larger ones on whole nodes of 8; `-`: the sequence does not fit "
                "the group at C = 8K.",
                _where_cell,
            ),
            (
                "Ulysses alone against the ring (ring time / Ulysses time; below 1 Ulysses loses; n must divide "
                "the 32 heads):",
                _ulysses_cell,
            ),
        ):
            rows = [[f"{k}K", *(cell(by[(k * 1024, n)]) for n in GROUPS)] for k in LENGTHS_K]
            out += ["", title, "", *_md_table(head, rows)]
        out[0:0] = [
            "#### Where each mode wins: one sequence on a group (paper preset, 32 query / 8 K/V heads)"
        ]
    if "histograms" in data:
        out += ["", "#### Public length histograms (paper preset, C = 8K, 8 micro-batches a rank)", ""]
        head = ["distribution", "ranks", "context", "offload", "ring-only s", "with modes s", "speedup"]
        head += [
            "items ring / ulysses / hybrid",
            "exposed s a rank, ring-only",
            "exposed s a rank, with modes",
        ]
        rows = [
            [
                r["distribution"],
                str(r["world_size"]),
                f"{r['context'] // 1024}K",
                "on" if r["ring"] == "balance" else "off",
                f"{r['step_time_s']['ring']:.2f}",
                f"{r['step_time_s']['modes']:.2f}",
                f"{r['speedup']:.3f}x",
                _modes_cell(r["steps"]),
                _exposed_cell(r["steps"], "ring"),
                _exposed_cell(r["steps"], "modes"),
            ]
            for r in data["histograms"]
        ]
        out += _md_table(head, rows)
    if "scenarios" in data:
        out += ["", "#### Simulator scenarios (their own cost model; `balance` against `balance_modes`)", ""]
        head = [
            "scenario",
            "ranks",
            "ring-only s",
            "with modes s",
            "speedup",
            "items ring / ulysses / hybrid",
        ]
        rows = [
            [
                r["scenario"],
                str(r["ranks"]),
                f"{r['step_time_s']['ring']:.2f}",
                f"{r['step_time_s']['modes']:.2f}",
                f"{r['speedup']:.3f}x",
                _modes_cell(r["steps"]),
            ]
            for r in data["scenarios"]
        ]
        out += _md_table(head, rows)
    out += [
        "",
        "Items are ring items per mode, the mean over the cell's global batches; exposed is the communication",
        "nothing hides, in seconds a rank (the sum over ranks divided by the ranks), per mode.",
        "",
        *(f"* {line}" for line in data["summary"]),
    ]
    return "\n".join(out) + "\n"


def summary(data: dict) -> list[str]:
    lines = []
    if "where" in data:
        wins = [r for r in data["where"] if r["fits"] and r["best"] != "ring"]
        lines.append(
            f"where: another mode beats the ring in {len(wins)} of {sum(r['fits'] for r in data['where'])} "
            f"(length, group) cells that fit; largest gain {max((r['ring_over_best'] for r in wins), default=1):.2f}x"
        )
    for part in ("histograms", "scenarios"):
        rows = data.get(part)
        if not rows:
            continue
        sp = [r["speedup"] for r in rows]
        lines.append(
            f"{part}: with modes never slower in {sum(r['never_slower'] for r in rows)} of {len(rows)} cells; "
            f"speedup geometric mean {_geomean(sp):.3f}x, min {min(sp):.3f}x, max {max(sp):.3f}x"
        )
    return lines


def figure(data: dict, path: Path) -> None:
    import matplotlib  # optional (the bench extra): only the figure needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in ("where", "histograms") if p in data]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.6), squeeze=False)
    for ax, part in zip(axes[0], panels):
        if part == "where":
            by = {(r["length"], r["group"]): r for r in data["where"]}
            grid = [
                [
                    by[(k * 1024, n)]["ring_over_best"] if by[(k * 1024, n)]["fits"] else float("nan")
                    for n in GROUPS
                ]
                for k in LENGTHS_K
            ]
            im = ax.imshow(grid, cmap="viridis", origin="lower", aspect="auto")
            ax.set_xticks(range(len(GROUPS)), [str(n) for n in GROUPS])
            ax.set_yticks(range(len(LENGTHS_K)), [f"{k}K" for k in LENGTHS_K])
            for i, k in enumerate(LENGTHS_K):
                for j, n in enumerate(GROUPS):
                    r = by[(k * 1024, n)]
                    if r["fits"]:
                        ax.text(
                            j,
                            i,
                            {"ring": "R", "ulysses": "U", "hybrid": "H"}[r["best"]],
                            ha="center",
                            va="center",
                            color="w",
                            fontsize=8,
                        )
            ax.set_xlabel("group size n (one node up to 8)")
            ax.set_ylabel("sequence length s")
            ax.set_title("ring time / best mode's time")
            fig.colorbar(im, ax=ax)
        else:
            rows = data["histograms"]
            cells = sorted(
                {(r["distribution"], r["world_size"]) for r in rows},
                key=lambda c: (HISTOGRAMS.index(c[0]), c[1]),
            )
            for k, (pair, color, label) in enumerate(
                ((PAIRS[0], "C1", "without offload"), (PAIRS[1], "C0", "with offload"))
            ):
                by = {
                    (r["distribution"], r["world_size"]): r["speedup"] for r in rows if r["ring"] == pair[0]
                }
                xs = [i + (k - 0.5) * 0.4 for i in range(len(cells))]
                ax.bar(xs, [by.get(c, float("nan")) for c in cells], width=0.4, color=color, label=label)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xticks(range(len(cells)), [f"{d}\n{w} ranks" for d, w in cells], fontsize=8)
            ax.set_ylabel("step time: ring-only / with modes")
            ax.set_title("public length histograms, paper network")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--only", default="where,histograms,scenarios", help="comma-separated parts ('' rewrites the tables)"
    )
    ap.add_argument("--steps", type=int, default=2, help="global batches a histogram cell")
    ap.add_argument("--scenarios", default="", help="comma-separated scenario names (default: all)")
    args = ap.parse_args()
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    path = RESULTS / "ulysses_modes.json"
    data: dict = json.loads(path.read_text()) if path.exists() else {}
    data.pop("summary", None)
    cm = paper_model()
    wall = data.get("setup", {}).get("wall_s", {})
    for part in ("where", "histograms", "scenarios"):
        if part not in parts:
            continue
        t0 = time.perf_counter()
        if part == "where":
            data["where"] = where(cm)
        elif part == "histograms":
            data["histograms"] = histograms(cm, args.steps)
        else:
            names = [n.strip() for n in args.scenarios.split(",") if n.strip()] or list(SCENARIOS)
            data["scenarios"] = scenarios(names)
        wall[part] = time.perf_counter() - t0
    data["summary"] = summary(data)
    data["setup"] = {
        "cost_model_where_and_histograms": cm.to_json_dict(),
        "capacity": CAPACITY,
        "machine": platform.platform(),
        "wall_s": wall,
    }
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    (RESULTS / "ulysses_modes.md").write_text(markdown(data))
    figure(data, RESULTS / "ulysses_modes.png")
    print("\n".join(data["summary"]))


if __name__ == "__main__":
    main()
