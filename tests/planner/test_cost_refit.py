"""The cost-model refit from measured micro-batch times: features, convergence, bounds, determinism, state.

Measured times come from a known model (``TRUE``, with 5% log-normal noise) priced independently
of the refit: :func:`_truth` writes the planner's own formulas out by hand.  The refit starts from
the paper preset, which is about 100 times too fast for ``TRUE``'s compute and 40-250 times too
fast for its links.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from lightning_bytescale.planner import distributions
from lightning_bytescale.planner.cost_features import (
    Work,
    plan_work,
    plan_work_rows,
    predict_seconds,
    relative_errors,
)
from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.cost_refit import (
    CostRefit,
    RefitConfig,
    Sample,
    coefficients,
    lag_for_loader,
    read_schedule,
    refined_cost_model,
    step_samples,
    wait_for_model,
    write_schedule,
)
from lightning_bytescale.planner.errors import CostRefitError
from lightning_bytescale.planner.planners import make_plan

TRUE = CostModel(
    a=2.0e-9,
    b=3.0e-6,
    g=4.0e-4,
    num_layers=32,
    kv_bytes_per_token_per_layer=4096.0,
    bandwidth_intra=2e9,
    bandwidth_inter=5e8,
    ranks_per_node=4,
    name="true",
)
BASE = CostModel.paper_preset().with_(ranks_per_node=4)
WORLD, CAP = 8, 512


def _lengths(rng: random.Random) -> list[int]:
    """A long-tailed batch: many short documents, a few longer than C."""
    out = [min(3 * CAP, max(16, int(rng.lognormvariate(5.0, 1.1)))) for _ in range(70)]
    return out


def _truth(cost: CostModel, plan, rank: int, i: int) -> float:
    """The plan's micro-batch priced by ``cost`` with the planner's formulas written out by hand."""
    mb = plan.ranks[rank][i]
    lens = [plan.lengths[p.seq] for p in mb.pieces]
    L = cost.num_layers
    if mb.ring is None:
        return L * (sum(cost.a * s * s + cost.b * s for s in lens) + cost.g)
    n = len(mb.ring)
    slots = sum(2 * math.ceil(s / (2 * n)) for s in lens)
    attention = cost.a * sum(s * s for s in lens) / n
    intra = len({r // cost.ranks_per_node for r in mb.ring}) == 1
    bw = cost.bandwidth_intra if intra else cost.bandwidth_inter
    transfer = (
        0.0 if bw is None else cost.comm_passes * (n - 1) * slots * cost.kv_bytes_per_token_per_layer / bw
    )
    return L * (cost.b * slots + cost.g + attention + max(0.0, transfer - attention))


def _step(refit: CostRefit | None, step: int, rng: random.Random, truth: CostModel = TRUE, slow: float = 1.0):
    """Plan one step with the refit's model for it; measure it from ``truth``; the plan and samples."""
    cost = refit.model_for_step(step) if refit is not None else BASE
    plan = make_plan(_lengths(rng), world_size=WORLD, capacity=CAP, cost_model=cost, seed=step, offload=False)
    seconds = [
        [slow * _truth(truth, plan, r, i) * math.exp(rng.gauss(0.0, 0.05)) for i in range(len(mbs))]
        for r, mbs in enumerate(plan.ranks)
    ]
    return plan, seconds


def _run(
    refit: CostRefit, steps: range, seed: int = 0, truth: CostModel = TRUE, slow_step: int | None = None
):
    """Observe ``steps``; per step the relative error of its plan's est_time against the measured times."""
    errors = []
    for step in steps:
        rng = random.Random(seed * 1000 + step)
        plan, seconds = _step(refit, step, rng, truth, 100.0 if step == slow_step else 1.0)
        work = plan_work(plan)
        errors.append(
            relative_errors([w.planned_s for r in work for w in r], [s for r in seconds for s in r])
        )
        refit.observe(step, step_samples(work, seconds))
    return errors


def _bits(cost: CostModel) -> tuple:
    return tuple(
        float(v).hex() if v is not None else None
        for v in (cost.a, cost.b, cost.g, cost.bandwidth_intra, cost.bandwidth_inter)
    )


# ---------------------------------------------------------------------- features


