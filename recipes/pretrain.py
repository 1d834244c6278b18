"""The pretrain recipe as a script: ``python recipes/pretrain.py [hydra overrides]``.

The same as the console script ``bytescale-train``; the configs are ``../conf`` (see
docs/recipes.md).  With no overrides it runs the CPU quickstart.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

import lightning_bytescale.conf  # noqa: F401  (registers the structured-config schemas)
from lightning_bytescale.recipes_entry import train


@hydra.main(version_base="1.3", config_path="../conf", config_name="pretrain")
def main(cfg: DictConfig) -> float | None:
    return train(cfg)


if __name__ == "__main__":
    main()
