"""A dead or stuck rank of a ``(2, 2)`` layout under a real Trainer: every rank ends, clearly, in time.

One table of layouts, as an integration table: ``tensor-parallel`` (``tensor_parallel_size=2``,
``test_tensor_parallel_strategy``'s Llama sharded by ``parallelize_llama``; global rank 3, HDP
rank 1 lane 1, stops inside its first micro-batch of step 1: its TP partner waits in the layer's
all-reduce on the TP group, the other HDP rank in the ring or the gradient sum on its lane's
data-parallel group) and ``pipeline`` (``pipeline_parallel_size=2``, ``test_pipeline_strategy``'s
model and data, PP-Balance plans with a ring item across both pipelines; global rank 3, stage 1 of
pipeline 1, stops in its stage's first forward of step 1, inside torch's schedule: its own stage
0 waits for it on the ``"pipeline"`` group, stage 1 of the other pipeline in the ring or its
stage's gradient sum).  Four ranks are started as torchrun starts them (``LOCAL_RANK`` set,
forked here), each with ``timeout=TIMEOUT_S``:

* ``stuck``: the rank sleeps far past the timeout, alive, its connections open.
* ``dead``: it exits at once (``os._exit``), closing its connections.

Every other rank must stop with the strategy's peer-failure error ("another rank died or stopped
answering during ...", the process-group timeout named) and exit 1 within the timeout (plus
scheduling slack) after the failure; a stuck rank is ended by its own watchdog (exit 124, its
message naming the phase and the option to raise) within the timeout plus the watchdog's grace
for a phase that waits on peers (30 s).  Nothing hangs.  The mesh's own groups (one per lane and
one per HDP rank, the pipeline group included) must carry the strategy's timeout for this:
torch's ``init_device_mesh`` makes them with the backend's default (30 minutes for gloo).  Plain
HDP's stuck and dead ranks are ``test_failures_dist.py``'s.
"""

from __future__ import annotations

import functools
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
from test_tensor_parallel_strategy import TPLM, MeshData

from lightning_bytescale import ByteScaleStrategy

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORLD = 4
FAILING = 3  # tensor-parallel: HDP rank 1, lane 1; pipeline: stage 1 of pipeline 1
TIMEOUT_S = 6
SLACK_S = 12.0  # scheduling slack on a loaded 2-core machine
FAIL_AT = 1


def _fail(out: str, scenario: str) -> None:
    Path(out, "failure.json").write_text(json.dumps({"t": time.time()}))
    if scenario == "dead":
        os._exit(9)
    time.sleep(3600)


class FailingTPLM(TPLM):
    """Global rank ``FAILING`` stops in its first micro-batch of step ``FAIL_AT`` (sleeps or exits)."""

    scenario = ""
    out = ""

    def training_step(self, mb, batch_idx):
        if batch_idx == FAIL_AT and self.global_rank == FAILING:
            _fail(self.out, self.scenario)
        return super().training_step(mb, batch_idx)


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
                _fail(self.out, self.scenario)

        self.model.register_forward_pre_hook(fail, with_kwargs=True)


def _tensor_parallel(scenario: str, out: Path) -> tuple[pl.LightningModule, ByteScaleStrategy, dict]:
    model = FailingTPLM(tied=False)
    model.scenario, model.out = scenario, str(out)
    strategy = ByteScaleStrategy(tensor_parallel_size=2, capacity=24, timeout=TIMEOUT_S)
    return model, strategy, {"datamodule": MeshData(3)}


def _pipeline(scenario: str, out: Path) -> tuple[pl.LightningModule, ByteScaleStrategy, dict]:
    model = FailingPipelineLM()
    model.scenario, model.out, model.data_steps = scenario, str(out), 3
    strategy = ByteScaleStrategy(pipeline_parallel_size=STAGES, capacity=_capacity(2), timeout=TIMEOUT_S)
    return model, strategy, {}


LAYOUTS = {"tensor-parallel": _tensor_parallel, "pipeline": _pipeline}


def _rank_main(layout: str, rank: int, scenario: str, port: str, out: Path) -> None:
    def fit() -> None:
        model, strategy, data = LAYOUTS[layout](scenario, out)
        trainer = pl.Trainer(
            accelerator="cpu", devices=WORLD, strategy=strategy, precision="64-true", max_steps=3,
            default_root_dir=out, **QUIET,
        )  # fmt: skip
        trainer.fit(model, **data)

    run_as_torchrun_rank(rank, WORLD, port, out, fit)


@pytest.mark.parametrize("scenario", ["stuck", "dead"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_stuck_or_dead_rank_ends_every_rank_of_the_layout_clearly_within_the_timeout(
    tmp_path, layout, scenario
):
    run_failing_ranks(
        functools.partial(_rank_main, layout), scenario, tmp_path, failing=FAILING, world=WORLD,
        timeout_s=TIMEOUT_S, slack_s=SLACK_S,
    )  # fmt: skip
