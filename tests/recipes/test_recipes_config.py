"""Hydra configs of the recipes: every group option and preset composes and instantiates, and a
malformed config fails at compose time with a message naming the key, the reason and a fix."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_bytescale.recipes.config import (
    GROUPS,
    ConfigError,
    compose_pretrain,
    config_source,
    find_conf_dir,
)

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"
GPU_TRAINERS = {"gpu"}


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _compose(tmp_path, *overrides: str):
    return compose_pretrain([f"run_dir={tmp_path}", *overrides], CONF)


def _plain(node):
    return OmegaConf.to_container(node, resolve=True, enum_to_str=True)


def test_conf_dir_is_the_packaged_one(monkeypatch):
    monkeypatch.delenv("BYTESCALE_CONF_DIR", raising=False)
    assert find_conf_dir() == CONF.resolve()
    assert config_source() == "pkg://lightning_bytescale.recipes.conf"
    assert set(GROUPS) <= {p.name for p in CONF.iterdir() if p.is_dir()}
    for group in GROUPS:
        assert _options(group), f"conf/{group} has no options"


def test_default_is_the_cpu_quickstart(tmp_path):
    cfg = _compose(tmp_path)
    assert cfg.name == "cpu_quickstart"
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.devices == 2
    assert cfg.logger._target_.endswith("WandbRunLogger") and cfg.logger.offline is None
    assert cfg.data.source is None  # Python's stdlib sources
    assert cfg.strategy.planner == "balance"


@pytest.mark.parametrize("group", ["strategy", "data", "model", "trainer", "logger"])
def test_every_group_option_composes_and_instantiates(tmp_path, group):
    for option in _options(group):
        overrides = [f"{group}={option}"]
        if group == "data" and option in ("text", "jsonl"):
            overrides.append(f"data.source={tmp_path}")  # these need a path
        if group == "data" and option == "chat":  # records and a tokenizer: the package's sample
            overrides += ["data.source.path=${sample:chat.jsonl}", "data.tokenizer=${sample:tokenizer.json}"]
        if group == "model" and option == "hf":  # a model to build (no download)
            overrides += ["model.name_or_path=llama", "model.from_config=true"]
        cfg = _compose(tmp_path, *overrides)
        node = _plain(cfg[group])
        assert node["_target_"], option
        if group == "trainer" and option in GPU_TRAINERS:
            continue  # a GPU Trainer cannot be built on a CPU-only machine
        if group == "trainer":
            obj = instantiate(node, strategy="auto", logger=False, devices=1)
        else:
            obj = instantiate(node)
        assert type(obj).__name__ == node["_target_"].rsplit(".", 1)[1], option


@pytest.mark.parametrize("experiment", _options("experiment"))
def test_every_experiment_composes(tmp_path, experiment):
    from lightning_bytescale.cli.train import build

    cfg = _compose(tmp_path, f"experiment={experiment}")
    assert cfg.name == experiment
    strategy = instantiate(_plain(cfg.strategy))
    model = instantiate(_plain(cfg.model))  # builds the LlamaConfig only; weights come at fit
    assert strategy.planner in ("static", "naive", "balance")
    if experiment.startswith("paper_7b"):
        assert model.config.dim == 4096 and model.config.layers == 32  # LLaMA-7B shape
        assert cfg.strategy.capacity == 8192  # C = 8K
        assert cfg.data.tokens_per_step == 32 * 2**20  # 32M tokens a step
        assert cfg.data.context_length >= 256 * 1024
        assert cfg.trainer.accelerator == "gpu"
    else:
        parts = build(cfg)  # the whole recipe short of fit, Trainer included
        assert parts["trainer"].strategy is parts["strategy"]
        if experiment.startswith("hf_"):  # a Hugging Face model built from its config
            assert parts["model"].source.config_overrides["vocab_size"] == parts["datamodule"].vocab_size
        else:
            assert parts["model"].config.vocab == 257  # from the byte tokenizer


def test_paper_presets_span_256k_to_2m(tmp_path):
    contexts = sorted(
        _compose(tmp_path, f"experiment={e}").data.context_length
        for e in _options("experiment")
        if e.startswith("paper_")
    )
    assert contexts == [256 * 1024, 512 * 1024, 1024 * 1024, 2048 * 1024]


def test_sweep_preset_uses_spawn_and_all_planners(tmp_path):
    cfg = _compose(tmp_path, "experiment=compare_planners")
    assert cfg.strategy.start_method.value == "spawn"
    assert cfg.hydra.mode.name == "MULTIRUN"
    assert cfg.hydra.sweeper.params["strategy.planner"] == "static,naive,balance"


def test_overrides_reach_the_strategy_and_trainer(tmp_path):
    cfg = _compose(
        tmp_path, "strategy.planner=static", "strategy.cp_size=4", "trainer.devices=4", "logger=csv",
        "strategy.refine_cost_model=false",
    )  # fmt: skip
    strategy = instantiate(_plain(cfg.strategy))
    assert (strategy.planner, strategy.cp_size, strategy.refine_cost_model) == ("static", 4, False)
    assert cfg.trainer.devices == 4 and cfg.logger._target_.endswith("CSVLogger")


def test_wandb_offline_follows_the_api_key(tmp_path, monkeypatch):
    from lightning_bytescale.cli.train import _prepare

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    cfg = _compose(tmp_path)
    _prepare(cfg)
    assert cfg.logger.offline is True
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    cfg = _compose(tmp_path)
    _prepare(cfg)
    assert cfg.logger.offline is False
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "y" * 40 + "\n")
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    cfg = _compose(tmp_path)
    _prepare(cfg)
    assert cfg.logger.offline is False
    cfg = _compose(tmp_path, "logger.offline=true")  # an explicit choice wins
    _prepare(cfg)
    assert cfg.logger.offline is True


# -- malformed configs ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("strategy.plannr=static", ["plannr", "StrategyConfig", "+strategy.plannr"]),
        ("strategy.cp_size=four", ["strategy.cp_size", "four", "Integer"]),
        ("strategy.planner=fastest", ["strategy.planner", "static, naive, balance"]),
        ("trainer.max_steps=1.5", ["trainer.max_steps", "Integer"]),
        ("data.long_document_policy=cut", ["data.long_document_policy", "split"]),
        ("model=gigantic", ["model/gigantic", "Available options", "7b"]),
        ("seeed=1", ["seeed", "PretrainConfig"]),
    ],
)
def test_malformed_override_is_a_readable_error(tmp_path, override, needles):
    with pytest.raises(ConfigError) as info:
        _compose(tmp_path, override)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    assert "--cfg job" in message  # the fix: how to see the valid keys


def test_malformed_preset_file_is_a_readable_error(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "experiment" / "typo.yaml").write_text("# @package _global_\nstrategy:\n  capasity: 4096\n")
    (conf / "experiment" / "badtype.yaml").write_text("# @package _global_\ntrainer:\n  max_steps: lots\n")
    with pytest.raises(ConfigError, match=r"(?s)experiment/typo.*capasity.*StrategyConfig"):
        compose_pretrain(["experiment=typo"], conf)
    with pytest.raises(ConfigError, match=r"(?s)max_steps.*lots"):
        compose_pretrain(["experiment=badtype"], conf)


def test_compose_reads_the_packaged_configs_through_hydras_package_source(tmp_path, monkeypatch):
    monkeypatch.delenv("BYTESCALE_CONF_DIR", raising=False)
    cfg = compose_pretrain([f"run_dir={tmp_path}"])
    main = [s for s in cfg.hydra.runtime.config_sources if s.provider == "main"]
    assert [(s.schema, s.path) for s in main] == [("pkg", "lightning_bytescale.recipes.conf")]
    assert cfg.name == "cpu_quickstart"


def _own_conf(tmp_path) -> Path:
    """A copy of the packaged configs with one experiment of its own."""
    conf = tmp_path / "my_conf"
    shutil.copytree(CONF, conf, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    (conf / "experiment" / "mine.yaml").write_text("# @package _global_\nname: mine\n")
    return conf


def test_bytescale_conf_dir_replaces_the_packaged_configs(tmp_path, monkeypatch):
    conf = _own_conf(tmp_path)
    monkeypatch.setenv("BYTESCALE_CONF_DIR", str(conf))
    assert find_conf_dir() == conf.resolve() and config_source() == str(conf.resolve())
    cfg = compose_pretrain([f"run_dir={tmp_path}", "experiment=mine"])
    assert cfg.name == "mine"
    main = [s for s in cfg.hydra.runtime.config_sources if s.provider == "main"]
    assert [(s.schema, s.path) for s in main] == [("file", str(conf.resolve()))]


def test_a_conf_dir_without_pretrain_yaml_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("BYTESCALE_CONF_DIR", str(tmp_path))
    with pytest.raises(ConfigError) as info:
        find_conf_dir()
    message = str(info.value)
    for needle in ("BYTESCALE_CONF_DIR", str(tmp_path), "pretrain.yaml", str(CONF), "--config-dir"):
        assert needle in message, message
    assert "pip install -e" not in message and "editable" not in message


def test_an_install_without_its_configs_says_how_to_fix(tmp_path, monkeypatch):
    import lightning_bytescale.recipes.config as conf_mod

    monkeypatch.delenv("BYTESCALE_CONF_DIR", raising=False)
    monkeypatch.setattr(conf_mod, "_packaged_conf_dir", lambda: tmp_path)
    with pytest.raises(ConfigError) as info:
        config_source()
    message = str(info.value)
    for needle in (str(tmp_path), "reinstall", "BYTESCALE_CONF_DIR"):
        assert needle in message, message
    assert "pip install -e" not in message and "editable" not in message


@pytest.mark.parametrize("how", ["BYTESCALE_CONF_DIR", "--config-dir"])
def test_command_line_uses_a_config_folder_of_your_own(tmp_path, how):
    """``--config-dir`` adds a folder of new options to the packaged configs; the variable replaces them."""
    conf = _own_conf(tmp_path)
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    args = ["experiment=mine", "--cfg", "job"]
    if how == "--config-dir":
        extra = tmp_path / "extra"
        (extra / "experiment").mkdir(parents=True)
        shutil.copy2(conf / "experiment" / "mine.yaml", extra / "experiment" / "mine.yaml")
        args = ["--config-dir", str(extra), *args]
        env.pop("BYTESCALE_CONF_DIR", None)
    else:
        env["BYTESCALE_CONF_DIR"] = str(conf)
    proc = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "pretrain.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "name: mine" in proc.stdout, proc.stdout


def test_command_line_rejects_a_malformed_config_fast():
    """``python recipes/pretrain.py`` (the script form of ``bytescale-train``) stops at compose time."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "recipes" / "pretrain.py"),
            "strategy.plannr=static",
            "hydra.run.dir=/tmp/never",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    # the key meant, the first time (Hydra's own hint, +strategy.plannr, would add the typo)
    assert "strategy.plannr is not a key of the strategy config (StrategyConfig)" in proc.stderr, proc.stderr
    assert "did you mean strategy.planner? (strategy.planner=static)" in proc.stderr, proc.stderr
    assert "+strategy.plannr" not in proc.stderr
    assert not Path("/tmp/never").exists()  # nothing ran