def test_the_features_price_every_micro_batch_as_the_planner_did():
    """``predict_seconds`` of the plan's own model gives back every micro-batch's ``est_time``:
    local, ring inside and across nodes, Ulysses and hybrid items, for balance, naive and static."""
    cost = CostModel.paper_preset().with_(
        attention_heads=32, kv_heads=8, bandwidth_inter=2e9, ranks_per_node=4
    )
    lengths = distributions.sample_global_batch(
        "github", tokens=400_000, context_length=65_536, rng=random.Random(2)
    )
    modes_seen: set[str] = set()
    for planner in ("balance", "naive", "static"):
        plan = make_plan(
            lengths, world_size=16, capacity=8192, planner=planner, cost_model=cost, offload=False, seed=1
        )
        for r, works in enumerate(plan_work(plan)):
            for mb, w in zip(plan.ranks[r], works):
                modes_seen.add("local" if mb.ring is None else mb.mode)
                assert predict_seconds(cost, w) == pytest.approx(mb.est_time, rel=1e-12)
                assert Work.from_row(w.to_row()) == w
    assert {"local", "ring"} <= modes_seen and modes_seen & {"ulysses", "hybrid"}, modes_seen


def test_relative_errors_are_median_and_worst():
    e = relative_errors([1.0, 2.0, 3.0, 10.0], [1.0, 1.0, 4.0, 5.0])
    assert (e.median, e.worst, e.count) == (pytest.approx(0.625), 1.0, 4)
    assert relative_errors([1.0], [0.0]).count == 0 and math.isnan(relative_errors([], []).median)


# ---------------------------------------------------------------------- convergence and bounds


def test_the_refit_converges_within_15_percent_after_20_steps(capsys):
    refit = CostRefit(BASE, RefitConfig(lag=2))
    errors = _run(refit, range(24))
    default = _run(
        CostRefit(BASE, RefitConfig(enabled=False)), range(20, 24)
    )  # the same batches, never refitted
    after = sorted(e.median for e in errors[20:])
    with capsys.disabled():
        print(
            f"\nrefit from the paper preset: median relative error at steps 20-23 {[f'{e:.3f}' for e in after]}, "
            f"worst {max(e.worst for e in errors[20:]):.3f}; the paper preset on the same steps "
            f"{[f'{e.median:.3f}' for e in default]}"
        )
    assert max(after) <= 0.15
    assert min(e.median for e in default) > 0.5  # the preset is far too fast for TRUE
    got = coefficients(refit.current)
    assert got["a"] == pytest.approx(TRUE.a, rel=0.15) and got["b"] == pytest.approx(TRUE.b, rel=0.15)


def test_the_error_on_data_from_another_kind_of_model_is_reported(capsys):
    """Times with a cost the model has no term for (a per-sequence overhead and an s^1.5 term):
    the refit still does far better than the preset, and what is left is reported."""

    refit = CostRefit(BASE)
    errors = []
    for step in range(24):
        rng = random.Random(77 + step)
        plan, seconds = _step(refit, step, rng)
        for r, mbs in enumerate(plan.ranks):
            for i, mb in enumerate(mbs):
                extra = sum(2e-5 + 4e-8 * plan.lengths[p.seq] ** 1.5 for p in mb.pieces) * TRUE.num_layers
                seconds[r][i] += extra
        work = plan_work(plan)
        errors.append(
            relative_errors([w.planned_s for r in work for w in r], [s for r in seconds for s in r])
        )
        refit.observe(step, step_samples(work, seconds))
    late = [e.median for e in errors[20:]]
    with capsys.disabled():
        print(
            f"\nrefit on data from another model: median relative error at steps 20-23 {[f'{e:.3f}' for e in late]}"
        )
    assert max(late) < 0.5 and max(late) < min(e.median for e in errors[:2])


