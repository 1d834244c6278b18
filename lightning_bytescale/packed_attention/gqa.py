"""Grouped-query attention: key/value heads shared by groups of query heads.

Query head ``h`` reads key/value head ``h // (H // Hkv)``, as
``scaled_dot_product_attention(enable_gqa=True)`` does.  Kernels without native GQA expand the
key/value heads and sum their gradients back with these two functions.
"""

from __future__ import annotations

import torch


def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[T, Hkv, D]`` -> ``[T, Hkv * groups, D]``, each key/value head repeated for its query heads."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def reduce_kv(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`expand_kv`: sum each key/value head's query-head group."""
    if groups == 1:
        return dx
    t, h, d = dx.shape
    return dx.reshape(t, h // groups, groups, d).sum(dim=2)