def test_a_value_the_target_rejects_names_the_key_and_the_reason(tmp_path):
    from hydra.errors import InstantiationException

    from lightning_bytescale.cli.train import build

    cfg = _compose(tmp_path, "experiment=cpu_smoke", "strategy.capacity=0", "logger=csv")
    with pytest.raises(
        InstantiationException, match=r"(?s)ByteScaleStrategy.*capacity must be at least 2 tokens"
    ):
        build(cfg)


@pytest.mark.parametrize("group", ["text", "jsonl"])
def test_file_data_without_a_source_is_refused(tmp_path, group):
    from omegaconf.errors import MissingMandatoryValue

    from lightning_bytescale.cli.train import build

    cfg = _compose(tmp_path, f"data={group}", "logger=csv")
    with pytest.raises(MissingMandatoryValue, match=r"(?s)Missing mandatory value: source.*data\.source"):
        build(cfg)


def test_a_sweep_never_uses_the_popen_launcher(tmp_path):
    from lightning_bytescale.cli.train import _prepare

    cfg = _compose(tmp_path, "hydra.mode=MULTIRUN")  # compose_pretrain registers cfg.hydra as the live one
    assert cfg.strategy.start_method.value == "popen"
    _prepare(cfg)
    assert cfg.strategy.start_method.value == "spawn"
    assert cfg.logger.group == "cpu_quickstart" and cfg.logger.name.startswith(
        "cpu_quickstart/"
    )  # W&B run per job
    cfg = _compose(tmp_path, "hydra.mode=MULTIRUN", "trainer.devices=1")
    _prepare(cfg)
    assert cfg.strategy.start_method.value == "popen"  # one process: nothing is launched
    cfg = _compose(tmp_path)
    _prepare(cfg)
    assert cfg.strategy.start_method.value == "popen"  # single runs keep popen
    assert cfg.logger.name == "cpu_quickstart" and cfg.logger.group is None
