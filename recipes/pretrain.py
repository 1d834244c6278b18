"""The pretrain recipe as a script: ``python recipes/pretrain.py [hydra overrides]``.

The same command line as the console script ``bytescale-train`` (it calls its ``main``): the
configs are the packaged ones, ``pkg://lightning_bytescale.recipes.conf``, or
``$BYTESCALE_CONF_DIR`` when set (see docs/recipes.md).  With no overrides it runs the CPU
quickstart.
"""

from __future__ import annotations

from lightning_bytescale.cli.train import main

if __name__ == "__main__":
    main()
