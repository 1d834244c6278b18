"""A dead or stuck rank of a ``(2, 2)`` pipeline run under a real Trainer: every rank ends, clearly, in time.

Four ranks are started as torchrun starts them (``LOCAL_RANK`` set, forked here), each a Trainer
with ``ByteScaleStrategy(pipeline_parallel_size=2, timeout=TIMEOUT_S)`` training
``test_pipeline_strategy``'s model and data (PP-Balance plans with a ring item across both
pipelines in every step).  In step 1 global rank ``FAILING`` (stage 1 of pipeline 1) stops in its
stage's first forward, inside torch's schedule:

* ``stuck``: it sleeps far past the timeout, alive, its connections open.  Its own stage 0
  (rank 1) waits for it on the ``"pipeline"`` group (the backward's gradient), stage 1 of the
  other pipeline (rank 2) in the ring on the global group or the gradient sum on its stage's
  ``"data_parallel"`` group, and rank 0 in its stage's gradient sum.
* ``dead``: it exits at once (``os._exit``), closing its connections.

Every other rank must stop with the strategy's peer-failure error (the process-group timeout
named) and exit 1 within the timeout plus scheduling slack; a stuck rank is ended by its own
watchdog (exit 124) within the timeout plus the watchdog's grace for a phase that waits on peers.
Nothing hangs.  The mesh's groups, the pipeline group included, must carry the strategy's
timeout for this (``init_device_mesh`` makes them with gloo's default of 30 minutes).
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
from test_pipeline_strategy import STAGES, PipelineLM, _capacity

from lightning_bytescale import ByteScaleStrategy

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORLD = 4
FAILING = 3  # stage 1 of pipeline 1
TIMEOUT_S = 6
SLACK_S = 12.0  # scheduling slack on a loaded 2-core machine
FAIL_AT = 1


class FailingPipelineLM(PipelineLM):
    """Global rank ``FAILING`` stops in its stage's first forward of step ``FAIL_AT`` (sleeps or exits)."""

    scenario = ""
    out = ""

    def configure_model(self) -> None:
        super().configure_model()
        if self.global_rank != FAILING:
            return

        def fail(module, args, kwargs):
            if self.trainer.global_step == FAIL_AT:
                Path(self.out, "failure.json").write_text(json.dumps({"t": time.time()}))
                if self.scenario == "dead":
                    os._exit(9)
                time.sleep(3600)

        self.model.register_forward_pre_hook(fail, with_kwargs=True)


def _rank_main(rank: int, scenario: str, port: str, out: Path) -> None:
    def fit() -> None:
        model = FailingPipelineLM()
        model.scenario, model.out, model.data_steps = scenario, str(out), 3
        strategy = ByteScaleStrategy(pipeline_parallel_size=STAGES, capacity=_capacity(2), timeout=TIMEOUT_S)
        trainer = pl.Trainer(
            accelerator="cpu", devices=WORLD, strategy=strategy, precision="64-true", max_steps=3,
            default_root_dir=out, **QUIET,
        )  # fmt: skip
        trainer.fit(model)

    run_as_torchrun_rank(rank, WORLD, port, out, fit)


@pytest.mark.parametrize("scenario", ["stuck", "dead"])
def test_a_stuck_or_dead_rank_of_a_pipeline_run_ends_every_rank_clearly_within_the_timeout(
    tmp_path, scenario
):
    run_failing_ranks(
        _rank_main, scenario, tmp_path, failing=FAILING, world=WORLD, timeout_s=TIMEOUT_S, slack_s=SLACK_S
    )
