"""The recipes' YAML config groups: the repository's ``conf/``, installed as the package
``lightning_bytescale.recipes.conf`` (``pyproject.toml``'s package-dir mapping), where Hydra finds
them as ``pkg://lightning_bytescale.recipes.conf``."""
