"""``TelemetryCallback`` on a ``(2, 2)`` layout: each HDP rank counted once, the same global figures on every rank.

One table of layouts, as an integration table (plain HDP's telemetry is ``test_telemetry.py``'s).
Four gloo ranks train with ``TelemetryCallback``; every rank writes the metrics the callback
logged after each step.  The expected figures come from the data and the plan, made again here
with ``make_plan`` on the same global batch:

* ``tensor-parallel`` (``tensor_parallel_size=2``, ``test_tensor_parallel_strategy``'s model and
  data: the balance planner with rings, and a step in which HDP rank 1 runs no micro-batch),
  counted here: the tokens and loss tokens of the global batch (each token once, not once per
  lane), one micro-batch count per HDP rank (two entries, not four), each sequence's ring size
  (how many HDP ranks hold a piece of it).  Every lane logs the same figures of the plan and the
  data; the ring bytes are one lane's (each lane moves its own heads) and equal on both lanes;
  the achieved FLOP/s are per device (the step's FLOPs over the four devices).
* ``pipeline`` (``pipeline_parallel_size=2``, ``test_pipeline_strategy``'s model and data:
  PP-Balance plans with a ring item across both pipelines in every step), per pipeline:

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
import os
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import pytest
import test_pipeline_strategy as pipeline
import test_tensor_parallel_strategy as tensor_parallel
from _strategy_helpers import QUIET, global_batch

from lightning_bytescale import ByteScaleStrategy, TelemetryCallback
from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.sim.pipeline_bubble import pipeline_bubbles

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

WORLD = 4


class Metrics(pl.Callback):
    """Every rank writes what the telemetry callback logged after each step."""

    def __init__(self, out: Path, telemetry: TelemetryCallback) -> None:
        self.out, self.telemetry, self.rows = out, telemetry, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append({"step": batch.step_batch.step, "metrics": dict(self.telemetry.last_metrics)})

    def on_train_end(self, trainer, pl_module):
        (self.out / f"metrics_{trainer.global_rank}.json").write_text(json.dumps(self.rows))


# ------------------------------------------------------------------------------- tensor parallelism
#: what the plan and the data decide: the same on every lane of every HDP rank
PLANNED = (
    "data/",
    "ranks/micro_batches",
    "ranks/planned_s",
    "comm/cp_degree",
    "comm/sharded",
    "balance/max_over_mean_planned",
)


def _ring_sizes(plan) -> list[int]:
    """For each sequence, the HDP ranks that hold a piece of it."""
    return [
        len({r for r, mbs in enumerate(plan.ranks) for mb in mbs for p in mb.pieces if p.seq == j})
        for j in range(len(plan.lengths))
    ]


@dataclass(frozen=True)
class TensorParallel:
    """``tensor_parallel_size=2`` on ``(2, 2)``: each HDP rank counted once, every lane the same."""

    steps: int = 4
    flops_per_token: float = 1e6

    def fit(self, out: Path, callbacks: list[pl.Callback]) -> None:
        os.environ.pop("MASTER_PORT", None)
        strategy = ByteScaleStrategy(tensor_parallel_size=2, capacity=24, start_method="fork", timeout=120)
        trainer = pl.Trainer(
            accelerator="cpu", devices=WORLD, strategy=strategy, precision="64-true", default_root_dir=out,
            max_steps=self.steps, callbacks=callbacks, **QUIET,
        )  # fmt: skip
        trainer.fit(tensor_parallel.TPLM(tied=False), datamodule=tensor_parallel.MeshData(self.steps))

    def check(self, k: int, every: list[dict]) -> None:
        seqs = global_batch(k)
        plan = tensor_parallel._plan(k, [len(s) for s in seqs], 2)
        sizes = _ring_sizes(plan)
        for r, m in enumerate(every):
            assert m["data/tokens"] == sum(len(s) for s in seqs), (k, r)
            assert m["data/loss_tokens"] == sum(len(s) - 1 for s in seqs), (k, r)
            assert m["data/num_sequences"] == len(seqs)
            counts = [len(mbs) for mbs in plan.ranks]
            assert [m[f"ranks/micro_batches/{h}"] for h in range(2)] == counts, (k, r, m)
            assert "ranks/micro_batches/2" not in m and "ranks/busy_s/2" not in m  # HDP ranks, not lanes
            assert (m["ranks/micro_batches_max"], m["ranks/micro_batches_min"]) == (max(counts), min(counts))
            assert m["comm/cp_degree_max"] == max(sizes) and m["comm/sharded_sequences"] == sum(
                s > 1 for s in sizes
            )
            assert m["perf/tflops_per_device"] == pytest.approx(
                self.flops_per_token * m["data/tokens"] / m["perf/step_time_s"] / WORLD / 1e12, rel=1e-12
            )
            planned = {key: v for key, v in m.items() if key.startswith(PLANNED)}
            first = {key: v for key, v in every[0].items() if key.startswith(PLANNED)}
            assert planned == first, f"step {k}: rank {r} logged other plan figures than rank 0"
            lane_peer = every[r - 2 if r >= 2 else r + 2]  # the same lane of the other HDP rank
            assert m.get("comm/ring_bytes", 0) == lane_peer.get("comm/ring_bytes", 0)
            assert m.get("comm/ring_bytes", 0) == every[r ^ 1].get("comm/ring_bytes", 0)  # the other lane
            assert (m.get("comm/ring_bytes", 0) > 0) == (max(sizes) > 1), (k, r, m.get("comm/ring_bytes"))
        assert every[0]["ranks/micro_batches/1"] == (
            0 if k == tensor_parallel.IDLE_STEP else len(plan.ranks[1])
        )

    def check_run(self, checked: list[int]) -> None:
        rings = [
            max(_ring_sizes(tensor_parallel._plan(k, [len(s) for s in global_batch(k)], 2))) for k in checked
        ]
        assert any(size > 1 for size in rings), "no step ran a ring"


# ------------------------------------------------------------------------------- pipelines
PIPELINES = 2


@dataclass(frozen=True)
class Pipeline:
    """``pipeline_parallel_size=2`` on ``(2, 2)``: per pipeline its micro-batches and bubble, measured and simulated."""

    steps: int = 3
    flops_per_token: float | None = None

    def fit(self, out: Path, callbacks: list[pl.Callback]) -> None:
        pipeline._fit(out, WORLD, self.steps, callbacks=callbacks)

    @staticmethod
    def _expected(k: int) -> tuple[list[int], list[float]]:
        seqs = global_batch(k)
        plan = pipeline._plan(k, [len(s) for s in seqs], PIPELINES)
        assert any(mb.ring is not None for mbs in plan.ranks for mb in mbs), (
            "the test wants a ring in every step"
        )
        for mbs in plan.ranks:  # every ring spans both pipelines: the index rule leaves no gap to pad
            assert all(mb.ring is None or len(mb.ring) == PIPELINES for mb in mbs)
        counts = [max(len(mbs), pipeline.STAGES) for mbs in plan.ranks]
        cost = CostModel.from_json_dict(plan.options["cost_model"])
        simulated = [b.bubble for b in pipeline_bubbles(plan, cost, pad_to_capacity=True)]
        return counts, simulated

    def check(self, k: int, every: list[dict]) -> None:
        counts, simulated = self._expected(k)
        figures = {name: v for name, v in every[0].items() if name.startswith(("pipeline/", "ranks/busy_s"))}
        for r, metrics in enumerate(every[1:], 1):  # global figures: the same on every rank
            got = {name: metrics[name] for name in figures}
            assert got == figures, f"step {k}: rank {r} logged other pipeline figures than rank 0"
        m = every[0]
        assert [m[f"pipeline/micro_batches/{h}"] for h in range(PIPELINES)] == counts
        assert [m[f"ranks/micro_batches/{h}"] for h in range(PIPELINES)] == counts
        for h in range(PIPELINES):
            assert m[f"pipeline/bubble_sim/{h}"] == pytest.approx(simulated[h], rel=0, abs=1e-12)
            stages = [m[f"pipeline/stage_bubble/{h}/{p}"] for p in range(pipeline.STAGES)]
            assert all(0.0 <= b < 1.0 for b in stages), stages
            assert m[f"pipeline/bubble/{h}"] == pytest.approx(sum(stages) / pipeline.STAGES, abs=1e-12)
            assert 0.0 <= m[f"pipeline/bubble/{h}"] < 1.0
            assert m[f"pipeline/schedule_s/{h}"] == m[f"ranks/busy_s/{h}"] > 0
        print(
            f"step {k}: micro-batches {counts}, bubble measured "
            f"{[round(m[f'pipeline/bubble/{h}'], 3) for h in range(PIPELINES)]}, simulated "
            f"{[round(s, 3) for s in simulated]}"
        )

    def check_run(self, checked: list[int]) -> None:
        pass  # every step's own check wants a ring


LAYOUTS = {"tensor-parallel": TensorParallel(), "pipeline": Pipeline()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_telemetry_of_the_layout_counts_each_hdp_rank_once_and_every_rank_logs_the_global_figures(
    tmp_path, layout
):
    case = LAYOUTS[layout]
    telemetry = TelemetryCallback(
        charts_every_n_steps=0, flops_per_token=case.flops_per_token, prog_bar=False
    )
    case.fit(tmp_path, [telemetry, Metrics(tmp_path, telemetry)])
    ranks = [json.loads((tmp_path / f"metrics_{r}.json").read_text()) for r in range(WORLD)]
    assert all(len(rows) == case.steps for rows in ranks)
    for k in range(case.steps):
        rows = [rank[k] for rank in ranks]
        assert all(row["step"] == k for row in rows)
        case.check(k, [row["metrics"] for row in rows])
    case.check_run(list(range(case.steps)))
    last = ranks[0][-1]["metrics"]
    print(f"\nstep {case.steps - 1} on rank 0: " + ", ".join(f"{k}={v:g}" for k, v in sorted(last.items())))
