"""Hydra config plumbing for the recipes: schema registration, finding ``conf/``, readable errors.

The YAML config groups live in the repository's top-level ``conf/`` folder (an editable
install, ``pip install -e .``, is what the README uses); ``BYTESCALE_CONF_DIR`` points
elsewhere.  Importing this module registers the structured-config schemas of
:mod:`lightning_bytescale.recipes.schema` in Hydra's ConfigStore.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from lightning_bytescale.errors import ConfigError  # a recipe config that does not compose
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
    "find_conf_dir",
    "register_configs",
]

PRIMARY = "pretrain"
GROUPS = ("strategy", "data", "model", "trainer", "logger", "experiment")
ENV_CONF_DIR = "BYTESCALE_CONF_DIR"


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
    import sysconfig

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


def find_conf_dir() -> Path:
    """The ``conf/`` folder: ``$BYTESCALE_CONF_DIR``, else the checkout this package lives in."""
    env = os.environ.get(ENV_CONF_DIR)
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parent / "conf")
    for path in candidates:
        if (path / f"{PRIMARY}.yaml").is_file():
            return path.resolve()
    raise ConfigError(
        f"cannot find the recipe configs ({PRIMARY}.yaml) in {[str(p) for p in candidates]}. "
        "The configs live in the repository's conf/ folder: install the package editable from a "
        "checkout (`pip install -e .`), or set BYTESCALE_CONF_DIR=/path/to/lightning-bytescale/conf."
    )


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


def compose_pretrain(
    overrides: Sequence[str] = (),
    conf_dir: str | os.PathLike[str] | None = None,
    *,
    hydra_config: bool = True,
) -> DictConfig:
    """Compose the recipe config the way ``bytescale-train`` does, outside ``@hydra.main``.

    Raises `ConfigError` with the offending key, the reason and a hint.  With ``hydra_config``
    the ``hydra`` node is included and registered, so ``${hydra:...}`` interpolations resolve.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    directory = Path(conf_dir) if conf_dir is not None else find_conf_dir()
    with initialize_config_dir(config_dir=str(Path(directory).resolve()), version_base="1.3"):
        try:
            cfg = compose(PRIMARY, overrides=list(overrides), return_hydra_config=hydra_config)
        except (HydraException, OmegaConfBaseException) as err:
            raise ConfigError(f"invalid recipe config: {explain(err)}\n{HINT}") from err
        if hydra_config:
            HydraConfig.instance().set_config(cfg)
    return cfg
