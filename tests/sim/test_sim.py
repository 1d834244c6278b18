"""Simulator costs against hand-computed numbers, peer planners, the CLI and one scenario end to end."""

from __future__ import annotations

import json
import random

import pytest

from lightning_bytescale.cli.sim import main
from lightning_bytescale.planner import CostModel, make_plan
from lightning_bytescale.planner.peers import (
    karmarkar_karp,
    megatron_cp_size,
    plan_megatron_dcp,
    plan_verl_kk,
)
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan
from lightning_bytescale.sim import costs
from lightning_bytescale.sim.run import SUMMARY_KEYS, allreduce_seconds, run_scenario, simulate_plan
from lightning_bytescale.sim.scenario import MODELS, SCENARIOS, Scenario

# a = 1e-6 s/token^2, b = 1e-3 s/token, 2 layers, 1,000 K/V bytes a token a layer, 1 MB/s between nodes
CM = CostModel(
    a=1e-6,
    b=1e-3,
    num_layers=2,
    kv_bytes_per_token_per_layer=1000.0,
    bandwidth_intra=1e7,
    bandwidth_inter=1e6,
    c=100.0,
)


def _scenario(gpus_per_node: int = 1, **kw) -> Scenario:
    base = dict(
        name="hand",
        model=MODELS["7b"],
        gpus=3,
        tensor_parallel=1,
        capacity=8,
        gpus_per_node=gpus_per_node,
        grad_bytes_per_param=0,  # no all-reduce unless a test asks for one
        extra={"pcie_per_gpu": 1e3},
    )
    base.update(kw)
    return Scenario(**base)


def _ring_plan() -> Plan:
    # sequence 0 (8 tokens) on a ring of ranks (0, 1); sequence 1 (4 tokens) local on rank 2
    ring = (0, 1)
    return Plan(
        3,
        8,
        "hand",
        (8, 4),
        [
            [MicroBatch([Piece(0, ((0, 2), (6, 8)))], ring=ring, item=0)],
            [MicroBatch([Piece(0, ((2, 6),))], ring=ring, item=0)],
            [MicroBatch([Piece(1, ((0, 4),))])],
        ],
    ).validate()


def test_ring_with_exposed_comm_by_hand():
    # member: c = ceil(8/4) = 2, 4 slots.  Per layer: linear = 1e-3 * 4 = 4e-3;
    # attention = 1e-6 * 64 / 2 = 3.2e-5; transfer = 3 passes * 1 peer * 4 slots * 1000 B / 1e6 B/s = 1.2e-2.
    # time = 2 layers * (4e-3 + max(3.2e-5, 1.2e-2)) = 0.032; exposed = 2 * (1.2e-2 - 3.2e-5)
    res = simulate_plan(_ring_plan(), _scenario(), CM)
    assert res.finish[0] == pytest.approx(0.032)
    assert res.finish[1] == pytest.approx(0.032)
    # local: 2 layers * (1e-6 * 16 + 1e-3 * 4) = 0.008032
    assert res.finish[2] == pytest.approx(0.008032)
    assert res.step_time_s == pytest.approx(0.032)
    assert res.exposed_comm_s == pytest.approx(2 * 2 * (1.2e-2 - 3.2e-5))
    # bytes: 3 passes * 2 layers * 2 members * 1 peer * 4 slots * 1000 B
    assert res.ring_bytes == pytest.approx(48_000)
    assert res.bubble_fraction == pytest.approx(1 - (0.032 + 0.032 + 0.008032) / 3 / 0.032)


def test_ring_inside_one_node_uses_intra_bandwidth():
    # 2 ranks per node: ranks 0 and 1 share node 0 -> transfer 1.2e-3 per layer, still above attention
    res = simulate_plan(_ring_plan(), _scenario(gpus_per_node=2), CM)
    assert res.finish[0] == pytest.approx(2 * (4e-3 + 1.2e-3))


def test_hidden_comm_when_attention_is_longer():
    cm = CM.with_(a=1e-2)  # attention = 1e-2 * 64 / 2 = 0.32 s per layer >> transfer
    res = simulate_plan(_ring_plan(), _scenario(), cm)
    assert res.finish[0] == pytest.approx(2 * (4e-3 + 0.32))
    assert res.exposed_comm_s == 0.0


