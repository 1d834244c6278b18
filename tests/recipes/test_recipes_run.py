"""End-to-end runs of the pretrain recipe as users start it: ``bytescale-train`` in a subprocess,
2 CPU processes (gloo on loopback), a few steps.  W&B runs offline in that subprocess (never in
the pytest process) and the test reads its run file back."""

from __future__ import annotations

import csv
import json
import re

import pytest
from _recipe_helpers import run_train

from lightning_bytescale.lightning.telemetry import PLAN_COLUMNS
from lightning_bytescale.lightning.wandb_offline import find_run_files, read_run

pytestmark = pytest.mark.multiprocess

# What the dashboards promise every step (docs/recipes.md), for a 2-rank run.
STEP_KEYS = [
    "train/loss",
    "perf/tokens_per_s",
    "perf/step_time_s",
    "perf/mfu",
    "ranks/busy_s/0",
    "ranks/busy_s/1",
    "ranks/planned_s/0",
    "ranks/planned_s/1",
    "ranks/micro_batches/0",
    "ranks/micro_batches/1",
    "balance/max_over_mean_planned",
    "balance/max_over_mean_measured",
    "balance/bubble_fraction",
    "comm/ring_bytes",
    "plan/plan_ms",
]
CHART_KEYS = ["charts/seq_len_hist", "charts/cp_degree_hist", "charts/rank_busy_s_table", "charts/plan"]


def test_recipe_with_overrides_on_two_processes_writes_an_offline_wandb_run(tmp_path):
    out = tmp_path / "run"
    proc = run_train(
        [
            "experiment=cpu_smoke",
            "strategy.planner=static",
            "strategy.cp_size=2",
            "trainer.devices=2",
            "telemetry.charts_every_n_steps=2",
            f"hydra.run.dir={out}",
        ],
        tmp_path,
    )
    assert "[bytescale-train] cpu_smoke: 3 steps" in proc.stdout
    assert "wandb sync" in proc.stdout  # the run says how to upload it
    files = find_run_files(out / "wandb")
    assert len(files) == 1 and files[0].parent.name.startswith("offline-run-")
    run = read_run(files[0])
    steps = sorted({row["trainer/global_step"] for row in run.history if "train/loss" in row})
    assert steps == [0, 1, 2]
    missing = [k for k in STEP_KEYS if len(run.column(k)) < 3]
    assert not missing, f"logged fewer than 3 times: {missing}; keys: {sorted(run.keys())}"
    logged = run.keys()
    missing = [k for k in CHART_KEYS if not any(name.startswith(k) for name in logged)]
    assert not missing, f"charts not logged: {missing}"
    # The plan table is the whole plan (every rank's micro-batches), not only rank 0's share.
    tables = sorted((files[0].parent / "files" / "media" / "table" / "charts").glob("plan_*.table.json"))
    assert tables, "no plan table file"
    table = json.loads(tables[-1].read_text())
    assert table["columns"] == PLAN_COLUMNS
    assert {row[0] for row in table["data"]} == {0, 1}
    losses = run.column("train/loss")
    assert all(0 < x < 10 for x in losses)
    assert all(x > 0 for x in run.column("perf/tokens_per_s"))
    # The composed config (with the overrides) is in the run's config.
    assert run.config["strategy"]["planner"] == "static" and run.config["strategy"]["cp_size"] == 2
    assert run.config["trainer"]["devices"] == 2


@pytest.mark.slow
def test_planner_sweep_with_the_spawn_launcher(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_train(
        [
            "-m",
            "experiment=cpu_smoke",
            "strategy=bytescale_spawn",
            "strategy.capacity=256",
            "strategy.planner=naive,balance",
            "logger=csv",
            "trainer.max_steps=2",
            f"hydra.sweep.dir={sweep}",
        ],
        tmp_path,
        timeout=400,
    )
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name[0].isdigit())
    assert len(jobs) == 2
    assert "strategy.planner=naive" in jobs[0].name and "strategy.planner=balance" in jobs[1].name
    for job in jobs:
        (metrics,) = job.glob("csv/version_*/metrics.csv")
        rows = list(csv.DictReader(metrics.open()))
        steps = {r["step"] for r in rows if r.get("perf/tokens_per_s")}
        assert len(steps) == 2, f"{job.name}: {rows}"
        assert any(r.get("balance/bubble_fraction") for r in rows)
    # each job's closing line keeps its step count and tokens/s under spawn, and the sweep ends
    # with one table of both jobs
    for num, planner in enumerate(("naive", "balance")):
        assert re.search(
            rf"cpu_smoke job {num} \([^)]*strategy.planner={planner}[^)]*\): 2 steps in [\d.]+ s, [\d,]+ tokens/s",
            proc.stdout,
        ), proc.stdout[-3000:]
    table = proc.stdout[proc.stdout.index("[bytescale-train] sweep ") :].splitlines()
    assert table[1].split()[:2] == ["job", "steps"]
    rows = [row.split() for row in table[2:4]]
    assert [("planner=naive" in r[0], "planner=balance" in r[0], r[1]) for r in rows] == [
        (True, False, "2"),
        (False, True, "2"),
    ]
