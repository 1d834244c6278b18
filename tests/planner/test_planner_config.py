"""`PlannerConfig`: one frozen, documented set of planning options used by every entry point.

Typos fail naming the closest valid name from ``make_plan``, the strategy, the data module
and the Hydra recipe; a planner added with ``register_planner`` works through all of them;
values are validated once, with messages naming the cause and the fix; the Hydra schema's
planner fields are exactly ``PlannerConfig``'s.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
from pathlib import Path

import pytest

from lightning_bytescale.errors import ConfigError
from lightning_bytescale.planner import PlanError, PlannerConfig, make_plan, register_planner
from lightning_bytescale.planner import config as config_module
from lightning_bytescale.planner.cost_model import CostModel, OffloadConfig, load_cost_model
from lightning_bytescale.planner.errors import PlannerConfigError
from lightning_bytescale.planner.planners import plan_static
from lightning_bytescale.planner.registry import _REGISTRY, available_planners

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"


@pytest.fixture
def mine(tmp_path):
    """A planner registered as ``mine`` with an option of its own (``log``: a file it appends to)."""
    log = tmp_path / "mine.log"

    def plan_mine(lengths, *, world_size, capacity, cost_model, log=None, **kwargs):
        if log is not None:
            with open(log, "a") as f:
                f.write(f"{len(lengths)} {world_size} {capacity}\n")
        plan = plan_static(lengths, world_size=world_size, capacity=capacity, cost_model=cost_model, **kwargs)
        plan.planner = "mine"
        return plan

    register_planner("mine", plan_mine)
    try:
        yield log
    finally:
        _REGISTRY.pop("mine", None)


# ------------------------------------------------------------------------------ the dataclass
def test_frozen_with_defaults_and_every_field_documented():
    cfg = PlannerConfig()
    assert (cfg.planner, cfg.capacity, cfg.slack, cfg.seed, cfg.options) == ("balance", 8192, 0.05, None, {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.slack = 0.5  # type: ignore[misc]
    # litgpt style: a string literal right under every field
    tree = ast.parse(inspect.getsource(config_module))
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PlannerConfig"]
    documented, body = [], cls.body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign):
            nxt = body[i + 1] if i + 1 < len(body) else None
            doc = (
                nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) else None
            )
            assert isinstance(doc, str) and len(doc.split()) >= 5, f"field {node.target.id} has no docstring"
            documented.append(node.target.id)
    assert documented == [f.name for f in dataclasses.fields(PlannerConfig)]
    assert set(documented) >= {
        "planner", "capacity", "cp_size", "offload", "slack", "cost_model", "comm_aware",
        "ranks_per_node", "seed", "num_buckets", "pipeline_degree", "options",
    }  # fmt: skip


def test_the_planner_floor_imports_no_framework():
    tree = ast.parse(inspect.getsource(config_module))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in names if m.split(".")[0] in ("torch", "lightning", "hydra", "omegaconf")}
    assert {m for m in names if m.startswith("lightning_bytescale")} <= {
        "lightning_bytescale.planner.cost_model",
        "lightning_bytescale.planner.cost_spec",
        "lightning_bytescale.planner.errors",
        "lightning_bytescale.planner.modes",
        "lightning_bytescale.planner.registry",
    }


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"capacity": 1}, r"capacity must be >= 2, got 1: .*at least 2 tokens"),
        ({"capacity": 0}, r"capacity must be >= 2, got 0"),
        ({"capacity": 2.5}, r"capacity must be a number of tokens, got 2.5"),
        ({"slack": -0.1}, r"slack must be a finite number >= 0, got -0.1"),
        ({"slack": float("nan")}, r"slack must be a finite number >= 0"),
        ({"cp_size": 0}, r"cp_size must be a positive integer or None, got 0"),
        ({"ranks_per_node": 0}, r"ranks_per_node must be a positive integer or None, got 0"),
        ({"num_buckets": 0}, r"num_buckets must be >= 1, got 0"),
        ({"pipeline_degree": 0}, r"pipeline_degree must be >= 1, got 0"),
        ({"comm_aware": "no"}, r"comm_aware must be True or False, got 'no'"),
        ({"seed": "x"}, r"seed must be an integer or None, got 'x'"),
        ({"offload": "yes"}, r"offload must be None, True, False, an OffloadConfig or its dict"),
        ({"offload": {"layers": 4}}, r"offload .* is not an OffloadConfig dict .*layers_per_rank"),
        ({"cost_model": 3}, r"cost_model must be None, a CostModel, its dict or the path"),
        ({"cost_model": {"a": 1.0}}, r"cost_model: cost model dict lacks \['b'\]"),
        ({"cost_model": "missing.json"}, r"cost_model file 'missing.json' does not exist; write one with"),
    ],
)
def test_values_are_validated_naming_the_cause_and_the_fix(kwargs, match):
    with pytest.raises(PlannerConfigError, match=match) as err:
        PlannerConfig(**kwargs)
    assert isinstance(err.value, ConfigError) and isinstance(err.value, PlanError)


def test_an_unknown_planner_lists_the_registered_ones(mine):
    with pytest.raises(PlannerConfigError) as err:
        PlannerConfig(planner="balanse")
    msg = str(err.value)
    assert "unknown planner 'balanse'" in msg and "did you mean 'balance'?" in msg
    assert "static, naive, balance, megatron_dcp, verl_kk, lpt, " in msg  # built-ins first, then the others
    assert ", mine" in msg and "register_planner" in msg


def test_values_are_normalised(tmp_path):
    cost = CostModel.paper_preset().with_(name="from-file")
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"format": "bytescale-profile/1", "cost_model": cost.to_json_dict()}))
    cfg = PlannerConfig(cost_model=str(path), offload={"layers_per_rank": 4}, capacity=True + 63, slack=0)
    assert cfg.cost_model == cost and cfg.offload == OffloadConfig(layers_per_rank=4)
    assert cfg.capacity == 64 and isinstance(cfg.slack, float)
    assert PlannerConfig(cost_model=cost.to_json_dict()).cost_model == cost
    assert load_cost_model(path) == cost  # the profiler's file, read by the planner floor


def test_from_options_replace_and_as_options_round_trip():
    cfg = PlannerConfig.from_options(planner="balance", capacity=128, pp_reading="round_robin")
    assert cfg.options == {"pp_reading": "round_robin"}
    assert PlannerConfig.from_options(**cfg.as_options()) == cfg
    other = cfg.replace(slack=0.2, grow_rings=False)
    assert (other.slack, other.capacity, other.options) == (
        0.2,
        128,
        {"pp_reading": "round_robin", "grow_rings": False},
    )
    assert cfg.slack == 0.05  # unchanged: frozen
    with pytest.raises(PlannerConfigError, match="unknown planner option 'slak': did you mean 'slack'?"):
        cfg.replace(slak=0.5)
    with pytest.raises(PlannerConfigError, match="'slack' is a PlannerConfig field; pass slack=... itself"):
        PlannerConfig(options={"slack": 0.1})


# ------------------------------------------------------------------------------ typos everywhere
def test_make_plan_refuses_a_typo_naming_the_closest_name():
    with pytest.raises(PlannerConfigError, match=r"unknown planner option 'slak': did you mean 'slack'\?"):
        make_plan([5, 6], world_size=2, capacity=8, slak=0.5)
    with pytest.raises(PlanError, match=r"unknown planner option 'pp_raeding': did you mean 'pp_reading'\?"):
        make_plan([5, 6], world_size=2, capacity=8, pp_raeding="round_robin")
    # another planner's option is not a typo: one set of options drives several planners
    a = make_plan([5, 6, 30], world_size=2, capacity=16, planner="naive", pp_reading="round_robin", seed=1)
    b = make_plan([5, 6, 30], world_size=2, capacity=16, planner="naive", seed=1)
    assert a.digest() == b.digest()


def test_make_plan_takes_a_config_and_keyword_options_alike():
    lengths = [700, 40, 30, 300, 12, 90]
    cfg = PlannerConfig(capacity=128, seed=5, comm_aware=False)
    by_config = make_plan(lengths, world_size=8, config=cfg)
    by_keywords = make_plan(lengths, world_size=8, capacity=128, seed=5, comm_aware=False)
    assert by_config.digest() == by_keywords.digest()
    assert make_plan(lengths, world_size=8, config=cfg, seed=6).options["seed"] == 6
    with pytest.raises(PlanError, match="config must be a PlannerConfig or None, got dict"):
        make_plan(lengths, world_size=8, config={"capacity": 128})


def test_the_strategy_refuses_a_typo_naming_the_closest_name():
    from lightning_bytescale.lightning.strategy import ByteScaleStrategy

    with pytest.raises(ConfigError, match=r"unknown option\(s\) 'slak' \(did you mean 'slack'\?\)"):
        ByteScaleStrategy(slak=0.5)
    with pytest.raises(
        ConfigError, match=r"unknown planner option 'pp_raeding': did you mean 'pp_reading'\?"
    ):
        ByteScaleStrategy(options={"pp_raeding": "round_robin"})
    with pytest.raises(
        ConfigError, match=r"pipeline_degree=2 but pipeline_parallel_size=1.*pipeline_parallel_size=2"
    ):
        ByteScaleStrategy(pipeline_degree=2)
    s = ByteScaleStrategy(capacity=256, options={"pp_reading": "round_robin"})
    assert s.planner_config == PlannerConfig(
        capacity=256, offload=False, options={"pp_reading": "round_robin"}
    )
    assert s.planner_options() == s.planner_config.as_options() and s.capacity == 256


def test_the_strategy_takes_a_whole_config():
    from lightning_bytescale.lightning.strategy import ByteScaleStrategy

    cfg = PlannerConfig(planner="naive", capacity=64, seed=2)
    s = ByteScaleStrategy(planner=cfg)
    assert s.planner_config == cfg.replace(offload=False)  # the strategy offloads only when asked
    assert (s.planner, s.capacity, s.seed, s.offload) == ("naive", 64, 2, False)
    with pytest.raises(ConfigError, match=r"planner=PlannerConfig\(...\) and also capacity, slack"):
        ByteScaleStrategy(planner=cfg, capacity=128, slack=0.1)


def test_the_data_module_refuses_a_typo_naming_the_closest_name():
    from lightning_bytescale.data.errors import DataError
    from lightning_bytescale.lightning.datamodule import ByteScaleDataModule

    with pytest.raises(DataError, match=r"unknown planner option 'slak': did you mean 'slack'\?"):
        ByteScaleDataModule(planner_options={"slak": 0.5})
    with pytest.raises(DataError, match=r"unknown planner 'balanse'.*did you mean 'balance'\?"):
        ByteScaleDataModule(planner="balanse")
    dm = ByteScaleDataModule(planner_options={"num_buckets": 4}, slack=0.1, num_workers=0)
    assert dm.planner_config == PlannerConfig(capacity=4096, slack=0.1, num_buckets=4)
    base = PlannerConfig(planner="static", capacity=64, cp_size=2)
    dm = ByteScaleDataModule(planner_config=base, slack=0.2, num_workers=0)
    assert dm.planner_config == base.replace(slack=0.2)
    assert dm.planner_options() == {
        k: v for k, v in base.replace(slack=0.2).as_options().items() if v is not None and k != "seed"
    }


def test_the_recipe_refuses_a_typo_with_a_clear_message(tmp_path):
    from lightning_bytescale.cli.train import _before_launch_error, build
    from lightning_bytescale.recipes.config import compose_pretrain

    with pytest.raises(ConfigError) as err:  # Hydra's own schema check, at compose time
        compose_pretrain([f"run_dir={tmp_path}", "strategy.slak=0.5"], CONF)
    msg = str(err.value)
    assert "Key 'slak' not in 'StrategyConfig'" in msg and "strategy.slak" in msg
    assert "+strategy.slak" in msg and "--cfg job" in msg  # how to add a key / see the valid ones
    # forced in with +: the strategy names the closest option
    cfg = compose_pretrain([f"run_dir={tmp_path}", "+strategy.slak=0.5", "logger=csv"], CONF)
    with pytest.raises(Exception) as err:
        build(cfg)
    assert "did you mean 'slack'?" in (_before_launch_error(err.value) or "")
    # a planner's own option with a typo, given through strategy.options
    cfg = compose_pretrain(
        [f"run_dir={tmp_path}", "+strategy.options.pp_raeding=round_robin", "logger=csv"], CONF
    )
    with pytest.raises(Exception) as err:
        build(cfg)
    assert "unknown planner option 'pp_raeding': did you mean 'pp_reading'?" in (
        _before_launch_error(err.value) or ""
    )
    with pytest.raises(
        ConfigError, match=r"strategy.planner='fastest' is not a registered planner; choose from static"
    ):
        compose_pretrain([f"run_dir={tmp_path}", "strategy.planner=fastest"], CONF)


def test_the_schema_lists_exactly_the_config_fields():
    from lightning_bytescale.recipes.schema import PlannerSchema, StrategyConfig

    schema = [f.name for f in dataclasses.fields(PlannerSchema)]
    assert schema == [f.name for f in dataclasses.fields(PlannerConfig)]
    assert set(schema) <= {f.name for f in dataclasses.fields(StrategyConfig)}
    # the schema's defaults are valid PlannerConfig values (seed is the run's ${seed})
    defaults = {
        f.name: f.default for f in dataclasses.fields(PlannerSchema) if f.name not in ("seed", "options")
    }
    PlannerConfig(**defaults)
    # and the strategy takes every one of them by keyword
    from lightning_bytescale.lightning.strategy import ByteScaleStrategy

    assert set(schema) <= set(inspect.signature(ByteScaleStrategy.__init__).parameters)


# ------------------------------------------------------------------------------ a registered planner
def test_a_registered_planner_works_from_every_entry_point(mine, tmp_path):
    from types import SimpleNamespace

    from lightning_bytescale.cli.plan import main as plan_main
    from lightning_bytescale.lightning.datamodule import ByteScaleDataModule
    from lightning_bytescale.lightning.strategy import ByteScaleStrategy
    from lightning_bytescale.recipes.config import compose_pretrain

    assert "mine" in available_planners()
    with pytest.raises(PlannerConfigError, match=r"unknown planner option 'lgo': did you mean 'log'\?"):
        PlannerConfig(planner="mine", options={"lgo": 1})
    strategy = ByteScaleStrategy(planner="mine", capacity=64, options={"log": str(mine)})
    assert strategy.planner_config.planner == "mine"
    dm = ByteScaleDataModule(num_workers=0)
    dm.trainer = SimpleNamespace(global_rank=0, world_size=2, strategy=strategy)
    assert dm.planner_config is strategy.planner_config
    plan = make_plan([40, 30, 100], world_size=2, **dm.planner_options())
    assert plan.planner == "mine" and mine.read_text().splitlines() == ["3 2 64"]
    own = ByteScaleDataModule(planner="mine", capacity=32, num_workers=0, world_size=2)
    assert own.planner_config.planner == "mine" and own.pool_tokens() == 64
    cfg = compose_pretrain([f"run_dir={tmp_path}", "strategy.planner=mine"], CONF)
    assert cfg.strategy.planner == "mine"
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("5\n7\n20\n")
    assert plan_main(["--lengths", str(lengths), "--world-size", "2", "--capacity", "16", "--planner", "mine",
                      "--option", f"log={mine}"]) == 0  # fmt: skip
    assert mine.read_text().splitlines()[-1] == "3 2 16"


def test_a_registered_planner_trains_one_rank(mine, tmp_path):
    """A short 1-rank CPU fit: the strategy's data module plans every step with ``mine``."""
    import lightning.pytorch as pl
    import torch

    from lightning_bytescale.engine.loss import token_loss
    from lightning_bytescale.lightning.datamodule import ByteScaleDataModule
    from lightning_bytescale.lightning.strategy import ByteScaleStrategy

    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"doc{i}.txt").write_text(("planner config " * (3 + 4 * i))[: 20 + 9 * i])

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(257, 8)
            self.head = torch.nn.Linear(8, 257)

        def training_step(self, mb, batch_idx):
            return token_loss(self.head(self.emb(mb.input_ids)), mb.labels, mb.num_global_tokens)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    strategy = ByteScaleStrategy(
        planner="mine", capacity=64, options={"log": str(mine)}, start_method="fork", timeout=60,
        watchdog=False, preemption=False, check_attention=False,  # Tiny mixes no tokens: no attention
    )  # fmt: skip
    dm = ByteScaleDataModule(
        source=str(src), pattern="*.txt", cache_dir=tmp_path / "cache", tokens_per_step=120, context_length=64,
        num_workers=0,
    )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    os.environ.pop("MASTER_PORT", None)
    trainer.fit(Tiny(), datamodule=dm)
    calls = mine.read_text().splitlines()
    assert len(calls) >= 2 and all(c.endswith(" 1 64") for c in calls)


