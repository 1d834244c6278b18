"""The pretrain recipe as a script: ``python recipes/pretrain.py [hydra overrides]``.

The same as the console script ``bytescale-train``; the configs are ``lightning_bytescale/recipes/conf`` (see
docs/recipes.md).  With no overrides it runs the CPU quickstart.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

import lightning_bytescale.recipes.config  # noqa: F401  (registers the structured-config schemas)
from lightning_bytescale.cli.train import train


@hydra.main(version_base="1.3", config_path="pkg://lightning_bytescale.recipes.conf", config_name="pretrain")
def main(cfg: DictConfig) -> float | None:
    return train(cfg)


if __name__ == "__main__":
    main()