def test_no_update_moves_a_coefficient_by_more_than_the_bound():
    """Every version is within ``max_change`` of the one before, whatever the data (the preset is
    100x off, so the first updates are clamped, and say so)."""
    refit = CostRefit(BASE, RefitConfig(max_change=2.0))
    clamped_any = False
    for step in range(14):
        before = coefficients(refit.current, BASE)
        plan, seconds = _step(refit, step, random.Random(step))
        report = refit.observe(step, step_samples(plan_work(plan), seconds))
        after = coefficients(refit.current, BASE)
        for k in before:
            if before[k] > 0:
                assert 0.5 - 1e-12 <= after[k] / before[k] <= 2.0 + 1e-12, (step, k, before[k], after[k])
        clamped_any |= bool(report.clamped)
        if report.clamped:
            assert "clamped" in report.line()
    assert clamped_any


def test_a_step_100x_slower_moves_no_coefficient_beyond_the_bound_and_hardly_at_all_once_warm():

    def ratios_after_a_slow_step(warm_steps: int) -> dict[str, float]:
        refit = CostRefit(BASE)
        _run(refit, range(warm_steps))
        before = coefficients(refit.current, BASE)
        _run(refit, range(warm_steps, warm_steps + 1), slow_step=warm_steps)
        after = coefficients(refit.current, BASE)
        return {k: after[k] / before[k] for k in before}

    for k, ratio in ratios_after_a_slow_step(16).items():
        assert ratio == pytest.approx(1.0, rel=0.05), (k, ratio)
    # early, when the slow step is half the window, only the clamp holds it
    for k, ratio in ratios_after_a_slow_step(3).items():
        assert 0.5 - 1e-12 <= ratio <= 2.0 + 1e-12, (k, ratio)


def test_the_first_steps_are_not_sampled_and_the_refit_switches_off():
    refit = CostRefit(BASE, RefitConfig(warmup_steps=3))
    reports = []
    for step in range(4):
        plan, seconds = _step(refit, step, random.Random(step))
        reports.append(refit.observe(step, step_samples(plan_work(plan), seconds)))
    assert [r.updated for r in reports] == [False, False, False, True] and "warm-up" in reports[0].reason
    off = CostRefit(BASE, RefitConfig(enabled=False))
    _run(off, range(10))
    assert all(off.model_for_step(k) is BASE for k in range(0, 100))
    plan, seconds = _step(off, 10, random.Random(0))
    assert off.observe(10, step_samples(plan_work(plan), seconds)).reason == "refit off"


# ---------------------------------------------------------------------- determinism, lag, state


def test_two_ranks_compute_the_same_models_bit_for_bit():
    """Every rank feeds the same gathered step data (as JSON rows, as the loader carries them)."""
    rank0, rank1 = CostRefit(BASE), CostRefit(BASE)
    for step in range(22):
        plan, seconds = _step(rank0, step, random.Random(step))
        rows = json.loads(json.dumps(plan_work_rows(plan)))
        assert rank1.model_for_step(step) == rank0.model_for_step(step)
        r0 = rank0.observe(step, step_samples(plan_work(plan), seconds))
        r1 = rank1.observe(step, step_samples(rows, json.loads(json.dumps(seconds))))
        assert _bits(rank0.current) == _bits(rank1.current) and r0.line() == r1.line()
    assert json.dumps(rank0.state_dict()) == json.dumps(rank1.state_dict())


def test_a_model_applies_from_lag_steps_after_the_last_step_it_saw():
    refit = CostRefit(BASE, RefitConfig(lag=3))
    assert refit.model_for_step(2) is BASE
    with pytest.raises(CostRefitError, match=r"cost model of step 3 is not known yet.*lag 3"):
        refit.model_for_step(3)
    _run(refit, range(6))
    assert [v.apply_from for v in refit.versions][-1] == 5 + 3
    assert refit.model_for_step(8) == refit.current and refit.model_for_step(7) != refit.current
    with pytest.raises(CostRefitError, match="no longer kept"):
        refit.model_for_step(0)
    with pytest.raises(CostRefitError, match="observe every step once, in order"):
        refit.observe(5, [])
    assert lag_for_loader(0) == 1 and lag_for_loader(2) == 5 and lag_for_loader(2, prefetch_factor=4) == 9


