"""``TelemetryCallback`` with ``pipeline_parallel_size=2`` on ``(2, 2)``: per pipeline its micro-batches and bubble, measured and simulated.

Four gloo ranks train ``test_pipeline_strategy``'s model and data (PP-Balance plans with a ring
item across both pipelines in every step) with ``TelemetryCallback``; every rank writes the
metrics the callback logged after each step.  The expected figures come from the plan, made
again here with ``make_plan`` on the same global batch:

* ``pipeline/micro_batches/<h>``: pipeline h's micro-batches in the plan, at least the two
  stages (a plan with a ring item pads every pipeline to P; a ring over both pipelines leaves
  no gap, so nothing else is padded);
* ``pipeline/bubble_sim/<h>``: ``pipeline_bubbles`` on that plan with the cost model it was
  made with, each micro-batch padded to C as the stages run it;
* ``pipeline/bubble/<h>``: measured, in [0, 1), the mean of ``pipeline/stage_bubble/<h>/<p>``
  over the stages.

Every figure is the same on every rank (one all-reduce of every stage's times after the step).
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
from _strategy_helpers import global_batch
from test_pipeline_strategy import STAGES, _fit, _plan

from lightning_bytescale import TelemetryCallback
from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.sim.pipeline_bubble import pipeline_bubbles

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

STEPS = 3
PIPELINES = 2


class Metrics(pl.Callback):
    """Every rank writes what the telemetry callback logged after each step."""

    def __init__(self, out: Path, telemetry: TelemetryCallback) -> None:
        self.out, self.telemetry, self.rows = out, telemetry, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append({"step": batch.step.step, "metrics": dict(self.telemetry.last_metrics)})

    def on_train_end(self, trainer, pl_module):
        (self.out / f"metrics_{trainer.global_rank}.json").write_text(json.dumps(self.rows))


def _expected(k: int) -> tuple[list[int], list[float]]:
    seqs = global_batch(k)
    plan = _plan(k, [len(s) for s in seqs], PIPELINES)
    assert any(mb.ring is not None for mbs in plan.ranks for mb in mbs), "the test wants a ring in every step"
    for mbs in plan.ranks:  # every ring spans both pipelines: the index rule leaves no gap to pad
        assert all(mb.ring is None or len(mb.ring) == PIPELINES for mb in mbs)
    counts = [max(len(mbs), STAGES) for mbs in plan.ranks]
    cost = CostModel.from_json_dict(plan.options["cost_model"])
    simulated = [b.bubble for b in pipeline_bubbles(plan, cost, pad_to_capacity=True)]
    return counts, simulated


def test_pipeline_bubbles_measured_and_simulated_per_pipeline_on_2x2(tmp_path):
    telemetry = TelemetryCallback(charts_every_n_steps=0, prog_bar=False)
    _fit(tmp_path, 4, STEPS, callbacks=[telemetry, Metrics(tmp_path, telemetry)])
    ranks = [json.loads((tmp_path / f"metrics_{r}.json").read_text()) for r in range(4)]
    for k in range(STEPS):
        counts, simulated = _expected(k)
        rows = [rank[k] for rank in ranks]
        assert all(row["step"] == k for row in rows)
        every = [row["metrics"] for row in rows]
        pipeline = {name: v for name, v in every[0].items() if name.startswith(("pipeline/", "ranks/busy_s"))}
        for r, metrics in enumerate(every[1:], 1):  # global figures: the same on every rank
            got = {name: metrics[name] for name in pipeline}
            assert got == pipeline, f"step {k}: rank {r} logged other pipeline figures than rank 0"
        m = every[0]
        assert [m[f"pipeline/micro_batches/{h}"] for h in range(PIPELINES)] == counts
        assert [m[f"ranks/micro_batches/{h}"] for h in range(PIPELINES)] == counts
        for h in range(PIPELINES):
            assert m[f"pipeline/bubble_sim/{h}"] == pytest.approx(simulated[h], rel=0, abs=1e-12)
            stages = [m[f"pipeline/stage_bubble/{h}/{p}"] for p in range(STAGES)]
            assert all(0.0 <= b < 1.0 for b in stages), stages
            assert m[f"pipeline/bubble/{h}"] == pytest.approx(sum(stages) / STAGES, abs=1e-12)
            assert 0.0 <= m[f"pipeline/bubble/{h}"] < 1.0
            assert m[f"pipeline/schedule_s/{h}"] == m[f"ranks/busy_s/{h}"] > 0
        print(
            f"step {k}: micro-batches {counts}, bubble measured "
            f"{[round(m[f'pipeline/bubble/{h}'], 3) for h in range(PIPELINES)]}, simulated "
            f"{[round(s, 3) for s in simulated]}"
        )
