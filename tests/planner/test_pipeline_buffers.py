"""A pipeline stage's receive buffers, and ``max_micro_batches``: the count PP-Balance keeps every pipeline within.

torch's ``PipelineStage`` keeps ``[1, C, dim]`` receive buffers for every micro-batch of a step
(docs/pipelines.md, "Receive buffers"); the counts here are by hand, and
``tests/parallel/test_pipeline_reuse.py`` checks them against the buffers torch allocates.
"""

from __future__ import annotations

import pytest

from lightning_bytescale.planner import CostModel, PlanError, PlannerConfig, make_plan
from lightning_bytescale.planner.errors import PlannerConfigError
from lightning_bytescale.planner.pipeline import (
    max_micro_batches_within,
    receive_buffer_bytes,
    receive_buffer_slots,
)
from lightning_bytescale.planner.pipeline_order import order_pipelines

STAGES = 2
# attention-heavy costs: a micro-batch of one 1000-token sequence costs about ten of ten short
# sequences, so PP-Balance gives three pipelines one long sequence each and the fourth every short one
ATTENTION_HEAVY = CostModel(a=1e-6, b=1e-9, name="attention-heavy")
LENGTHS = [1000] * 3 + [90, 110] * 40
PLAN = dict(world_size=4, capacity=1024, pipeline_degree=STAGES, seed=0, cost_model=ATTENTION_HEAVY)


def test_receive_buffers_by_hand():
    # every stage but the first: the activation it receives; every stage but the last: the output
    # gradient it receives
    assert [receive_buffer_slots(s, 4) for s in range(4)] == [1, 2, 2, 1]
    assert [receive_buffer_slots(s, 2) for s in range(2)] == [1, 1]
    assert receive_buffer_slots(0, 1) == 0
    # 5 micro-batches of C = 8 slots, dim 4 in float32 (16 bytes a token): a middle stage holds
    # 2 x 5 x 8 x 16 = 1280 bytes, two stages at most 1 x 5 x 8 x 16 = 640
    assert receive_buffer_bytes(5, 8, 16.0, 4) == 1280.0
    assert receive_buffer_bytes(5, 8, 16.0, 2) == 640.0
    assert receive_buffer_bytes(5, 8, 16.0, 1) == 0.0
    # an 8B-class model: dim 4096 in float32, C = 8192, 32 micro-batches: 8 GiB on a middle stage
    assert receive_buffer_bytes(32, 8192, 4096 * 4, 4) == 2 * 32 * 8192 * 4096 * 4 == 8 * 2**30
    assert max_micro_batches_within(1280, 8, 16.0, 4) == 5
    assert max_micro_batches_within(1279, 8, 16.0, 4) == 4
    with pytest.raises(PlanError, match="stage 4 is not one of 4"):
        receive_buffer_slots(4, 4)


def _counts(plan) -> list[int]:
    return order_pipelines(plan).micro_batch_counts  # as the pipelines run them, padding included


def test_pp_balance_keeps_every_pipeline_within_max_micro_batches():
    free = make_plan(LENGTHS, **PLAN).validate()
    assert sorted(_counts(free)) == [1, 1, 1, 9]  # the short sequences' pipeline runs nine
    capped = make_plan(LENGTHS, max_micro_batches=3, **PLAN).validate()  # every token planned once
    assert _counts(capped) == [3, 3, 3, 3]
    assert capped.options["max_micro_batches"] == 3
    assert capped.stats()["makespan"] > free.stats()["makespan"]  # the limit costs time, as it should
    assert make_plan(LENGTHS, max_micro_batches=3, **PLAN).digest() == capped.digest()
    assert make_plan(LENGTHS, max_micro_batches=9, **PLAN).digest() != capped.digest()


def test_a_batch_that_does_not_fit_the_limit_is_refused():
    with pytest.raises(
        PlanError, match=r"max_micro_batches=2 .*4 item\(s\) .* left.*Raise max_micro_batches"
    ):
        make_plan(LENGTHS, max_micro_batches=2, **PLAN)


def test_another_planner_over_the_limit_is_refused():
    kw = {**PLAN, "planner": "naive"}
    most = max(_counts(make_plan(LENGTHS, **kw)))
    make_plan(LENGTHS, max_micro_batches=most, **kw)  # at the limit: planned
    with pytest.raises(
        PlanError, match=rf"runs {most} micro-batches.*max_micro_batches={most - 1}.*'balance'"
    ):
        make_plan(LENGTHS, max_micro_batches=most - 1, **kw)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"max_micro_batches": 8}, r"pipeline_degree is 1"),
        (
            {"max_micro_batches": 3, "pipeline_degree": 4},
            r"max_micro_batches must be >= pipeline_degree \(4\)",
        ),
        ({"max_micro_batches": True, "pipeline_degree": 2}, r"max_micro_batches must be an integer or None"),
    ],
)
def test_the_config_refuses_a_limit_that_cannot_hold(options, match):
    with pytest.raises(PlannerConfigError, match=match):
        PlannerConfig(**options)
    assert PlannerConfig(max_micro_batches=4, pipeline_degree=4).max_micro_batches == 4
