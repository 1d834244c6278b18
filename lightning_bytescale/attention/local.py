"""Variable-length causal attention for whole sequences packed on one rank.

flash-attn's varlen kernel is used on CUDA when the package is installed (it is an optional
GPU extra and never required); everywhere else each group of equal-length sequences runs
through PyTorch's ``scaled_dot_product_attention`` with ``is_causal=True``, so autograd,
every dtype (float64 included) and every device work out of the box.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F


@lru_cache(maxsize=1)
def _flash_varlen() -> Any:
    try:
        return importlib.import_module("flash_attn").flash_attn_varlen_func
    except Exception:  # ImportError, or a broken build (missing CUDA extension)
        return None


def flash_attn_available() -> bool:
    """True when flash-attn's varlen kernel can be imported."""
    return _flash_varlen() is not None


def _use_flash(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and flash_attn_available()


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: Sequence[int], *, scale: float
) -> torch.Tensor:
    """Causal attention within each sequence of a packed ``[T, H, D]`` batch (``sum(seq_lens) == T``)."""
    lens = [int(s) for s in seq_lens]
    if q.shape[0] == 0:
        return q.new_zeros(q.shape)
    if _use_flash(q):
        cu = torch.tensor([0, *lens], device=q.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        longest = max(lens)
        return _flash_varlen()(q, k, v, cu, cu, longest, longest, softmax_scale=scale, causal=True)
    gqa = q.shape[1] != k.shape[1]
    qh, kh, vh = (x.transpose(0, 1) for x in (q, k, v))  # [H, T, D]
    if len(set(lens)) == 1:
        n, s = len(lens), lens[0]
        out = F.scaled_dot_product_attention(
            *(x.unflatten(1, (n, s)).transpose(0, 1) for x in (qh, kh, vh)),
            is_causal=True,
            scale=scale,
            enable_gqa=gqa,
        )  # [n, H, s, D]
        return out.transpose(1, 2).reshape(q.shape)
    pieces = []
    start = 0
    for s in lens:
        sl = slice(start, start + s)
        # 4-D inputs: 3-D ones miss the fused CPU kernel and take the slow math path
        o = F.scaled_dot_product_attention(
            qh[None, :, sl], kh[None, :, sl], vh[None, :, sl], is_causal=True, scale=scale, enable_gqa=gqa
        )
        pieces.append(o[0].transpose(0, 1))
        start += s
    return torch.cat(pieces, dim=0)
