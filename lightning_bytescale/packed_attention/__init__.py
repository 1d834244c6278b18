"""Packed causal attention: local variable-length attention, zigzag ring attention and Ulysses attention.

A model calls :func:`attention`; the engine sets the micro-batch's layout with
:func:`attention_context`.  Local micro-batches run varlen attention with no communication;
sharded ones run zigzag ring attention, or Ulysses attention (heads split over the ring's
members by an all-to-all; the layout's ``mode``), over P2P on the global process group.
:func:`loopback_ring_attention` runs all members of a ring in one process (tests, one-GPU checks).

:func:`count_attention_calls` counts the :func:`attention` calls of a forward (the strategy's
attention check of the first steps, the Hugging Face model's per-layer check).

``lightning_bytescale.attention`` is this package's :func:`attention` (the same function
object), so a model can import it from either place.
"""

from lightning_bytescale.packed_attention.api import AttentionShapeError, attention
from lightning_bytescale.packed_attention.calls import AttentionCalls, count_attention_calls
from lightning_bytescale.packed_attention.comm import comm_stats, reset_comm_stats
from lightning_bytescale.packed_attention.context import attention_context, current_layout
from lightning_bytescale.packed_attention.input_dtype import AttentionDtypeError
from lightning_bytescale.packed_attention.kernels import select_kernel
from lightning_bytescale.packed_attention.layout import AttentionLayout, AttentionModeError
from lightning_bytescale.packed_attention.loopback import LoopbackError, loopback_ring_attention
from lightning_bytescale.packed_attention.ring import RingLayoutError, ring_attention, set_overlap
from lightning_bytescale.packed_attention.ulysses import UlyssesHeadsError, ulysses_attention

__all__ = [
    "AttentionCalls",
    "AttentionDtypeError",
    "AttentionLayout",
    "AttentionModeError",
    "AttentionShapeError",
    "LoopbackError",
    "RingLayoutError",
    "UlyssesHeadsError",
    "attention",
    "attention_context",
    "comm_stats",
    "count_attention_calls",
    "current_layout",
    "loopback_ring_attention",
    "reset_comm_stats",
    "ring_attention",
    "select_kernel",
    "set_overlap",
    "ulysses_attention",
]
