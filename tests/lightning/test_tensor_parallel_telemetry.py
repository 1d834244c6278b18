"""``TelemetryCallback`` on the ``(2, 2)`` mesh: each HDP rank counted once, the same figures on every lane.

Four gloo ranks train ``test_tensor_parallel_strategy``'s model and data (the balance planner
with rings, and a step in which HDP rank 1 runs no micro-batch) with ``TelemetryCallback``;
every rank writes the metrics the callback logged after each step.  The expected figures come
from the data and the plan, made again here with ``make_plan`` on the same global batch, and
counted here: the tokens and loss tokens of the global batch (each token once, not once per
lane), one micro-batch count per HDP rank (two entries, not four), each sequence's ring size
(how many HDP ranks hold a piece of it).  Every lane logs the same figures of the plan and the
data; the ring bytes are one lane's (each lane moves its own heads) and equal on both lanes;
the achieved FLOP/s are per device (the step's FLOPs over the four devices).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
from _strategy_helpers import QUIET, global_batch
from test_tensor_parallel_strategy import IDLE_STEP, TPLM, MeshData, _plan

from lightning_bytescale import ByteScaleStrategy, TelemetryCallback

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

STEPS = 4
FLOPS_PER_TOKEN = 1e6
# what the plan and the data decide: the same on every lane of every HDP rank
PLANNED = (
    "data/",
    "ranks/micro_batches",
    "ranks/planned_s",
    "comm/cp_degree",
    "comm/sharded",
    "balance/max_over_mean_planned",
)


class Metrics(pl.Callback):
    """Every rank writes what the telemetry callback logged after each step."""

    def __init__(self, out: Path, telemetry: TelemetryCallback) -> None:
        self.out, self.telemetry, self.rows = out, telemetry, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append(dict(self.telemetry.last_metrics))

    def on_train_end(self, trainer, pl_module):
        (self.out / f"metrics_{trainer.global_rank}.json").write_text(json.dumps(self.rows))


def _fit(out: Path) -> None:
    os.environ.pop("MASTER_PORT", None)
    telemetry = TelemetryCallback(charts_every_n_steps=0, flops_per_token=FLOPS_PER_TOKEN, prog_bar=False)
    strategy = ByteScaleStrategy(tensor_parallel_size=2, capacity=24, start_method="fork", timeout=120)
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, precision="64-true", default_root_dir=out,
        max_steps=STEPS, callbacks=[telemetry, Metrics(out, telemetry)], **QUIET,
    )  # fmt: skip
    trainer.fit(TPLM(tied=False), datamodule=MeshData(STEPS))


def _ring_sizes(plan) -> list[int]:
    """For each sequence, the HDP ranks that hold a piece of it."""
    return [
        len({r for r, mbs in enumerate(plan.ranks) for mb in mbs for p in mb.pieces if p.seq == j})
        for j in range(len(plan.lengths))
    ]


def test_telemetry_counts_each_hdp_rank_once_and_every_lane_logs_the_same(tmp_path):
    _fit(tmp_path)
    ranks = [json.loads((tmp_path / f"metrics_{r}.json").read_text()) for r in range(4)]
    assert all(len(rows) == STEPS for rows in ranks)
    rings_seen = 0
    for k in range(STEPS):
        seqs = global_batch(k)
        plan = _plan(k, [len(s) for s in seqs], 2)
        sizes = _ring_sizes(plan)
        rings_seen += max(sizes) > 1
        for r, rows in enumerate(ranks):
            m = rows[k]
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
                FLOPS_PER_TOKEN * m["data/tokens"] / m["perf/step_time_s"] / 4 / 1e12, rel=1e-12
            )
            planned = {key: v for key, v in m.items() if key.startswith(PLANNED)}
            first = {key: v for key, v in ranks[0][k].items() if key.startswith(PLANNED)}
            assert planned == first, f"step {k}: rank {r} logged other plan figures than rank 0"
            lane_peer = ranks[r - 2 if r >= 2 else r + 2][k]  # the same lane of the other HDP rank
            assert m.get("comm/ring_bytes", 0) == lane_peer.get("comm/ring_bytes", 0)
            assert m.get("comm/ring_bytes", 0) == ranks[r ^ 1][k].get("comm/ring_bytes", 0)  # the other lane
            assert (m.get("comm/ring_bytes", 0) > 0) == (max(sizes) > 1), (k, r, m.get("comm/ring_bytes"))
        assert ranks[0][k]["ranks/micro_batches/1"] == (0 if k == IDLE_STEP else len(plan.ranks[1]))
    assert rings_seen >= 1, "no step ran a ring"
    print(
        f"\nstep {STEPS - 1} on rank 0: " + ", ".join(f"{k}={v:g}" for k, v in sorted(ranks[0][-1].items()))
    )
