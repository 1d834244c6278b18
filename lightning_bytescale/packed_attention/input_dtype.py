"""q, k and v meet the attention kernels in one dtype: the autocast dtype under autocast, as SDPA.

Under ``torch.autocast``, ``scaled_dot_product_attention`` casts its floating inputs (float64
excepted) to the autocast dtype; the packed attention is not an ATen op, so autocast does not
do that for it.  Models make mixed dtypes there routinely: a rotary table kept in float32 (our
Llama's and Hugging Face's rotary embeddings, under bf16 autocast) turns q and k into float32
while v comes out of its projection in bfloat16.  Left alone, local attention would miss its
fused half-precision kernel (one SDPA call per sequence instead of one varlen call) and a ring
would pick a float32 kernel and send float32 key/value blocks (twice the bytes).
:func:`kernel_inputs` applies autocast's rule at the entry points, so every model gets the fused
kernels; the casts are differentiable, so gradients return in the inputs' own dtypes.
"""

from __future__ import annotations

import torch

from lightning_bytescale.errors import ByteScaleError


class AttentionDtypeError(ByteScaleError, TypeError):
    """q, k and v reach attention in different dtypes outside autocast."""


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts to on ``device_type``, or ``None`` when autocast is off there."""
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def kernel_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q, k, v`` in one dtype: autocast's (float64 stays float64, as autocast leaves it), else their own.

    Raises :class:`AttentionDtypeError` when they still differ (mixed dtypes outside autocast,
    or float64 mixed with others), as SDPA refuses them.
    """
    target = autocast_dtype(q.device.type)
    if target is not None:
        q, k, v = (
            x.to(target) if x.is_floating_point() and x.dtype != torch.float64 else x for x in (q, k, v)
        )
    if not q.dtype == k.dtype == v.dtype:
        raise AttentionDtypeError(
            f"attention got q in {q.dtype}, k in {k.dtype} and v in {v.dtype}; the kernels take one dtype. "
            "Cast them to one dtype before calling attention, or run the forward under torch.autocast "
            "(Lightning: precision='bf16-mixed'), which casts them to the autocast dtype as "
            "scaled_dot_product_attention does"
        )
    return q, k, v
