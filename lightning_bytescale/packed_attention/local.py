"""Variable-length causal attention for whole sequences packed on one rank.

No log-sum-exp is needed here, so each device gets its fastest fused kernel, one call for
the whole packed micro-batch where one exists:

* CUDA, float16/bfloat16: flash-attn's ``flash_attn_varlen_func`` when the package is
  installed (an optional GPU extra), otherwise PyTorch's ``torch.nn.attention.varlen.varlen_attn``
  (its flash kernel, sm80+, head size a multiple of 8 up to 256);
* everywhere else (CPU, float32, float64, older GPUs): ``scaled_dot_product_attention`` with
  ``is_causal=True`` per sequence, equal lengths batched.  On CUDA it picks the flash or
  memory-efficient kernel itself (float64 runs its math kernel).

Autograd, GQA and every dtype work on every path.  The offsets the varlen kernels take are
cached per set of lengths and copied without a host synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
import torch.nn.functional as F

from lightning_bytescale.packed_attention import cuda_kernels
from lightning_bytescale.packed_attention.segments import Segments

_HALF = (torch.float16, torch.bfloat16)


@lru_cache(maxsize=16)
def _segments(lens: tuple[int, ...]) -> Segments:
    return Segments(lens)


def flash_attn_available() -> bool:
    """True when flash-attn's varlen kernels can be imported (and are recent enough for rings)."""
    return not isinstance(cuda_kernels.flash_attn_status(), str)


def local_kernel(q: torch.Tensor) -> str:
    """The kernel :func:`varlen_attention` uses for ``q``: ``flash_attn``, ``varlen`` or ``sdpa``."""
    if not q.is_cuda or q.dtype not in _HALF or q.shape[-1] > 256:
        return "sdpa"
    if cuda_kernels.flash_attn_available(q.device):
        return "flash_attn"
    if q.shape[-1] % 8 == 0 and cuda_kernels.torch_flash_available(q.device):
        return "varlen"
    return "sdpa"


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: Sequence[int], *, scale: float
) -> torch.Tensor:
    """Causal attention within each sequence of a packed ``[T, H, D]`` batch (``sum(seq_lens) == T``)."""
    lens = tuple(int(s) for s in seq_lens)
    if q.shape[0] == 0:
        return q.new_zeros(q.shape)
    kind = local_kernel(q)
    if kind != "sdpa":
        seg = _segments(lens)
        cu, longest = seg.cu_seqlens(q.device), seg.max_len
        if kind == "flash_attn":
            forward = cuda_kernels.flash_attn_functions()[0]
            return forward(q, k, v, cu, cu, longest, longest, softmax_scale=scale, causal=True)
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(
            q,
            k,
            v,
            cu,
            cu,
            longest,
            longest,
            scale=scale,
            window_size=(-1, 0),
            enable_gqa=q.shape[1] != k.shape[1],
        )
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
