"""CUDA varlen block kernels that return the log-sum-exp and never build ``[H, Tq, Tk]`` scores.

Three adapters to one interface (:mod:`.kernels` documents it), each one kernel call per
varlen block, whatever the number of sequences in it:

* ``flash``: ``torch.ops.aten._flash_attention_forward`` / ``_flash_attention_backward`` with
  ``cum_seq_q`` / ``cum_seq_k`` (the varlen form PyTorch's own
  ``torch.nn.attention.varlen.varlen_attn`` uses).  Packed ``[T, H, D]``, key/value heads may
  divide query heads (GQA), log-sum-exp ``[H, Tq]`` float32.  Dropout is 0, so the backward's
  ``rng_state`` / ``unused`` arguments are placeholders, as in ``varlen_attn``'s backward.
* ``efficient``: ``torch.ops.aten._efficient_attention_forward`` / ``_efficient_attention_backward``
  with ``cu_seqlens_q`` / ``cu_seqlens_k``: ``[1, T, H, D]`` inputs, equal head counts (keys and
  values are expanded for GQA and their gradients summed back), log-sum-exp
  ``[num_seqs, H, ceil(max_q / 32) * 32]`` float32, converted to and from ``[H, Tq]`` with each
  row's (sequence, offset).  ``custom_mask_type`` 1 is the top-left causal mask
  (``CausalVariant.UPPER_LEFT``), 0 no mask.
* ``flash_attn``: the flash-attn package: ``flash_attn_varlen_func(..., return_attn_probs=True)``
  (its documented API, which returns the log-sum-exp ``[H, Tq]``) forward, and its
  ``_flash_attn_varlen_backward`` (the function its own autograd uses) backward, which takes
  the merged output and log-sum-exp.  Needs flash-attn >= 2.6 (the ``[H, Tq]`` log-sum-exp
  and a keyword backward); older builds are reported unavailable.

The ``flash`` and ``efficient`` adapters count as available only when the installed ops have the
schema they were written for (:mod:`.torch_features`), so another torch is refused with the
reason, not met with a ``TypeError``.

Head sizes are zero-padded to a multiple of 8 (what the fused kernels require); zero columns
change no score and are cut from outputs and gradients.  Nothing here synchronises the host:
offsets come from :class:`~.segments.Segments` (copied once per layout from pinned memory).
"""

from __future__ import annotations

import importlib
import inspect
from functools import cache, lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalVariant

from lightning_bytescale.packed_attention import torch_features
from lightning_bytescale.packed_attention.gqa import expand_kv, reduce_kv
from lightning_bytescale.packed_attention.segments import Segments

_ALIGN = 8

# The PyTorch ops, called with the argument names of the installed schemas, bound by position
# (:func:`.torch_features.bind`: the names changed between torch releases, the order did not);
# tests may swap in emulations.
OPS: dict[str, Any] = {
    "flash_forward": torch.ops.aten._flash_attention_forward,
    "flash_backward": torch.ops.aten._flash_attention_backward,
    "efficient_forward": torch.ops.aten._efficient_attention_forward,
    "efficient_backward": torch.ops.aten._efficient_attention_backward,
}
_NO_MASK = 0
_CAUSAL_TOP_LEFT = int(CausalVariant.UPPER_LEFT)


def _pad_head(x: torch.Tensor) -> torch.Tensor:
    extra = -x.shape[-1] % _ALIGN
    return F.pad(x, (0, extra)) if extra else x


def _cut(x: torch.Tensor, d: int) -> torch.Tensor:
    return x if x.shape[-1] == d else x[..., :d]