def test_offload_exposed_beyond_eq3_overlap():
    # 4-layer model (l = 4, two layers stay resident, two offload), PCIe 1,000 B/s.
    cm = CM.with_(num_layers=4)
    plan = Plan(1, 8, "hand", (4,), [[MicroBatch([Piece(0, ((0, 4),))], offload_ratio=0.5)]])
    sc = _scenario(gpus=1, model=MODELS["7b"].__class__("m4", 4, 64, 4, 4, 64))
    # per layer compute = 1e-6 * 16 + 1e-3 * 4 = 4.016e-3; fwd third 1.3387e-3, bwd 2.6773e-3
    # copy = 0.5 * Act(4) / B = 0.5 * 400 / 1000 = 0.2 s per offloaded layer, each direction
    per_layer = 4.016e-3
    fwd, bwd = per_layer / 3, per_layer * 2 / 3
    expected = 4 * per_layer + 2 * ((0.2 - fwd) + (0.2 - bwd))
    res = simulate_plan(plan, sc, cm)
    assert res.step_time_s == pytest.approx(expected)
    # a ratio that Eq. 3 hides costs nothing
    plan.ranks[0][0].offload_ratio = 1e-5  # copy 2e-4 s < fwd
    assert simulate_plan(plan, sc, cm).step_time_s == pytest.approx(4 * per_layer)


def test_step_adds_gradient_allreduce():
    sc = _scenario(grad_bytes_per_param=2)
    ar = allreduce_seconds(sc)
    # LLaMA-7B-shaped gradients (bf16) in a ring all-reduce over 3 ranks at 1 node-less link
    shard_bytes = MODELS["7b"].params_total * 2
    assert ar == pytest.approx(2 * 2 / 3 * shard_bytes / sc.bandwidth_inter)
    res = simulate_plan(_ring_plan(), sc, CM)
    assert res.step_time_s == pytest.approx(0.032 + ar)


def test_pipeline_step_uses_one_f_one_b():
    sc = _scenario(gpus=6, pipeline_degree=2, tensor_parallel=1)  # 3 pipelines of 2 stages
    plan = Plan(
        3,
        8,
        "hand",
        (4, 4, 4),
        [
            [MicroBatch([Piece(0, ((0, 4),))]), MicroBatch([Piece(1, ((0, 4),))])],
            [MicroBatch([Piece(2, ((0, 4),))])],
            [],
        ],
    )
    t = CM.local_time([4])  # whole model, fwd+bwd
    res = simulate_plan(plan, sc, CM)
    # two equal micro-batches on 2 stages: (m + p - 1) * t / p = 1.5 t
    assert res.finish[0] == pytest.approx(1.5 * t)
    assert res.finish[1] == pytest.approx(t)
    assert res.busy[0] == pytest.approx(t)


# ------------------------------------------------------------------------------ peers


def _random_batch(rng: random.Random, world: int, cap: int) -> list[int]:
    return [rng.choice([rng.randint(1, cap), rng.randint(1, cap * world)]) for _ in range(rng.randint(1, 40))]


@pytest.mark.parametrize("planner", ["megatron_dcp", "verl_kk"])
def test_peer_plans_are_valid(planner):
    rng = random.Random(7)
    for _ in range(25):
        world = rng.choice([1, 2, 4, 8, 16])
        cap = rng.choice([8, 16, 64])
        lengths = _random_batch(rng, world, cap)
        plan = make_plan(lengths, world_size=world, capacity=cap, planner=planner)
        assert plan.planner == planner
        plan.validate()
        # the simulator runs them
        res = simulate_plan(plan, _scenario(gpus=world, capacity=cap), CM)
        assert res.step_time_s > 0


def test_megatron_dcp_groups_and_barriers():
    assert [megatron_cp_size(x, 8) for x in (1, 8, 9, 17, 24, 33)] == [1, 1, 2, 4, 4, 8]
    plan = plan_megatron_dcp([40, 8, 8, 8, 8, 8, 8, 3], world_size=8, capacity=8).validate()
    rounds = plan.options["rounds"]
    for r, mbs in enumerate(plan.ranks):
        assert len(rounds[r]) == len(mbs)
        assert rounds[r] == sorted(set(rounds[r]))  # at most one micro-batch a round
        for mb in mbs:
            assert mb.ring is None or len(mb.ring) & (len(mb.ring) - 1) == 0  # powers of two
    # the 40-token sequence needs 8 ranks (next power of two of 5): round 0 is that ring alone
    assert all(rounds[r][0] == 0 and plan.ranks[r][0].ring == tuple(range(8)) for r in range(8))
    with pytest.raises(ValueError, match="power of two"):
        plan_megatron_dcp([40], world_size=6, capacity=8)


