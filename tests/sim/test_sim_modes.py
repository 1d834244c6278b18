"""The simulator with attention modes: each item charged by its mode, exposed communication per mode."""

from __future__ import annotations

import pytest

from lightning_bytescale.cli.sim import main
from lightning_bytescale.sim import costs
from lightning_bytescale.sim.run import draw_batch, make_variant_plan, run_scenario, simulate_plan
from lightning_bytescale.sim.scenario import SCENARIOS

# 64 ranks on 8 nodes, MagiAttention's long documents at 512K: long sequences gain from groups wider
# than a ring between nodes could use without turning communication-bound
SC = SCENARIOS["tiny"].with_(
    name="magi-64", gpus=64, tokens_per_step=64 * 8192 * 4, context_length=512 * 1024, dataset="magi_long"
)


def test_each_item_costs_what_its_mode_costs_and_exposure_is_kept_per_mode():
    cm = costs.cost_model_for(SC)
    assert (cm.attention_heads, cm.kv_heads) == (32, 8)  # LLaMA-7B, one GPU a rank
    lengths = draw_batch(SC, 0)
    plan = make_variant_plan("balance_modes", lengths, SC, cm, 0)
    res = simulate_plan(plan, SC, cm)
    counts = plan.mode_stats()["mode_counts"]
    assert counts["hybrid"] > 0 and res.mode_counts == counts
    for r, mbs in enumerate(plan.ranks):  # the simulator charges the planner's own estimates
        assert res.busy[r] == pytest.approx(sum(mb.est_time for mb in mbs), rel=1e-9, abs=1e-12)
    exposed = {m: 0.0 for m in ("ring", "ulysses", "hybrid")}
    for mbs in plan.ranks:
        for mb in mbs:
            exposed[mb.mode] += mb.exposed_time
    for mode, seconds in exposed.items():
        assert res.exposed_comm_by_mode.get(mode, 0.0) == pytest.approx(seconds, rel=1e-9, abs=1e-12)
    assert sum(res.exposed_comm_by_mode.values()) == pytest.approx(res.exposed_comm_s)
    assert res.ring_bytes == pytest.approx(plan.stats()["ring_bytes"])
    ring = simulate_plan(make_variant_plan("balance", lengths, SC, cm, 0), SC, cm)
    assert set(ring.exposed_comm_by_mode) <= {"ring"} and ring.mode_counts["hybrid"] == 0
    assert res.step_time_s < ring.step_time_s


def test_summary_and_command_line_show_modes(capsys, monkeypatch):
    out = run_scenario(SC, planners=["balance", "balance_modes"])["planners"]
    assert out["balance_modes"]["mode_counts"]["hybrid"] > 0 and out["balance"]["mode_counts"]["hybrid"] == 0
    assert out["balance_modes"]["step_time_s"] < out["balance"]["step_time_s"]
    assert "hybrid" in out["balance_modes"]["exposed_comm_by_mode"]
    monkeypatch.setitem(SCENARIOS, SC.name, SC)
    assert main(["--scenario", SC.name, "--planners", "balance,balance_modes"]) == 0
    table = capsys.readouterr().out
    assert "items (exposed)" in table and "hybrid" in table.splitlines()[4]
