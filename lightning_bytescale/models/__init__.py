"""Reference models written for packed (THD) input and the plugin's attention."""

from lightning_bytescale.models.llama import LlamaConfig, LlamaModel

__all__ = ["LlamaConfig", "LlamaModel"]
