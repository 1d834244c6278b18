"""``bytescale-sim --cost-model``: a cluster simulation from a run's refined cost model."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_bytescale.cli.sim import main, read_cost_source
from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.cost_refit import CostRefit, Version
from lightning_bytescale.sim import costs
from lightning_bytescale.sim.run import run_scenario
from lightning_bytescale.sim.scenario import SCENARIOS


def _refined() -> tuple[CostRefit, CostModel]:
    """A saved refit whose newest version differs from its base (as after a run's refinement)."""
    base = costs.cost_model_for(SCENARIOS["tiny"])
    refit = CostRefit(base)
    newest = base.with_(a=base.a * 1.75, b=base.b * 0.5, g=3e-4)
    refit.versions.append(Version(5, 3, newest))
    refit.last_step = 3
    return refit, newest


def test_reads_the_newest_model_from_a_checkpoint_folder_and_telemetry(tmp_path):
    refit, newest = _refined()
    state = refit.state_dict()
    ckpt = tmp_path / "last.ckpt"  # what Lightning writes: the refinement's callback state among others
    torch.save({"state_dict": {"w": torch.zeros(2)}, "callbacks": {"CostRefinement": state}}, ckpt)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    torch.save({"callbacks": {"CostRefinement": state}}, sharded / "meta.pt")
    records = tmp_path / "metrics.jsonl"  # telemetry records, the last one holding the refit
    records.write_text(
        json.dumps({"step": 0, "cost_refit": CostRefit(refit.base).state_dict()})
        + "\n"
        + json.dumps({"step": 4, "cost_refit": state})
        + "\n"
    )
    for source in (ckpt, sharded, records):
        assert read_cost_source(str(source)) == newest, source
    with pytest.raises(ValueError, match="no such file"):
        read_cost_source(str(tmp_path / "missing.ckpt"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="meta.pt"):
        read_cost_source(str(empty))


def test_the_simulation_plans_and_charges_with_the_read_model(tmp_path, capsys):
    refit, newest = _refined()
    path = tmp_path / "refit.json"
    path.write_text(json.dumps(refit.state_dict()))
    assert main(["--scenario", "tiny", "--steps", "1", "--json", "--cost-model", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert CostModel.from_json_dict({k: v for k, v in out["cost_model"].items() if k != "source"}) == newest
    want = run_scenario(SCENARIOS["tiny"], steps=1, cost_model=newest)["planners"]
    default = run_scenario(SCENARIOS["tiny"], steps=1)["planners"]
    for name, row in out["planners"].items():
        assert row["step_time_s"] == pytest.approx(want[name]["step_time_s"], rel=1e-12)
    assert out["planners"]["balance"]["step_time_s"] != pytest.approx(
        default["balance"]["step_time_s"], rel=1e-3
    )
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"nothing": 1}))
    assert main(["--scenario", "tiny", "--cost-model", str(bad)]) == 2
    assert "found no cost model" in capsys.readouterr().err