def test_the_schedule_file_gives_the_workers_the_same_models(tmp_path):
    refit = CostRefit(BASE, RefitConfig(lag=2))
    _run(refit, range(8))
    path = write_schedule(tmp_path / "rank0" / "cost_schedule.json", refit)
    sched = read_schedule(path)
    for k in range(7, 10):
        assert sched.model_for_step(k) == refit.model_for_step(k)
        assert wait_for_model(path, k, timeout_s=1) == refit.model_for_step(k)
    with pytest.raises(
        CostRefitError, match=r"waited 0 s for the cost model of step 10 .*raise it \(lag_for_loader\)"
    ):
        wait_for_model(path, 10, timeout_s=0.05)
    assert list(tmp_path.glob("rank0/*.tmp")) == []


def test_a_resumed_refit_plans_every_step_as_the_uninterrupted_one():
    whole = CostRefit(BASE)
    _run(whole, range(30))
    first = CostRefit(BASE)
    _run(first, range(15))
    saved = json.loads(json.dumps(first.state_dict()))
    resumed = CostRefit.from_state_dict(saved)
    assert resumed.state_dict() == first.state_dict()
    _run(resumed, range(15, 30))
    assert json.dumps(resumed.state_dict()) == json.dumps(whole.state_dict())
    for step in range(30, 32):
        rng_a, rng_b = random.Random(step), random.Random(step)
        a, _ = _step(whole, step, rng_a)
        b, _ = _step(resumed, step, rng_b)
        assert a.digest() == b.digest()


def test_a_saved_state_that_cannot_be_read_is_refused():
    with pytest.raises(CostRefitError, match="not a saved cost refit"):
        CostRefit.from_state_dict({"format": "x"})
    state = CostRefit(BASE).state_dict()
    del state["versions"]
    with pytest.raises(CostRefitError, match="cannot be read .*KeyError"):
        CostRefit.from_state_dict(state)


# ---------------------------------------------------------------------- options, inputs, reading back


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_change": 1.0}, "max_change must be a finite factor > 1"),
        ({"lag": 0}, "lag must be an integer >= 1"),
        ({"window": 0}, "window must be an integer >= 1"),
        ({"min_samples": 2}, "min_samples must be an integer >= 3"),
        ({"enabled": "yes"}, "enabled must be True or False"),
    ],
)
def test_options_are_checked(kwargs, match):
    with pytest.raises(CostRefitError, match=match):
        RefitConfig(**kwargs)


def test_step_samples_pair_features_with_times():
    w = Work(area=4.0, tokens=2.0)
    assert step_samples([[w, w]], [[0.5, float("nan")]]) == [Sample(0.5, (w,))]
    with pytest.raises(CostRefitError, match="rank 0 planned 2 micro-batches but 1 times were measured"):
        step_samples([[w, w]], [[0.5]])
    with pytest.raises(CostRefitError, match="features of 1 ranks but times of 2"):
        step_samples([[w]], [[0.5], [0.5]])


def test_stage_sums_are_samples_too():
    """A pipeline stage measures the sum of its micro-batches: one sample of several works."""
    refit = CostRefit(BASE.with_(bandwidth_intra=None, bandwidth_inter=None))
    truth = TRUE.with_(bandwidth_intra=None, bandwidth_inter=None)
    for step in range(20):
        rng = random.Random(step)
        plan, seconds = _step(refit, step, rng, truth)
        work = plan_work(plan)
        sums = [Sample(sum(secs), tuple(ws)) for ws, secs in zip(work, seconds) if ws]
        refit.observe(step, sums)
    assert coefficients(refit.current)["a"] == pytest.approx(truth.a, rel=0.3)


def test_the_newest_model_is_read_back_from_a_checkpoint_telemetry_or_a_file(tmp_path):
    refit = CostRefit(BASE)
    _run(refit, range(6))
    state = refit.state_dict()
    assert refined_cost_model(state) == refit.current
    checkpoint = {"state_dict": {}, "callbacks": {"CostRefit": {"cost_refit": state}}, "epoch": 0}
    assert refined_cost_model(checkpoint) == refit.current
    telemetry = [
        {"step": 1, "loss": 2.0},
        {"step": 5, "cost_model": refit.current.to_json_dict()},
        {"step": 6},
    ]
    assert refined_cost_model(telemetry) == refit.current
    assert refined_cost_model({"format": "bytescale-profile/1", "cost_model": BASE.to_json_dict()}) == BASE
    with pytest.raises(CostRefitError, match="found no cost model"):
        refined_cost_model({"loss": 1.0})