def test_verl_kk_equal_counts_static_groups():
    lengths = [30, 5, 5, 5, 20, 4, 3, 2, 9, 9]
    plan = plan_verl_kk(lengths, world_size=8, capacity=16, cp_size=2).validate()
    counts = {len(m) for m in plan.ranks}
    assert plan.options["cp_size"] == 2 and plan.options["dp_size"] == 4
    assert max(counts) == plan.options["micro_batches_per_rank"]
    for r, mbs in enumerate(plan.ranks):
        for mb in mbs:
            assert mb.ring == (r - r % 2, r - r % 2 + 1)  # fixed CP groups of consecutive ranks
    with pytest.raises(ValueError, match="divide world_size"):
        plan_verl_kk(lengths, world_size=8, capacity=16, cp_size=3)


def test_karmarkar_karp_balances():
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2)
    sums = sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts)
    assert sums == [14, 16]  # the textbook LDM result (optimum is 15/15)
    assert sorted(i for p in parts for i in p) == [0, 1, 2, 3, 4]


# ------------------------------------------------------------------------------ CLI and end to end


def test_cli_list_and_json_schema(capsys):
    assert main(["--list"]) == 0
    names = capsys.readouterr().out.split()
    for n in ("paper-7b-github-2m", "paper-70b-byted-256k", "paper-8x22b-github-1m", "tiny"):
        assert n in names
    assert main(["--scenario", "tiny", "--json", "--planners", "static,balance,megatron_dcp"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"scenario", "planners"}
    assert out["scenario"] == "tiny"
    assert set(out["planners"]) == {"static", "balance", "megatron_dcp"}
    for row in out["planners"].values():
        assert set(row) == set(SUMMARY_KEYS)
    assert out["planners"]["static"]["speedup_vs_static"] == pytest.approx(1.0)
    assert main(["--scenario", "nope"]) == 2
    assert main(["--scenario", "tiny", "--planners", "bogus"]) == 2


def test_tiny_scenario_end_to_end():
    res = run_scenario(SCENARIOS["tiny"], steps=1)["planners"]
    assert set(res) == set(SCENARIOS["tiny"].planners)
    for row in res.values():
        assert row["step_time_s"] > 0 and row["tokens_per_s"] > 0
        assert 0 <= row["bubble_fraction"] < 1 and row["max_over_mean"] >= 1
    assert res["balance"]["tokens_per_s"] >= res["static"]["tokens_per_s"]
    assert res["balance"]["max_over_mean"] <= res["naive"]["max_over_mean"] + 1e-9


def test_scenarios_are_consistent():
    paper = [n for n in SCENARIOS if n.startswith("paper-")]
    assert len(paper) == 6 * 2 * 4
    for name in paper:
        sc = SCENARIOS[name]
        sc.validate()
        costs.cost_model_for(sc)  # the shape gives a valid cost model
        assert sc.tokens_per_step == 32 * 1024 * 1024 and sc.capacity == 8192
        assert 1024 <= sc.gpus <= 16384
        assert costs.static_cp(sc) * sc.capacity >= sc.context_length


def test_peer_ring_pieces_match_zigzag():
    from lightning_bytescale.planner.peers import _ring_item
    from lightning_bytescale.planner.zigzag import member_ranges

    lengths = [1, 2, 5, 7, 16, 33, 100]
    for n in (2, 3, 4, 8, 64):
        mbs = _ring_item(lengths, list(range(len(lengths))), tuple(range(n)), 0)
        for m, mb in enumerate(mbs):
            for p in mb.pieces:
                assert list(p.ranges) == member_ranges(lengths[p.seq], n, m)


@pytest.mark.parametrize("variant", ["static", "naive", "balance", "balance_compute_only", "megatron_dcp"])
def test_planned_and_simulated_busy_agree(variant):
    """The simulator costs micro-batches with the planner's own model: per-rank busy == planned."""
    from lightning_bytescale.sim.run import draw_batch, make_variant_plan

    sc = SCENARIOS["tiny"].with_(capacity=4096, tokens_per_step=512 * 1024)
    cm = costs.cost_model_for(sc)
    plan = make_variant_plan(variant, draw_batch(sc, 0), sc, cm, 0)
    res = simulate_plan(plan, sc, cm)
    for r, mbs in enumerate(plan.ranks):
        assert res.busy[r] == pytest.approx(sum(mb.est_time for mb in mbs), rel=1e-9, abs=1e-12)
