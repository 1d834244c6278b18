"""The training recipes: the LightningModule they train, the Hydra schema and the YAML configs.

The YAML config groups are the repository's ``conf/``, installed with the package as
``lightning_bytescale.recipes.conf``, so ``bytescale-train`` works after a plain ``pip install``.  See ``docs/recipes.md``.
"""

from __future__ import annotations

from lightning_bytescale._lazy import lazy_getattr, public_dir

# Public name -> its module, imported on first access (PEP 562), so importing one module of
# this package does not import the others.
_LAZY: dict[str, str] = {
    "PretrainModule": "lightning_bytescale.recipes.module",
    "compose_pretrain": "lightning_bytescale.recipes.config",
    "register_configs": "lightning_bytescale.recipes.config",
}

__all__ = sorted(_LAZY, key=str.lower)

__getattr__ = lazy_getattr(globals(), _LAZY)
__dir__ = public_dir(globals())
