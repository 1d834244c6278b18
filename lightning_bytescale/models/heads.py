"""The attention heads a model declares, read from its config: what Ulysses splits over an item's members.

A cost model names the query and key/value heads of one tensor-parallel lane
(``CostModel.attention_heads`` / ``kv_heads``) so the planner knows where Ulysses and the hybrid
layout may run.  ``bytescale-profile`` records them from the model it measures, and the strategy
checks a cost model's heads against the model it trains before the first step: a cost model made
for another model would plan Ulysses items the model's heads cannot split, which the attention
refuses only when it runs.  The heads are read duck-typed from a ``config`` found on the model or
any of its submodules: the reference Llama's :class:`~lightning_bytescale.models.llama.LlamaConfig`
(``heads``, ``kv_heads``) or a Hugging Face config (``num_attention_heads``,
``num_key_value_heads``; a multimodal config's text config).
"""

from __future__ import annotations

from typing import Any

from torch import nn


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def config_heads(config: Any) -> tuple[int, int] | None:
    """``(query heads, key/value heads)`` of a model config, or ``None`` when it names none."""
    if config is None:
        return None
    heads = _count(getattr(config, "heads", None))
    if heads is not None:  # the reference Llama's LlamaConfig
        return heads, _count(getattr(config, "kv_heads", None)) or heads
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    heads = _count(getattr(text, "num_attention_heads", None))
    if heads is None:
        return None
    return heads, _count(getattr(text, "num_key_value_heads", None)) or heads


def model_heads(module: nn.Module) -> tuple[int, int] | None:
    """``(query heads, key/value heads)`` of the first ``config`` of ``module``'s tree that names them."""
    for m in module.modules():
        found = config_heads(getattr(m, "config", None))
        if found is not None:
            return found
    return None


def lane_heads(heads: int, kv_heads: int, tensor_parallel: int = 1) -> tuple[int, int]:
    """The heads one tensor-parallel lane holds: ``heads / tp`` query heads, ``kv_heads / tp`` key/value
    heads (at least one: tensor parallelism replicates a key/value head it cannot split)."""
    return heads // tensor_parallel, max(1, kv_heads // tensor_parallel)


__all__ = ["config_heads", "lane_heads", "model_heads"]
