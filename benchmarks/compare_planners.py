"""The ``compare_planners`` recipe, measured: each planner's tokens/s over interleaved rounds, per loader set-up.

``bytescale-train experiment=compare_planners`` trains ``static``, ``naive`` and ``balance`` one after
another and ends with a table of tokens/s and of what explains them.  Its first version measured
loader restarts more than planners: its one loader worker was not persistent and an epoch lasted
about 8 steps, so a 30-step job restarted the worker (a fresh process importing torch) about four
times.  This script runs the recipe's jobs as a user does (``bytescale-train ... hydra.mode=RUN
strategy.planner=<p>``, one process each, its ``summary.json`` read back) under four loader set-ups:

* ``recipe``: the recipe as shipped, a persistent worker and 40,000 documents (an epoch of about 80
  steps, longer than the job);
* ``persistent``: a persistent worker, epochs of about 8 steps (4,000 documents);
* ``long_epochs``: a worker that restarts every epoch, 40,000 documents;
* ``restarting``: the first version (restarting worker, 4,000 documents).

Three more set-ups, asked for by name, measure the cost model with no profile file:
``auto`` (``strategy.cost_model=auto``: measured at set-up) against the recipe's default model,
and ``github`` / ``github_auto``, the same on a second long-tailed data set.  ``balance_over`` in the
file is balance's median tokens/s over static's and naive's, per set-up.

Every round runs every (set-up, planner) job once, odd rounds in reverse order, so that drifts of
the machine's load spread over all of them; the figures are the medians over rounds, and each
job's spread is ``(max - min) / median`` of its tokens/s.  The file records the 1-, 5- and 15-minute
load averages (``/proc/loadavg``) before every job and ``uptime`` at the start and the end; a run
that starts while something else runs (1-minute load average above :data:`IDLE_LOAD`), or is given
``--preliminary``, is marked ``preliminary``: not to be quoted.  ``--table`` prints the recipe
set-up's medians as the recipe's own closing table (docs/recipes.md quotes it).

    python benchmarks/compare_planners.py --rounds 5                 # the committed run (idle machine)
    python benchmarks/compare_planners.py --rounds 3 --setups recipe,auto,github,github_auto \
        --out benchmarks/results/compare_planners_cost.json        # no profile file (cost_model=auto)
    python benchmarks/compare_planners.py --rounds 1 --steps 2 --setups recipe --planners static,balance \
        --out /tmp/check.json                                       # a check that it works (minutes)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PLANNERS = ("static", "naive", "balance")
SETUPS: dict[str, list[str]] = {
    "recipe": [],
    "persistent": ["data.source.num_samples=4000"],
    "long_epochs": ["data.persistent_workers=false"],
    "restarting": ["data.persistent_workers=false", "data.source.num_samples=4000"],
    # the cost model with no profile file (measured at set-up), and a second long-tailed data set
    "auto": ["strategy.cost_model=auto"],
    "github": ["data.source.name=github"],
    "github_auto": ["data.source.name=github", "strategy.cost_model=auto"],
}
#: The loader set-ups, run by default; the cost-model ones are asked for by name (``--setups``).
LOADER_SETUPS = ("recipe", "persistent", "long_epochs", "restarting")
FIGURES = (
    "run/tokens_per_s",
    "run/micro_batches_per_rank",
    "run/ring_token_share",
    "run/busy_max_over_mean",
    "run/steps",
    "run/train_s",
    "loss",
)
#: The 1-minute load average above which the machine is not idle at the start (the run is preliminary).
IDLE_LOAD = 1.0
LAUNCHER_VARS = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def train_command() -> list[str]:
    """The installed ``bytescale-train`` next to this Python, else its module."""
    exe = Path(sys.executable).with_name("bytescale-train")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "lightning_bytescale.cli.train"]


def load_averages() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def uptime() -> str:
    found = shutil.which("uptime")
    if found is None:
        return " ".join(map(str, load_averages()))
    return subprocess.run([found], capture_output=True, text=True, check=False).stdout.strip()


def schedule(rounds: int, setups: list[str], planners: list[str]) -> list[list[tuple[str, str]]]:
    """Every round's jobs: each (set-up, planner) once, odd rounds in reverse order."""
    jobs = [(s, p) for s in setups for p in planners]
    return [jobs if r % 2 == 0 else jobs[::-1] for r in range(rounds)]


