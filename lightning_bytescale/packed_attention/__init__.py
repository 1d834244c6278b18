"""Packed causal attention: local variable-length attention and zigzag ring attention.

A model calls :func:`attention`; the engine sets the micro-batch's layout with
:func:`attention_context`.  Local micro-batches run varlen attention with no communication;
sharded ones run zigzag ring attention over P2P on the global process group.
:func:`loopback_ring_attention` runs all members of a ring in one process (tests, one-GPU checks).

The package itself is callable, so ``lightning_bytescale.attention(q, k, v)`` and
``from lightning_bytescale.packed_attention import attention`` are the same function.
"""

import sys
import types

from lightning_bytescale.packed_attention.api import AttentionShapeError, attention
from lightning_bytescale.packed_attention.comm import comm_stats, reset_comm_stats
from lightning_bytescale.packed_attention.context import attention_context, current_layout
from lightning_bytescale.packed_attention.kernels import select_kernel
from lightning_bytescale.packed_attention.layout import AttentionLayout
from lightning_bytescale.packed_attention.loopback import loopback_ring_attention
from lightning_bytescale.packed_attention.ring import RingLayoutError, ring_attention, set_overlap

__all__ = [
    "AttentionLayout",
    "AttentionShapeError",
    "RingLayoutError",
    "attention",
    "attention_context",
    "comm_stats",
    "current_layout",
    "loopback_ring_attention",
    "reset_comm_stats",
    "ring_attention",
    "select_kernel",
    "set_overlap",
]


class _CallableModule(types.ModuleType):
    """``lightning_bytescale.packed_attention`` is both this package and the public function."""

    def __call__(self, q, k, v, *, scale=None):
        return attention(q, k, v, scale=scale)


sys.modules[__name__].__class__ = _CallableModule
