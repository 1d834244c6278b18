"""Block attention kernels that return the log-sum-exp, the building block of ring attention.

A ring member computes attention of its queries against one key/value block at a time and
merges the partial results by log-sum-exp; backward recomputes each block from the merged
output and log-sum-exp.  Two implementations share one interface:

* ``cpu``: PyTorch's fused CPU flash kernel
  (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward), any float dtype;
* ``math``: plain matmul + softmax, any device and dtype (the fallback).

Tensors are packed ``[T, H, D]`` (queries) and ``[T, Hkv, D]`` (keys, values) with ``Hkv``
dividing ``H``; query head ``h`` reads key/value head ``h // (H // Hkv)``, as
``scaled_dot_product_attention(enable_gqa=True)`` does.  ``causal=True`` means the query
block and the key block cover the same positions (the diagonal block of a causal mask).
Log-sum-exps are ``[H, T]`` in the accumulation dtype: float64 for float64 input, float32
otherwise.
"""

from __future__ import annotations

import torch

_CPU_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for merges: float64 stays float64, everything else uses float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_impl(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else "math"


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[T, H, D]`` -> ``[1, H, T, D]``."""
    return x.transpose(0, 1).unsqueeze(0)


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """``[1, H, T, D]`` -> ``[T, H, D]``."""
    return x.squeeze(0).transpose(0, 1)


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce_kv(dx: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return dx
    t, h, d = dx.shape
    return dx.view(t, h // groups, groups, d).sum(dim=2)


def _causal_mask(tq: int, tk: int, device: torch.device) -> torch.Tensor:
    return torch.ones(tq, tk, dtype=torch.bool, device=device).tril()


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float, impl: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` against one key/value block: ``(out [Tq, H, D], lse [H, Tq])``.

    ``out`` is in the accumulation dtype, ready for a log-sum-exp merge.  Every query row
    must see at least one key (true for a full block and for a diagonal causal block).
    """
    groups = q.shape[1] // k.shape[1]
    acc = acc_dtype(q.dtype)
    impl = impl or default_impl(q.device)
    if impl == "cpu":
        out, lse = _CPU_FWD(
            _heads_first(q),
            _heads_first(_expand_kv(k, groups)),
            _heads_first(_expand_kv(v, groups)),
            0.0,
            causal,
            scale=scale,
        )
        return _tokens_first(out).to(acc), lse.squeeze(0).to(acc)
    if impl != "math":
        raise ValueError(f"unknown attention kernel {impl!r}; use 'cpu' or 'math'")
    qh = _heads_first(q).squeeze(0).to(acc)  # [H, Tq, D]
    kh = _heads_first(_expand_kv(k, groups)).squeeze(0).to(acc)
    vh = _heads_first(_expand_kv(v, groups)).squeeze(0).to(acc)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # [H, Tq, Tk]
    if causal:
        s = s.masked_fill(~_causal_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, Tq]
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.matmul(p, vh)  # [H, Tq, D]
    return out.transpose(0, 1), lse


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block, given the *merged* output and log-sum-exp of the query rows.

    Returns ``(dq [Tq, H, D], dk [Tk, Hkv, D], dv [Tk, Hkv, D])`` in the accumulation dtype;
    summing them over all blocks gives the gradients of the full attention.
    """
    groups = q.shape[1] // k.shape[1]
    acc = acc_dtype(q.dtype)
    impl = impl or default_impl(q.device)
    if impl == "cpu":
        dq, dk, dv = _CPU_BWD(
            _heads_first(dout.to(q.dtype)).contiguous(),
            _heads_first(q),
            _heads_first(_expand_kv(k, groups)),
            _heads_first(_expand_kv(v, groups)),
            _heads_first(out.to(q.dtype)),
            lse.unsqueeze(0).to(torch.float64 if q.dtype == torch.float64 else torch.float32).contiguous(),
            0.0,
            causal,
            scale=scale,
        )
        return (
            _tokens_first(dq).to(acc),
            _reduce_kv(_tokens_first(dk).to(acc), groups),
            _reduce_kv(_tokens_first(dv).to(acc), groups),
        )
    if impl != "math":
        raise ValueError(f"unknown attention kernel {impl!r}; use 'cpu' or 'math'")
    qh = _heads_first(q).squeeze(0).to(acc)  # [H, Tq, D]
    kh = _heads_first(_expand_kv(k, groups)).squeeze(0).to(acc)
    vh = _heads_first(_expand_kv(v, groups)).squeeze(0).to(acc)
    doh = _heads_first(dout).squeeze(0).to(acc)
    oh = _heads_first(out).squeeze(0).to(acc)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~_causal_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    p = torch.exp(s - lse.to(acc).unsqueeze(-1))  # [H, Tq, Tk]
    dvh = torch.matmul(p.transpose(-1, -2), doh)
    dp = torch.matmul(doh, vh.transpose(-1, -2))
    delta = (doh * oh).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta)
    dqh = torch.matmul(ds, kh) * scale
    dkh = torch.matmul(ds.transpose(-1, -2), qh) * scale
    return (
        dqh.transpose(0, 1),
        _reduce_kv(dkh.transpose(0, 1), groups),
        _reduce_kv(dvh.transpose(0, 1), groups),
    )


def merge_into(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor
) -> None:
    """Merge a block result into running ``(out [T, H, D], lse [H, T])`` accumulators in place.

    ``lse_acc`` rows may be ``-inf`` (nothing merged yet); ``lse_blk`` rows must be finite.
    """
    new_lse = torch.logaddexp(lse_acc, lse_blk)
    w_old = torch.exp(lse_acc - new_lse).transpose(0, 1).unsqueeze(-1)  # [T, H, 1]
    w_blk = torch.exp(lse_blk - new_lse).transpose(0, 1).unsqueeze(-1)
    out_acc.mul_(w_old).add_(out_blk * w_blk)
    lse_acc.copy_(new_lse)
