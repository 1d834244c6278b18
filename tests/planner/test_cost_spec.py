"""``cost_model=``: names (a closed set, matched exactly) against files (must exist or end in .json)."""

from __future__ import annotations

import json
import os

import pytest

from lightning_bytescale.planner import distributions
from lightning_bytescale.planner.config import PlannerConfig
from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.cost_presets import slow_link_preset
from lightning_bytescale.planner.cost_spec import COST_MODEL_NAMES, is_auto, is_name, resolve_cost_model
from lightning_bytescale.planner.errors import CostModelSpecError, PlanError, PlannerConfigError
from lightning_bytescale.planner.planners import make_plan


def _file(path, cost: CostModel) -> str:
    path.write_text(json.dumps({"format": "bytescale-profile/1", "cost_model": cost.to_json_dict()}))
    return str(path)


def test_the_names_are_a_closed_set():
    assert COST_MODEL_NAMES == ("auto", "paper", "slow-link")
    assert is_auto("auto") and not is_auto("Auto") and not is_auto(None)
    assert all(is_name(n) for n in COST_MODEL_NAMES) and not is_name("paper.json")


def test_paper_is_todays_default_digest_for_digest():
    assert resolve_cost_model("paper") == CostModel.paper_preset()
    assert PlannerConfig(cost_model="paper").cost_model == CostModel.paper_preset()
    import random

    lengths = distributions.sample_global_batch(
        "github", tokens=200_000, context_length=32_768, rng=random.Random(1)
    )
    for planner in ("balance", "naive", "static"):
        default = make_plan(lengths, world_size=16, capacity=4096, planner=planner, seed=3)
        named = make_plan(lengths, world_size=16, capacity=4096, planner=planner, seed=3, cost_model="paper")
        assert named.digest() == default.digest(), planner


def test_slow_link_is_the_preset():
    assert resolve_cost_model("slow-link") == slow_link_preset()
    assert PlannerConfig(cost_model="slow-link").cost_model.bandwidth_inter == 12.5e9


def test_a_name_wins_over_a_file_of_that_name_and_dot_slash_reads_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mine = CostModel(a=1e-9, b=1e-6, name="mine")
    _file(tmp_path / "paper", mine)
    assert resolve_cost_model("paper") == CostModel.paper_preset()
    assert resolve_cost_model("./paper") == mine
    assert resolve_cost_model(tmp_path / "paper") == mine  # a PathLike is always a file


def test_a_file_without_json_suffix_is_read_when_it_exists(tmp_path):
    mine = CostModel(a=2e-9, b=1e-6, name="mine")
    assert resolve_cost_model(_file(tmp_path / "cost.profile", mine)) == mine
    assert PlannerConfig(cost_model=os.fspath(tmp_path / "cost.profile")).cost_model == mine


@pytest.mark.parametrize(
    ("spec", "closest"),
    [("papr", "paper"), ("Paper", "paper"), ("slow_link", "slow-link"), ("AUTO", "auto"), ("gpu-h100", None)],
)
def test_a_string_that_is_neither_lists_the_names_with_the_closest(spec, closest, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CostModelSpecError) as err:
        resolve_cost_model(spec)
    msg = str(err.value)
    assert f"cost_model {spec!r} is neither a cost model name nor an existing file" in msg
    assert "'auto', 'paper', 'slow-link' (matched exactly)" in msg and "must exist (or end in .json)" in msg
    assert (f"did you mean {closest!r}?" in msg) if closest else "did you mean" not in msg
    with pytest.raises(PlannerConfigError, match="neither a cost model name nor an existing file"):
        PlannerConfig(cost_model=spec)


def test_a_json_name_that_does_not_exist_is_a_missing_file(tmp_path):
    with pytest.raises(PlanError, match=r"cost_model file '.*nope.json' does not exist; write one with"):
        resolve_cost_model(str(tmp_path / "nope.json"))


def test_auto_names_the_torch_floor_function_that_resolves_it():
    with pytest.raises(CostModelSpecError, match=r"measured on the run's device at set-up.*auto_cost_model"):
        resolve_cost_model("auto")
    with pytest.raises(PlannerConfigError, match="auto_cost_model"):
        PlannerConfig(cost_model="auto")


def test_models_dicts_and_none_pass_through():
    cm = CostModel(a=1e-9, b=1e-6)
    assert resolve_cost_model(None) is None and resolve_cost_model(cm) is cm
    assert resolve_cost_model(cm.to_json_dict()) == cm
    with pytest.raises(
        CostModelSpecError, match="cost_model must be None, a CostModel, its dict or the path"
    ):
        resolve_cost_model(3)