def test_data_module_planner_arguments_that_differ_are_refused(tmp_path):
    """Planner options have one door under the strategy: its ``planner_config``; the data module's own
    arguments must agree with it, or the run stops before any rank starts, naming both values."""
    import lightning.pytorch as pl

    from lightning_bytescale.errors import PlannerOptionsConflictError
    from lightning_bytescale.lightning.datamodule import ByteScaleDataModule
    from lightning_bytescale.lightning.strategy import ByteScaleStrategy

    strategy = ByteScaleStrategy(capacity=8192, start_method="fork", timeout=30)
    source = {"kind": "synthetic", "name": "github", "num_samples": 40, "scale": 1 / 256}
    dm = ByteScaleDataModule(source=source, capacity=512, planner="static", cache_dir=tmp_path, num_workers=0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path,
    )  # fmt: skip

    class Nothing(pl.LightningModule):
        def training_step(self, mb, batch_idx):
            raise AssertionError("no step may run")

    os.environ.pop("MASTER_PORT", None)
    with pytest.raises(PlannerOptionsConflictError) as info:
        trainer.fit(Nothing(), datamodule=dm)
    message = str(info.value)
    assert "capacity=512" in message and "capacity=8192" in message and "planner='static'" in message
    assert "planner='balance'" in message and "ByteScaleStrategy(" in message
    assert not list(tmp_path.glob("store-*"))  # refused before anything was built or launched
    # the data module's planner_config under the strategy: refused too (one rank, a trainer stand-in)
    from types import SimpleNamespace

    dm.trainer = SimpleNamespace(global_rank=0, world_size=2, strategy=strategy)
    with pytest.raises(PlannerOptionsConflictError):
        dm.planner_config  # noqa: B018
    # the same values, or none, plan with the strategy's config
    same = ByteScaleDataModule(capacity=8192, planner="balance", num_workers=0)
    same.trainer = dm.trainer
    assert same.planner_config is strategy.planner_config
    silent = ByteScaleDataModule(num_workers=0)
    silent.trainer = dm.trainer
    assert silent.planner_config is strategy.planner_config
