"""The planner with attention modes: ring-only is today's plan bit for bit, and modes are never slower.

``modes=("ring",)`` must reproduce, digest for digest, the plans made before modes existed
(``ring_only_digests.json``, written on the branch point's code by ``_ring_only_cases.py``) over
the planner's test sets and the first batch of every simulator scenario.  With the heads known,
the planner's default (every mode the heads allow) must never end a step later than ring-only
by its own cost model: on the no-offload grid, on batches drawn from the public length
histograms and on the simulator scenarios (pipelines included).
"""

from __future__ import annotations

import json

import pytest
from _ring_only_cases import DIGESTS, grid_cases, pinned, plan_digest, property_cases, scenario_cases

from lightning_bytescale.planner import CostModel, make_plan
from lightning_bytescale.planner import distributions as dist
from lightning_bytescale.planner.pipeline import one_f_one_b
from lightning_bytescale.sim import costs
from lightning_bytescale.sim.run import draw_batch, simulate_plan
from lightning_bytescale.sim.scenario import SCENARIOS

RING = ("ring",)
WANT = json.loads(DIGESTS.read_text())
SCENARIO_CASES = {c.name: c for c in scenario_cases()}


def test_ring_only_plans_of_the_property_and_grid_sets_are_todays():
    checked = 0
    for case in [*property_cases(), *grid_cases()]:
        assert plan_digest(case, modes=RING) == WANT[case.name], case.name
        assert plan_digest(case) == WANT[case.name], case.name  # no heads: the default is the ring only
        checked += 1
    assert checked == len([n for n in WANT if not n.startswith("scenario-")])


@pytest.mark.parametrize("name", sorted(SCENARIO_CASES))
def test_ring_only_plans_of_the_scenarios_are_todays(name):
    assert plan_digest(SCENARIO_CASES[name], modes=RING) == WANT[name]


@pytest.mark.parametrize("scenario", ["tiny", "comm-7b-byted-4k", "paper-70b-github-256k"])
def test_heads_change_nothing_in_a_ring_only_plan_but_the_cost_model_they_add(scenario):
    case = SCENARIO_CASES[f"scenario-{scenario}"]
    with_heads = costs.cost_model_for(SCENARIOS[scenario])
    assert with_heads.attention_heads is not None and pinned(with_heads) == case.options["cost_model"]
    plan = make_plan(
        case.lengths, world_size=case.world_size, **{**case.options, "cost_model": with_heads}, modes=RING
    )
    plan.options["cost_model"] = case.options["cost_model"].to_json_dict()
    assert plan.digest() == WANT[case.name]


def _end(plan) -> float:
    """The step's end by the plan's estimates (the measure ``balance`` keeps the faster plan by)."""
    p = int(plan.options.get("pipeline_degree", 1))
    if p <= 1:
        return plan.stats()["makespan"]
    fwd = plan.options["cost_model"]["forward_fraction"]
    return max(one_f_one_b([mb.est_time for mb in mbs], p, fwd) for mbs in plan.ranks if mbs)


def _both(lengths, world, **options):
    ring = make_plan(lengths, world_size=world, modes=RING, **options).validate()
    modes = make_plan(lengths, world_size=world, **options).validate()
    return ring, modes


PAPER_HEADS = CostModel.paper_preset().with_(attention_heads=32, kv_heads=8)


def test_modes_are_never_slower_on_the_grid_and_the_public_histograms():
    gains = []
    batches = [
        (c.name, c.lengths, c.world_size, c.options) for c in grid_cases() if c.name.endswith("balance")
    ]
    for name in ("pile", "prolong512k", "magi_long"):
        lengths = dist.sample_global_batch(name, 64 * 8192 * 4, 512 * 1024, seed=1)
        batches.append((name, lengths, 64, {"capacity": 8192, "offload": False}))
    for name, lengths, world, options in batches:
        cm = options.get("cost_model", CostModel.paper_preset())
        options = {**options, "cost_model": cm.with_(attention_heads=32, kv_heads=8)}
        ring, modes = _both(lengths, world, **options)
        assert _end(modes) <= _end(ring), name
        gains.append(_end(ring) / _end(modes))
        if _end(modes) == _end(ring):
            assert modes.digest() == ring.digest()  # nothing gained: the ring-only plan itself
    assert max(gains) > 1.2  # and where rings are communication-bound, modes gain


@pytest.mark.parametrize(
    "scenario", ["tiny", "comm-7b-github-4k", "comm-7b-byted-8k", "case-7b-byted-2m", "paper-70b-github-2m"]
)
def test_modes_are_never_slower_on_the_scenarios(scenario):
    sc = SCENARIOS[scenario]
    if sc.ranks > 256:  # the paper scenarios at 1/8 scale (4M tokens, 256K context)
        sc = sc.with_(gpus=sc.gpus // 8, tokens_per_step=4 * 2**20, context_length=256 * 1024)
    cm = costs.cost_model_for(sc)
    lengths = draw_batch(sc, 0)
    options = dict(
        capacity=sc.capacity,
        cost_model=cm,
        pipeline_degree=sc.pipeline_degree,
        ranks_per_node=sc.ranks_per_node,
        offload=costs.offload_config_for(sc),
    )
    ring, modes = _both(lengths, sc.ranks, **options)
    assert _end(modes) <= _end(ring)
    # the simulator charges the same model: its step is no longer either
    assert simulate_plan(modes, sc, cm).step_time_s <= simulate_plan(ring, sc, cm).step_time_s * (1 + 1e-12)