def _contig(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [_pad_head(x).contiguous() for x in xs]


# ----------------------------------------------------------------------------- availability
@cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _sm80(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (8, 0)


def _ops_callable(*adapters: str) -> bool:
    return all(torch_features.op_problem(name) is None for name in adapters)


def flash_device(device: torch.device) -> bool:
    """PyTorch's flash kernel can run on ``device``: built into this torch, and an sm80+ device."""
    return torch.cuda.is_available() and torch.backends.cuda.is_flash_attention_available() and _sm80(device)


def torch_flash_available(device: torch.device) -> bool:
    """The ``flash`` block kernel: :func:`flash_device`, and its ops of the schema the adapters call."""
    return flash_device(device) and _ops_callable("flash_forward", "flash_backward")


def torch_efficient_available(device: torch.device) -> bool:
    """PyTorch's memory-efficient kernel: in every CUDA build of torch (its ops of the expected schema)."""
    return torch.cuda.is_available() and _ops_callable("efficient_forward", "efficient_backward")


@lru_cache(maxsize=1)
def flash_attn_status() -> tuple[Any, Any, str] | str:
    """``(forward, backward, window style)`` of flash-attn, or why it cannot be used."""
    try:
        package = importlib.import_module("flash_attn")
        interface = importlib.import_module("flash_attn.flash_attn_interface")
    except Exception as err:  # ImportError, or a build whose CUDA extension does not load
        return f"flash-attn does not import: {type(err).__name__}: {err}"
    forward = getattr(package, "flash_attn_varlen_func", None)
    backward = getattr(interface, "_flash_attn_varlen_backward", None)
    if forward is None or backward is None:
        return "this flash-attn has no flash_attn_varlen_func / _flash_attn_varlen_backward"
    try:
        params = inspect.signature(getattr(backward, "_init_fn", backward)).parameters
    except (TypeError, ValueError):
        return "cannot read the signature of flash-attn's _flash_attn_varlen_backward"
    if "window_size_left" in params:
        style = "split"
    elif "window_size" in params:
        style = "pair"
    else:
        return (
            f"flash-attn {getattr(package, '__version__', '?')} is too old for ring attention; install >= 2.6"
        )
    return forward, backward, style


def flash_attn_available(device: torch.device) -> bool:
    """The flash-attn package imports, is recent enough, and the device is sm80+."""
    return not isinstance(flash_attn_status(), str) and torch.cuda.is_available() and _sm80(device)


def why_unavailable(name: str, device: torch.device) -> str:
    """A short reason for :class:`~.kernels.BlockKernel.unsupported`."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if name == "flash_attn" and isinstance(flash_attn_status(), str):
        return str(flash_attn_status())
    if name == "flash" and not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no flash attention"
    if name in ("flash", "efficient"):
        problems = [torch_features.op_problem(f"{name}_{part}") for part in ("forward", "backward")]
        if any(problems):
            return "; ".join(p for p in problems if p)
    if name in ("flash", "flash_attn") and not _sm80(device):
        return f"compute capability {torch.cuda.get_device_capability(device)} < 8.0"
    return "unknown reason"


# ----------------------------------------------------------------------------- helpers
@cache
def _placeholders(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Dropout state for backward kernels called with dropout 0 (never read)."""
    return torch.zeros((2,), dtype=torch.uint64, device=device), torch.empty(0, device=device)


def _philox() -> tuple[torch.Tensor, torch.Tensor]:
    """The (seed, offset) the efficient forward returns without dropout: empty host scalars."""
    return torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long)


def _padded_index(seg: Segments, width: int, device: torch.device) -> torch.Tensor:
    """Flat index of every packed row in a ``[num_seqs, width]`` padded layout."""
    return seg.token_seq(device) * width + seg.token_offset(device)


def lse_from_padded(lse: torch.Tensor, seg: Segments) -> torch.Tensor:
    """``[num_seqs, H, M]`` (one row per sequence position) -> packed ``[H, T]``."""
    b, h, m = lse.shape
    flat = lse.transpose(0, 1).reshape(h, b * m)
    return flat.index_select(1, _padded_index(seg, m, lse.device))


def lse_to_padded(lse: torch.Tensor, seg: Segments, width: int) -> torch.Tensor:
    """Packed ``[H, T]`` -> ``[num_seqs, H, width]`` float32 (unused positions 0)."""
    h = lse.shape[0]
    flat = torch.zeros(h, len(seg.lens) * width, dtype=torch.float32, device=lse.device)
    flat.index_copy_(1, _padded_index(seg, width, lse.device), lse.float())
    return flat.view(h, len(seg.lens), width).transpose(0, 1).contiguous()


_VARLEN_NAMES = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def _varlen(q_seg: Segments, k_seg: Segments, device: torch.device) -> tuple:
    """The varlen arguments, in the order every kernel takes them: offsets on ``device``, longest sequences."""
    return q_seg.cu_seqlens(device), k_seg.cu_seqlens(device), q_seg.max_len, k_seg.max_len


def efficient_lse_width(max_q: int) -> int:
    """The efficient kernel's log-sum-exp row width for ``max_q`` queries (32-aligned, as its forward)."""
    return -(-max_q // 32) * 32


# ----------------------------------------------------------------------------- flash (aten)
def flash_forward(q, k, v, q_seg: Segments, k_seg: Segments, causal: bool, scale: float):
    d = q.shape[-1]
    qp, kp, vp = _contig(q, k, v)
    out, lse, *_ = OPS["flash_forward"](
        **torch_features.bind(
            "flash_forward",
            (qp, kp, vp, *_varlen(q_seg, k_seg, q.device), 0.0, causal, False),  # dropout 0, no debug mask
            scale=scale,
        )
    )
    return _cut(out, d), lse


def flash_backward(dout, q, k, v, out, lse, q_seg: Segments, k_seg: Segments, causal: bool, scale: float):
    d = q.shape[-1]
    dp, qp, kp, vp, op = _contig(dout.to(q.dtype), q, k, v, out.to(q.dtype))
    rng_state, unused = _placeholders(str(q.device))
    dq, dk, dv = OPS["flash_backward"](
        **torch_features.bind(
            "flash_backward",
            (dp, qp, kp, vp, op, lse.float().contiguous(), *_varlen(q_seg, k_seg, q.device), 0.0, causal)
            + (rng_state, unused),
            scale=scale,
        )
    )
    return _cut(dq, d), _cut(dk, d), _cut(dv, d)


# ----------------------------------------------------------------------------- efficient (aten)
def _groups(q: torch.Tensor, k: torch.Tensor) -> int:
    return q.shape[1] // k.shape[1]


def efficient_forward(q, k, v, q_seg: Segments, k_seg: Segments, causal: bool, scale: float):
    d, g = q.shape[-1], _groups(q, k)
    qp, kp, vp = _contig(q, expand_kv(k, g), expand_kv(v, g))
    mask = _CAUSAL_TOP_LEFT if causal else _NO_MASK
    out, lse, *_ = OPS["efficient_forward"](
        **torch_features.bind(
            "efficient_forward",
            (qp.unsqueeze(0), kp.unsqueeze(0), vp.unsqueeze(0), None, *_varlen(q_seg, k_seg, q.device))
            + (0.0, mask, True),  # dropout 0, the mask, compute the log-sum-exp
            scale=scale,
        )
    )
    return _cut(out.squeeze(0), d), lse_from_padded(lse, q_seg)


def efficient_backward(dout, q, k, v, out, lse, q_seg: Segments, k_seg: Segments, causal: bool, scale: float):
    d, g = q.shape[-1], _groups(q, k)
    dp, qp, kp, vp, op = _contig(dout.to(q.dtype), q, expand_kv(k, g), expand_kv(v, g), out.to(q.dtype))
    seed, offset = _philox()
    padded_lse = lse_to_padded(lse, q_seg, efficient_lse_width(q_seg.max_len))
    dq, dk, dv, _ = OPS["efficient_backward"](
        **torch_features.bind(
            "efficient_backward",
            (dp.unsqueeze(0), qp.unsqueeze(0), kp.unsqueeze(0), vp.unsqueeze(0), None, op.unsqueeze(0))
            + (*_varlen(q_seg, k_seg, q.device), padded_lse, 0.0, seed, offset)
            + (_CAUSAL_TOP_LEFT if causal else _NO_MASK, False),  # the mask; no bias gradient
            scale=scale,
        )
    )
    return (
        _cut(dq.squeeze(0), d),
        reduce_kv(_cut(dk.squeeze(0), d), g),
        reduce_kv(_cut(dv.squeeze(0), d), g),
    )


# ----------------------------------------------------------------------------- flash-attn package
def flash_attn_functions() -> tuple[Any, Any, str]:
    api = flash_attn_status()
    if isinstance(api, str):
        raise RuntimeError(api)
    return api


def flash_attn_forward(q, k, v, q_seg: Segments, k_seg: Segments, causal: bool, scale: float):
    forward, _, _ = flash_attn_functions()
    d = q.shape[-1]
    qp, kp, vp = _contig(q, k, v)
    out, lse, _ = forward(
        qp,
        kp,
        vp,
        *_varlen(q_seg, k_seg, q.device),
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        return_attn_probs=True,
    )
    if lse.dim() != 2:
        raise RuntimeError(
            f"flash-attn returned a log-sum-exp of shape {tuple(lse.shape)}, not [H, T]; install flash-attn >= 2.6"
        )
    return _cut(out, d), lse


def flash_attn_backward(
    dout, q, k, v, out, lse, q_seg: Segments, k_seg: Segments, causal: bool, scale: float
):
    _, backward, style = flash_attn_functions()
    d = q.shape[-1]
    dp, qp, kp, vp, op = _contig(dout.to(q.dtype), q, k, v, out.to(q.dtype))
    dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
    window = (
        {"window_size_left": -1, "window_size_right": -1} if style == "split" else {"window_size": (-1, -1)}
    )
    backward(
        dout=dp,
        q=qp,
        k=kp,
        v=vp,
        out=op,
        softmax_lse=lse.float().contiguous(),
        dq=dq,
        dk=dk,
        dv=dv,
        **dict(zip(_VARLEN_NAMES, _varlen(q_seg, k_seg, q.device))),
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
        **window,
    )
    return _cut(dq, d), _cut(dk, d), _cut(dv, d)
