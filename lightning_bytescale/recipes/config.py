"""Hydra config plumbing for the recipes: schema registration, finding the configs, readable errors.

The YAML config groups live at the repository's top level (``conf/``) and ship in the wheel as
the package ``lightning_bytescale.recipes.conf`` (``pyproject.toml`` maps it to ``conf/``); they
are read through Hydra's package config source, ``pkg://lightning_bytescale.recipes.conf``, so
``bytescale-train`` works after any ``pip install`` (editable or not) from any folder.  ``BYTESCALE_CONF_DIR`` replaces them with a folder of your own;
Hydra's ``--config-dir`` adds a folder of new options (searched after them).  Importing this
module registers the structured-config schemas of :mod:`lightning_bytescale.recipes.schema` in
Hydra's ConfigStore.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path

from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_bytescale.errors import ConfigError  # a recipe config that does not compose
from lightning_bytescale.planner.registry import planner_names
from lightning_bytescale.recipes.schema import (
    ChatDataConfig,
    CSVLoggerConfig,
    DataConfig,
    FileDataConfig,
    HFModelConfig,
    ModelConfig,
    PretrainConfig,
    StrategyConfig,
    TelemetryConfig,
    TensorBoardLoggerConfig,
    TrainerConfig,
    WandbLoggerConfig,
)

__all__ = [
    "GROUPS",
    "ConfigError",
    "compose_pretrain",
    "config_source",
    "find_conf_dir",
    "register_configs",
]

PRIMARY = "pretrain"
GROUPS = ("strategy", "data", "model", "trainer", "logger", "experiment")
ENV_CONF_DIR = "BYTESCALE_CONF_DIR"
CONF_MODULE = "lightning_bytescale.recipes.conf"  # the packaged configs, as a module
PKG_SOURCE = f"pkg://{CONF_MODULE}"  # ... and as Hydra's config path


def _store_schemas() -> None:
    """``pretrain_schema`` and ``<group>/base_<group>`` in Hydra's ConfigStore."""
    cs = ConfigStore.instance()
    cs.store(name="pretrain_schema", node=PretrainConfig)
    cs.store(group="strategy", name="base_strategy", node=StrategyConfig)
    cs.store(group="data", name="base_data", node=DataConfig)
    cs.store(group="data", name="base_data_files", node=FileDataConfig)
    cs.store(group="data", name="base_data_chat", node=ChatDataConfig)
    cs.store(group="model", name="base_model", node=ModelConfig)
    cs.store(group="model", name="base_model_hf", node=HFModelConfig)
    cs.store(group="trainer", name="base_trainer", node=TrainerConfig)
    cs.store(group="logger", name="base_wandb", node=WandbLoggerConfig)
    cs.store(group="logger", name="base_csv", node=CSVLoggerConfig)
    cs.store(group="logger", name="base_tensorboard", node=TensorBoardLoggerConfig)
    cs.store(group="telemetry", name="base_telemetry", node=TelemetryConfig)


def _stdlib_path(subdir: str = "") -> str:
    """``${stdlib:json}``: a folder of Python's standard library (real text on every machine)."""
    return (
        os.path.join(sysconfig.get_paths()["stdlib"], subdir) if subdir else sysconfig.get_paths()["stdlib"]
    )


def _sample_path(name: str) -> str:
    """``${sample:chat.jsonl}``: a file of the package's chat sample (``lightning_bytescale/data/samples``)."""
    folder = Path(__file__).resolve().parents[1] / "data" / "samples"
    path = folder / name
    if not path.exists():
        raise ConfigError(
            f"${{sample:{name}}}: no file {name} in {folder} (files: {sorted(p.name for p in folder.iterdir())})"
        )
    return str(path)


def register_configs() -> None:
    """Store the schemas and the ``stdlib`` and ``sample`` resolvers (idempotent)."""
    _store_schemas()
    if not OmegaConf.has_resolver("stdlib"):
        OmegaConf.register_new_resolver("stdlib", _stdlib_path)
    if not OmegaConf.has_resolver("sample"):
        OmegaConf.register_new_resolver("sample", _sample_path)


register_configs()


