"""The step lower bound holds for every planner's simulated plan, and is reached where it must be."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_bytescale.planner import CostModel, make_plan
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan
from lightning_bytescale.sim.bounds import best_ring_time, step_lower_bound
from lightning_bytescale.sim.compare import NO_OFFLOAD_PLANNERS
from lightning_bytescale.sim.run import allreduce_seconds, make_variant_plan, simulate_plan
from lightning_bytescale.sim.scenario import MODELS, Scenario
from lightning_bytescale.sim.timeline import SimulationError

# comm-bound enough that ring size matters: a slow link between nodes of 4 ranks
CM = CostModel(
    a=2e-9,
    b=1e-5,
    g=1e-4,
    num_layers=4,
    kv_bytes_per_token_per_layer=2e3,
    bandwidth_intra=4e9,
    bandwidth_inter=2e8,
)


def _scenario(world: int, capacity: int) -> Scenario:
    return Scenario(
        name="bound", model=MODELS["7b"], gpus=world, capacity=capacity, gpus_per_node=4,
        context_length=world * capacity, tokens_per_step=world * capacity,
    )  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(
    world=st.sampled_from([2, 4, 8, 12]),
    capacity=st.sampled_from([64, 256]),
    fractions=st.lists(st.floats(0.01, 1.0), min_size=1, max_size=30),
    planner=st.sampled_from(NO_OFFLOAD_PLANNERS),
)
def test_no_plan_ends_a_step_before_the_bound(world, capacity, fractions, planner):
    # lengths up to half the ranks' capacity, so that every planner (power-of-two groups too) can place them
    lengths = [max(1, int(f * world * capacity / 2)) for f in fractions]
    scenario = _scenario(world, capacity)
    plan = make_variant_plan(planner, lengths, scenario, CM, seed=0)
    simulated = simulate_plan(plan, scenario, CM).step_time_s
    bound = step_lower_bound(lengths, scenario, CM)
    assert bound.step_s <= simulated * (1 + 1e-12), (planner, bound, simulated)


def test_a_sequence_that_needs_every_rank_reaches_the_bound_exactly():
    world, capacity = 8, 256
    s = world * capacity  # only a ring of all 8 ranks holds it
    scenario = _scenario(world, capacity)
    plan = make_plan([s], world_size=world, capacity=capacity, cost_model=CM, ranks_per_node=4)
    simulated = simulate_plan(plan, scenario, CM).step_time_s
    bound = step_lower_bound([s], scenario, CM)
    expect = CM.ring_member_time([s], world, intra=False)[0]
    assert bound.longest_sequence_s == pytest.approx(expect, rel=1e-12)
    assert bound.step_s == pytest.approx(simulated, rel=1e-12)
    assert bound.allreduce_s == allreduce_seconds(scenario)


def test_the_best_ring_is_the_fastest_one_not_the_smallest():
    # on a fast link a long sequence runs faster on more ranks than it needs
    fast = CM.with_(bandwidth_intra=1e12, bandwidth_inter=1e12)
    s, capacity = 1024, 512
    times = {n: fast.ring_member_time([s], n, intra=False)[0] for n in range(2, 9)}
    assert best_ring_time(s, 8, capacity, fast, ranks_per_node=1) == pytest.approx(min(times.values()))
    assert min(times, key=times.get) > 2


def test_refuses_what_it_does_not_bound():
    with pytest.raises(SimulationError, match="pipeline"):
        step_lower_bound([10], _scenario(4, 64).with_(pipeline_degree=2), CM)
    with pytest.raises(SimulationError, match="needs 5 ranks"):
        best_ring_time(300, 4, 64, CM, ranks_per_node=4)


def test_work_bound_is_the_compute_or_the_least_ring_transfers_spread_over_the_ranks():
    world, capacity = 4, 128
    short = [100, 50, 7]  # local: no transfer, the compute binds
    bound = step_lower_bound(short, _scenario(world, capacity), CM)
    expect = CM.num_layers * sum(CM.b * s + CM.a * s * s for s in short) / world
    assert bound.work_s == pytest.approx(expect, rel=1e-12)
    # 500 tokens need rings of 4 (one node of 4): 3 * 500 tokens' K/V on the fast link, twice
    # (forward and backward passes), against a * 500^2 of attention
    long = [500, 100]
    moved = CM.comm_passes * 3 * 500 * CM.kv_bytes_per_token_per_layer / CM.bandwidth_intra
    attention = CM.a * (500**2 + 100**2)
    bound = step_lower_bound(long, _scenario(world, capacity), CM)
    expect = CM.num_layers * (CM.b * 600 + max(attention, moved)) / world
    assert bound.work_s == pytest.approx(expect, rel=1e-12)
    assert moved > attention  # the transfer term is the one that binds here


def test_plan_of_locals_meets_the_work_bound_up_to_the_per_micro_batch_constant():
    # four equal sequences, one per rank: each rank's time is its sequence's, g included
    world, capacity = 4, 128
    lengths = [100] * world
    plan = Plan(
        world_size=world, capacity=capacity, planner="by-hand", lengths=tuple(lengths),
        ranks=[[MicroBatch([Piece(r, ((0, 100),))])] for r in range(world)],
    )  # fmt: skip
    scenario = _scenario(world, capacity)
    simulated = simulate_plan(plan, scenario, CM)
    bound = step_lower_bound(lengths, scenario, CM)
    assert simulated.compute_finish_s - bound.work_s == pytest.approx(CM.num_layers * CM.g, rel=1e-9)
