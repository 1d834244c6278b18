"""``balance`` without offload is never behind the peers (Megatron-DCP, plain LPT) on a fixed grid.

Deterministic and small (a few seconds): every shipped length distribution, two world sizes,
the paper cost model and the slow-link one, and a scaled-down copy of the LLaMA-70B pipeline
scenario where ``balance`` used to trail ``megatron_dcp``.  Step times come from the simulator
(:mod:`lightning_bytescale.sim.compare`), which charges the planners' own cost model.
"""

from __future__ import annotations

import pytest

from lightning_bytescale.planner import distributions
from lightning_bytescale.planner.cost_presets import PRESETS, get_preset, slow_link_preset
from lightning_bytescale.planner.errors import PlanError
from lightning_bytescale.sim.compare import Case, compare, compare_case
from lightning_bytescale.sim.scenario import SCENARIOS

PEERS = ("megatron_dcp", "lpt")


@pytest.mark.parametrize("cost", sorted(PRESETS))
@pytest.mark.parametrize("world", [8, 32])
@pytest.mark.parametrize("dist", distributions.SYNTHETIC)
def test_balance_is_level_with_or_ahead_of_both_peers(dist, world, cost):
    res = compare_case(Case(dist, world, cost, micro_batches_per_rank=4))
    bal = res["balance_no_offload"]["step_time_s"]
    print(
        f"\n{dist} {world} {cost}: balance {bal:.3f}s, "
        + ", ".join(f"{p} {res[p]['step_time_s']:.3f}s" for p in PEERS)
    )
    for p in PEERS:
        assert bal <= res[p]["step_time_s"] * (1 + 1e-9), p


def test_grown_rings_win_the_pipelined_70b_scenario():
    """paper-70b-github-2m at 1/8 scale: 32 pipelines of 4, 4M tokens, 256K context.

    ``D(s)`` rings leave each pipeline one long ring micro-batch that 1F1B pays almost fully;
    Megatron's doubled CP groups shorten it, and so do ``balance``'s grown rings.
    """
    sc = SCENARIOS["paper-70b-github-2m"].with_(
        gpus=1024, tokens_per_step=4 * 2**20, context_length=256 * 1024
    )
    planners = ("balance_no_offload", "balance_min_rings", *PEERS)
    res = {p: r["step_time_s"] for p, r in compare(sc, planners=planners).items()}
    print("\n70b/8 pp=4: " + ", ".join(f"{p} {t:.3f}s" for p, t in res.items()))
    assert res["balance_no_offload"] < res["balance_min_rings"]
    assert res["balance_no_offload"] <= min(res[p] for p in PEERS)


def test_slow_link_preset_is_the_paper_compute_on_slower_links():
    paper, slow = get_preset("paper"), slow_link_preset()
    assert (slow.a, slow.b, slow.g, slow.num_layers) == (paper.a, paper.b, paper.g, paper.num_layers)
    assert slow.bandwidth_intra < paper.bandwidth_intra and slow.bandwidth_inter < paper.bandwidth_inter
    # rings turn communication-bound at 2x the chunk between nodes and 3x inside one
    assert slow.crossover_length(64) == pytest.approx(2 * paper.crossover_length(64))
    assert slow.crossover_length(8, intra=True) == pytest.approx(3 * paper.crossover_length(8, intra=True))
    with pytest.raises(PlanError, match="unknown cost model preset 'fast'"):
        get_preset("fast")