def run_job(setup: str, planner: str, steps: int, folder: Path, timeout_s: float) -> dict[str, Any]:
    """One ``bytescale-train`` job of the recipe; its ``summary.json`` figures and the load before it."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and k != "WANDB_API_KEY"}
    env.setdefault("OMP_NUM_THREADS", "1")
    args = [
        "experiment=compare_planners", "hydra.mode=RUN", f"strategy.planner={planner}", "~logger",
        f"trainer.max_steps={steps}", "trainer.max_time=null", "trainer.enable_progress_bar=false",
        f"hydra.run.dir={folder}", *SETUPS[setup],
    ]  # fmt: skip
    load = load_averages()
    started = time.perf_counter()
    proc = subprocess.run(
        [*train_command(), *args], capture_output=True, text=True, env=env, timeout=timeout_s, check=False
    )
    wall = time.perf_counter() - started
    summary_file = folder / "summary.json"
    if proc.returncode != 0 or not summary_file.exists():
        raise RuntimeError(
            f"{setup}/{planner} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    summary = json.loads(summary_file.read_text())
    return {"load_avg": load, "wall_s": wall, **{k: summary.get(k) for k in FIGURES}}


def _spread(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle else None


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians over rounds of one (set-up, planner) job, every round's tokens/s and its spread."""
    rates = [r["run/tokens_per_s"] for r in runs]
    out: dict[str, Any] = {
        "rounds": len(runs),
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_all_rounds": rates,
        "spread": _spread(rates),
        "load_avg": [r["load_avg"] for r in runs],
    }
    for key in FIGURES[1:]:
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
        out[key.split("/")[-1]] = statistics.median(values) if values else None
    return out


def recipe_table(results: dict[str, dict[str, Any]], setup: str = "recipe") -> str:
    """The recipe's own closing table (``format_table``) from one set-up's medians."""
    from lightning_bytescale.recipes.sweep_table import format_table

    jobs = []
    for planner, row in results.get(setup, {}).items():
        jobs.append(
            {
                "overrides": f"strategy.planner={planner}",
                "run/steps": row["steps"],
                "run/tokens_per_s": row["tokens_per_s"],
                "run/micro_batches_per_rank": row["micro_batches_per_rank"],
                "run/ring_token_share": row["ring_token_share"],
                "run/busy_max_over_mean": row["busy_max_over_mean"],
                "loss": row["loss"],
            }
        )
    return format_table(jobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved repetitions; the medians count")
    parser.add_argument("--steps", type=int, default=30, help="steps per job (the recipe's 30)")
    parser.add_argument("--setups", default=",".join(LOADER_SETUPS), help=f"set-ups, of {', '.join(SETUPS)}")
    parser.add_argument("--planners", default=",".join(PLANNERS))
    parser.add_argument("--timeout", type=float, default=900, help="seconds a job may take")
    parser.add_argument(
        "--preliminary", action="store_true", help="mark the file as measured on a loaded machine"
    )
    parser.add_argument(
        "--table", action="store_true", help="print the recipe set-up's table of --out and exit"
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "compare_planners.json"))
    args = parser.parse_args()
    if args.table:
        print(recipe_table(json.loads(Path(args.out).read_text())["results"]))
        return
    setups = [s for s in args.setups.split(",") if s]
    planners = [p for p in args.planners.split(",") if p]
    unknown = sorted(set(setups) - set(SETUPS))
    if unknown:
        parser.error(f"unknown set-ups {unknown}; choose from {', '.join(SETUPS)}")
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    first_uptime, started = uptime(), datetime.datetime.now(datetime.timezone.utc)
    preliminary = args.preliminary or load_averages()[0] > IDLE_LOAD
    with tempfile.TemporaryDirectory(prefix="compare_planners_") as tmp:
        for r, jobs in enumerate(schedule(args.rounds, setups, planners)):
            for setup, planner in jobs:
                row = run_job(setup, planner, args.steps, Path(tmp, f"{r}_{setup}_{planner}"), args.timeout)
                runs.setdefault((setup, planner), []).append(row)
                print(f"round {r} {setup:<12} {planner:<8} {row['run/tokens_per_s']:9,.0f} tokens/s "
                      f"(load {row['load_avg'][0]:.1f})", flush=True)  # fmt: skip
    results: dict[str, dict[str, Any]] = {}
    for (setup, planner), rows in runs.items():
        results.setdefault(setup, {})[planner] = summarise(rows)
    report = {
        "benchmark": "compare_planners",
        "preliminary": preliminary,
        "note": (
            "PRELIMINARY: measured on a machine running other jobs, or marked so (see uptime and load_avg); "
            "re-run on an idle machine before quoting these figures"
            if preliminary
            else f"the machine was idle at the start (1-minute load average at most {IDLE_LOAD})"
        ),
        "started_utc": started.isoformat(timespec="seconds"),
        "uptime_start": first_uptime,
        "uptime_end": uptime(),
        "cpu_count": os.cpu_count(),
        "rounds": args.rounds,
        "steps": args.steps,
        "setups": {s: SETUPS[s] for s in setups},
        "results": results,
        "balance_over": {
            setup: {
                other: rows["balance"]["tokens_per_s"] / rows[other]["tokens_per_s"]
                for other in ("static", "naive")
                if other in rows
            }
            for setup, rows in results.items()
            if "balance" in rows
        },
        "recipe_table": recipe_table(results) if "recipe" in results else None,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(report["recipe_table"] or "", flush=True)
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