def _user_conf_dir() -> Path | None:
    """``$BYTESCALE_CONF_DIR`` when set (checked: it must hold ``pretrain.yaml``), else None."""
    env = os.environ.get(ENV_CONF_DIR)
    if not env:
        return None
    path = Path(env).expanduser()
    if not (path / f"{PRIMARY}.yaml").is_file():
        raise ConfigError(
            f"{ENV_CONF_DIR}={env}: no {PRIMARY}.yaml in {path.resolve()}. Point {ENV_CONF_DIR} at a "
            f"complete config folder (a copy of the packaged one: {_packaged_conf_dir()}), or unset it "
            "to use the packaged configs; to add configs of your own beside the packaged ones, use "
            "`bytescale-train --config-dir /path/to/extra/conf` instead."
        )
    return path.resolve()


def _packaged_conf_dir() -> Path:
    """The folder of the packaged configs, found the way Hydra's ``pkg://`` source finds it."""
    return Path(str(files(CONF_MODULE)))


def find_conf_dir() -> Path:
    """The config folder in use: ``$BYTESCALE_CONF_DIR`` when set, else the packaged configs."""
    user = _user_conf_dir()
    if user is not None:
        return user
    path = _packaged_conf_dir()
    if not (path / f"{PRIMARY}.yaml").is_file():
        raise ConfigError(
            f"the packaged recipe configs are missing: no {PRIMARY}.yaml in {path}. The installed "
            "copy of lightning-bytescale is incomplete: reinstall it (`pip install --force-reinstall "
            f"--no-deps lightning-bytescale`, or `pip install .` from a checkout), or set "
            f"{ENV_CONF_DIR}=/path/to/conf to use a config folder of your own."
        )
    return path


def config_source() -> str:
    """Hydra's ``config_path`` for the recipes: ``$BYTESCALE_CONF_DIR`` when set, else
    ``pkg://lightning_bytescale.recipes.conf`` (checked to hold ``pretrain.yaml``)."""
    user = _user_conf_dir()
    if user is not None:
        return str(user)
    find_conf_dir()  # a clear error for an incomplete install, before Hydra's own
    return PKG_SOURCE


def explain(err: BaseException) -> str:
    """The whole cause chain of a Hydra/OmegaConf error as one readable message."""
    parts: list[str] = []
    seen: BaseException | None = err
    while seen is not None:
        text = str(seen).strip()
        if text and text not in parts and "$VALUE" not in text and not (text[0] == text[-1] == "'"):
            parts.append(text)
        seen = seen.__cause__ or seen.__context__
    return "\n".join(parts)


HINT = (
    "Check the spelling against `bytescale-train --cfg job` (prints the composed config), "
    "or the schemas in lightning_bytescale/recipes/schema.py; prefix a key with + to add one "
    "the schema does not know."
)


def check_planner(cfg: DictConfig) -> None:
    """``strategy.planner`` against the planner registry (the schema keeps it a plain string so
    that planners added with ``register_planner`` work from the recipes)."""
    name = OmegaConf.select(cfg, "strategy.planner", default=None)
    if name is None or name in planner_names():
        return
    raise ConfigError(
        f"invalid recipe config: strategy.planner={name!r} is not a registered planner; choose from "
        f"{', '.join(planner_names())} (or register one with lightning_bytescale.planner.register_planner "
        f"before composing)\n{HINT}"
    )


def compose_pretrain(
    overrides: Sequence[str] = (),
    conf_dir: str | os.PathLike[str] | None = None,
    *,
    hydra_config: bool = True,
) -> DictConfig:
    """Compose the recipe config the way ``bytescale-train`` does, outside ``@hydra.main``.

    The configs come from ``conf_dir`` when given, else from :func:`config_source` (the
    packaged ones, or ``$BYTESCALE_CONF_DIR``).  Raises `ConfigError` with the offending key,
    the reason and a hint.  With ``hydra_config`` the ``hydra`` node is included and registered,
    so ``${hydra:...}`` interpolations resolve.
    """
    source = str(Path(conf_dir).resolve()) if conf_dir is not None else config_source()
    if source == PKG_SOURCE:
        context = initialize_config_module(config_module=CONF_MODULE, version_base="1.3")
    else:
        context = initialize_config_dir(config_dir=source, version_base="1.3")
    with context:
        try:
            cfg = compose(PRIMARY, overrides=list(overrides), return_hydra_config=hydra_config)
        except (HydraException, OmegaConfBaseException) as err:
            raise ConfigError(f"invalid recipe config: {explain(err)}\n{HINT}") from err
        check_planner(cfg)
        if hydra_config:
            HydraConfig.instance().set_config(cfg)
    return cfg
