"""The one attention function a model calls: local varlen, zigzag ring or Ulysses, chosen by the layout."""

from __future__ import annotations

import torch

from lightning_bytescale.errors import ByteScaleError
from lightning_bytescale.packed_attention.calls import record_attention_call
from lightning_bytescale.packed_attention.context import current_scope
from lightning_bytescale.packed_attention.input_dtype import kernel_inputs
from lightning_bytescale.packed_attention.local import varlen_attention
from lightning_bytescale.packed_attention.ring import ring_attention
from lightning_bytescale.packed_attention.ulysses import ulysses_attention


class AttentionShapeError(ByteScaleError, ValueError):
    """The q/k/v tensors do not have packed ``[T, H, D]`` / ``[T, Hkv, D]`` shapes that fit together."""


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise AttentionShapeError(
            f"attention expects packed [T, H, D] tensors, got q{tuple(q.shape)} k{tuple(k.shape)} "
            f"v{tuple(v.shape)}; flatten batch and sequence into T and pass the layout via attention_context"
        )
    if k.shape != v.shape:
        raise AttentionShapeError(f"k{tuple(k.shape)} and v{tuple(v.shape)} must have the same shape")
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise AttentionShapeError(
            f"q{tuple(q.shape)} and k{tuple(k.shape)} must agree on tokens T and head size D"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise AttentionShapeError(
            f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads (GQA needs Hkv | H)"
        )


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None
) -> torch.Tensor:
    """Causal attention on packed tokens: ``q [T, H, D]``, ``k, v [T, Hkv, D]`` -> ``[T, H, D]``.

    Inside :func:`attention_context`, attention is causal within each sequence of the
    current layout; a sharded layout runs zigzag ring attention with the ring's other
    members, or Ulysses attention (heads split over them by an all-to-all) when its ``mode``
    says so (:mod:`.ulysses`).  Outside any context, the ``T`` tokens are one causal sequence.  ``scale``
    defaults to ``D ** -0.5``.  Under ``torch.autocast`` q, k and v are cast to the autocast
    dtype first, as ``scaled_dot_product_attention`` does (:mod:`.input_dtype`); outside it they
    must share one dtype (:class:`~.input_dtype.AttentionDtypeError`).  Each call is counted
    inside :func:`~.calls.count_attention_calls` (the strategy's attention check of the first steps).
    """
    _check_shapes(q, k, v)
    record_attention_call()
    q, k, v = kernel_inputs(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    scope = current_scope()
    if scope is None:
        return varlen_attention(q, k, v, [q.shape[0]] if q.shape[0] else [], scale=scale)
    layout = scope.layout
    if layout.is_local:
        total, end = sum(layout.seq_lens), layout.num_slots  # host ints: no synchronisation
        if end != q.shape[0] or total != q.shape[0]:
            raise AttentionShapeError(
                f"the local layout holds {total} tokens (cu_seqlens ends at {end}) but q has "
                f"{q.shape[0]}; build the layout from the same micro-batch as the tensors"
            )
        return varlen_attention(q, k, v, layout.seq_lens, scale=scale)
    if layout.mode == "ring":
        return ring_attention(q, k, v, layout, scale=scale, group=scope.group)
    return ulysses_attention(q, k, v, layout, scale=scale, group=scope.group)
