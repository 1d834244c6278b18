"""The training recipes: the LightningModule they train, the Hydra schema and the YAML configs.

The YAML config groups ship inside the package (``lightning_bytescale/recipes/conf``), so
``bytescale-train`` works after a plain ``pip install``.  See ``docs/recipes.md``.
"""
