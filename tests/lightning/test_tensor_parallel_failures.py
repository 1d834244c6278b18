"""A dead or stuck rank on the ``(2, 2)`` mesh under a real Trainer: every rank ends, clearly, in time.

Four ranks are started as torchrun starts them (``LOCAL_RANK`` set, forked here), each a Trainer
with ``ByteScaleStrategy(tensor_parallel_size=2, timeout=TIMEOUT_S)`` training the reference
Llama sharded by ``parallelize_llama`` (``test_tensor_parallel_strategy``'s model and data).  In
step 1 global rank 3 (HDP rank 1, lane 1) stops inside its first micro-batch:

* ``stuck``: it sleeps far past the timeout, alive, its connections open.  Its TP partner (rank 2)
  waits in the layer's all-reduce on the TP group, the other HDP rank in the ring or the
  gradient sum on its lane's data-parallel group.
* ``dead``: it exits at once (``os._exit``), closing its connections.

Every other rank must stop with the strategy's peer-failure error ("another rank died or stopped
answering during ...", the process-group timeout named) and exit 1 within the timeout (plus
scheduling slack) after the failure; a stuck rank is ended by its own watchdog (exit 124, its
message naming the phase and the option to raise) within the timeout plus the watchdog's grace
for a phase that waits on peers (30 s).  Nothing hangs.  The
mesh's own groups (one per lane and one per HDP rank) must carry the strategy's timeout for
this: torch's ``init_device_mesh`` makes them with the backend's default (30 minutes for gloo).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
from _failure_helpers import run_failing_ranks
from _lifecycle import run_as_torchrun_rank
from _strategy_helpers import QUIET
from test_tensor_parallel_strategy import TPLM, MeshData

from lightning_bytescale import ByteScaleStrategy

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORLD = 4
FAILING = 3  # HDP rank 1, lane 1
TIMEOUT_S = 6
SLACK_S = 12.0  # scheduling slack on a loaded 2-core machine


class FailingTPLM(TPLM):
    """Global rank 3 stops in its first micro-batch of step 1 (sleeps or exits)."""

    scenario = ""
    out = ""

    def training_step(self, mb, batch_idx):
        if batch_idx == 1 and self.global_rank == FAILING:
            Path(self.out, "failure.json").write_text(json.dumps({"t": time.time()}))
            if self.scenario == "dead":
                os._exit(9)
            time.sleep(3600)
        return super().training_step(mb, batch_idx)


def _rank_main(rank: int, scenario: str, port: str, out: Path) -> None:
    def fit() -> None:
        model = FailingTPLM(tied=False)
        model.scenario, model.out = scenario, str(out)
        strategy = ByteScaleStrategy(tensor_parallel_size=2, capacity=24, timeout=TIMEOUT_S)
        trainer = pl.Trainer(
            accelerator="cpu", devices=WORLD, strategy=strategy, precision="64-true", max_steps=3,
            default_root_dir=out, **QUIET,
        )  # fmt: skip
        trainer.fit(model, datamodule=MeshData(3))

    run_as_torchrun_rank(rank, WORLD, port, out, fit)


@pytest.mark.parametrize("scenario", ["stuck", "dead"])
def test_a_stuck_or_dead_rank_on_the_mesh_ends_every_rank_clearly_within_the_timeout(tmp_path, scenario):
    run_failing_ranks(
        _rank_main, scenario, tmp_path, failing=FAILING, world=WORLD, timeout_s=TIMEOUT_S, slack_s=SLACK_S
    )
