"""Variable-length causal attention for whole sequences packed on one rank.

No log-sum-exp is needed here, so each device gets its fastest fused kernel, one call for
the whole packed micro-batch where one exists:

* CUDA, float16/bfloat16: flash-attn's ``flash_attn_varlen_func`` when the package is
  installed (an optional GPU extra), otherwise PyTorch's ``torch.nn.attention.varlen.varlen_attn``
  (its flash kernel, sm80+, head size a multiple of 8 up to 256), called with the keywords the
  installed torch's function takes (:mod:`.torch_features`: ``enable_gqa`` from torch 2.13 on);
* on a CPU: ``scaled_dot_product_attention`` with ``is_causal=True`` on *length groups*: the
  sequences, sorted by length, are cut into groups of similar lengths, and each group is one
  batched call over its sequences right-padded to the group's longest (:func:`length_groups`).
  One call per sequence costs a kernel call and an autograd node per sequence and layer, which
  dominates a micro-batch of many short sequences (a long-tailed batch packs hundreds into
  one).  The price is memory: the groups' padded copies of q, k and v (at most ``PAD_SLACK``
  times the rows, plus ``PAD_FREE``) are kept for the backward;
* on CUDA without those kernels (float32, float64, older GPUs): the same call once per
  sequence, equal lengths batched, so that no padded copy is kept beyond the activations the
  profiler measured and the capacity C was planned for; it picks the flash or memory-efficient
  kernel itself (float64 runs its math kernel).

Padding is exact, not approximate: under the causal mask a real row ``t`` of a sequence attends
keys ``0..t`` only, all of them its own sequence's real rows, so the padded rows (copies of the
sequence's last row) never reach a real output; their own outputs are dropped, so their
gradients, and everything they send back into the real rows, are exact zeros.

Autograd, GQA and every dtype work on every path.  The offsets the varlen kernels take are
cached per set of lengths and copied without a host synchronisation; the groups' gather and
scatter indices are cached per set of lengths on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from lightning_bytescale.packed_attention import cuda_kernels, torch_features
from lightning_bytescale.packed_attention.segments import Segments

_HALF = (torch.float16, torch.bfloat16)

# A length group may hold this much more (padded) attention area than its sequences' own, plus
# PAD_FREE slots squared: about what one more kernel call costs on a CPU.
PAD_SLACK = 1.25
PAD_FREE = 32 * 32


@lru_cache(maxsize=16)
def _segments(lens: tuple[int, ...]) -> Segments:
    return Segments(lens)


def length_groups(lens: Sequence[int]) -> list[list[int]]:
    """Sequence indices cut into groups for one padded, batched causal call each.

    Sorted by length (ties in packed order), a group takes the next sequence while ``n x L^2``
    (its sequences padded to the longest, ``L``) stays within ``PAD_SLACK`` times their own
    ``sum s^2`` plus ``PAD_FREE``.  Empty sequences belong to no group.
    """
    groups: list[list[int]] = []
    area = 0
    for i in sorted((i for i, s in enumerate(lens) if s > 0), key=lambda i: (lens[i], i)):
        s = int(lens[i])
        if not groups or (len(groups[-1]) + 1) * s * s > PAD_SLACK * (area + s * s) + PAD_FREE:
            groups.append([])
            area = 0
        groups[-1].append(i)
        area += s * s
    return groups


@dataclass(frozen=True)
class _Grouped:
    """The length groups of one set of lengths and the (host) indices that pad and unpad them."""

    shapes: tuple[tuple[int, int], ...]  # (sequences, padded length) of every group
    gather: torch.Tensor  # [sum n L]: the packed row every padded slot reads
    scatter: torch.Tensor  # [T]: the padded slot that holds every packed row's output


@lru_cache(maxsize=16)
def _grouped(lens: tuple[int, ...]) -> _Grouped:
    bounds = _segments(lens).bounds
    gather: list[torch.Tensor] = []
    scatter = torch.empty(bounds[-1][1] if bounds else 0, dtype=torch.long)
    shapes, slot = [], 0
    for group in length_groups(lens):
        longest = lens[group[-1]]
        offsets = torch.arange(longest)
        for i in group:
            start, stop = bounds[i]
            gather.append(start + offsets.clamp(max=lens[i] - 1))
            scatter[start:stop] = torch.arange(slot, slot + lens[i])
            slot += longest
        shapes.append((len(group), longest))
    return _Grouped(tuple(shapes), torch.cat(gather), scatter)


def flash_attn_available() -> bool:
    """True when flash-attn's varlen kernels can be imported (and are recent enough for rings)."""
    return not isinstance(cuda_kernels.flash_attn_status(), str)


def local_kernel(q: torch.Tensor) -> str:
    """The kernel :func:`varlen_attention` uses for ``q``: ``flash_attn``, ``varlen`` or ``sdpa``.

    ``varlen`` needs a ``varlen_attn`` this torch offers with the keywords the call passes
    (:func:`.torch_features.varlen_attn_problem`); without one CUDA keeps the SDPA path.
    """
    if not q.is_cuda or q.dtype not in _HALF or q.shape[-1] > 256:
        return "sdpa"
    if cuda_kernels.flash_attn_available(q.device):
        return "flash_attn"
    if (
        q.shape[-1] % 8 == 0
        and cuda_kernels.flash_device(q.device)
        and torch_features.varlen_attn_problem() is None
    ):
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
        return torch_features.varlen_attn_call(q, k, v, cu, longest, scale=scale)
    gqa = q.shape[1] != k.shape[1]
    if len(set(lens)) == 1:  # one group without padding: views, no gather
        n, s = len(lens), lens[0]
        out = F.scaled_dot_product_attention(
            *(x.unflatten(0, (n, s)).transpose(1, 2) for x in (q, k, v)),
            is_causal=True,
            scale=scale,
            enable_gqa=gqa,
        )  # [n, H, s, D]
        return out.transpose(1, 2).reshape(q.shape)
    if q.device.type != "cpu":
        return _per_sequence(q, k, v, lens, scale=scale, gqa=gqa)
    grouped = _grouped(lens)
    padded = [x.index_select(0, grouped.gather) for x in (q, k, v)]  # [sum n L, H, D]
    pieces, start = [], 0
    for n, longest in grouped.shapes:
        # [n, H, L, D]: 4-D inputs (3-D ones miss the fused CPU kernel and take the slow math path)
        qg, kg, vg = (
            x[start : start + n * longest].unflatten(0, (n, longest)).transpose(1, 2) for x in padded
        )
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale, enable_gqa=gqa)
        pieces.append(out.transpose(1, 2).reshape(n * longest, *q.shape[1:]))
        start += n * longest
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).index_select(0, grouped.scatter)


def _per_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: tuple[int, ...], *, scale: float, gqa: bool
) -> torch.Tensor:
    """One causal call per sequence, on views of the packed rows (no copy kept for the backward)."""
    pieces, start = [], 0
    for s in lens:
        rows = (x[start : start + s].transpose(0, 1)[None] for x in (q, k, v))  # [1, H, s, D]
        out = F.scaled_dot_product_attention(*rows, is_causal=True, scale=scale, enable_gqa=gqa)
        pieces.append(out[0].transpose(0, 1))
        start += s
    return torch.cat(pieces, dim=0)
