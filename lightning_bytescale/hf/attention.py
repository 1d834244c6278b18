"""The ``"bytescale"`` attention for Hugging Face models: HF's call in, packed attention out.

transformers 5 lets a model's attention layers call any function registered in
``transformers.AttentionInterface``; the layers hand it ``[B, H, T, D]`` query/key/value and
expect ``([B, T, H, D], weights)`` back.  :func:`bytescale_attention` runs
:func:`lightning_bytescale.packed_attention.attention` on the same tensors seen as packed ``[T, H, D]``
(``B`` must be 1), so an HF model runs local variable-length attention or zigzag ring attention,
whichever the strategy's current micro-batch layout says, with the model's own ``scaling`` and
grouped-query heads.

Before calling attention, a model builds its mask through the function registered under the
same name in ``transformers.AttentionMaskInterface``.  :func:`bytescale_mask` returns ``None``:
the sequence boundaries are in the layout, so transformers never materialises a ``[T, T]``
mask for a packed micro-batch.

Outside any ``attention_context`` (a model called directly, e.g. for evaluation in one
process) the sequence boundaries come from ``position_ids``: a new sequence starts wherever a
position is not its predecessor plus one, the same rule transformers uses for packed input.

Whatever the attention cannot do (sliding windows, soft-capping, sinks, dropout, non-causal
or cached attention, a padding mask) is refused here at call time too, with the field to
change; :mod:`lightning_bytescale.hf.checks` refuses the same from the config before a step.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import torch
from torch import nn

from lightning_bytescale.errors import ConfigError
from lightning_bytescale.packed_attention import AttentionLayout, attention, attention_context
from lightning_bytescale.packed_attention.context import current_scope

ATTN_IMPLEMENTATION = "bytescale"


def layout_from_positions(position_ids: torch.Tensor | None, num_tokens: int) -> AttentionLayout:
    """A local layout for ``num_tokens`` packed tokens whose sequences restart where positions do.

    A token starts a new sequence when its position is not the previous token's plus one
    (transformers' own rule for packed input).  Without ``position_ids`` the tokens are one
    sequence.  Reads the positions on the host: this is the path for a model called outside
    the strategy, never the training loop's.
    """
    if position_ids is None or num_tokens == 0:
        lens = [num_tokens] if num_tokens else []
    else:
        pos = position_ids.reshape(-1)
        if pos.numel() != num_tokens:
            raise ConfigError(
                f"position_ids hold {pos.numel()} positions for {num_tokens} tokens; pass position_ids "
                "of shape [1, T] matching input_ids [1, T]"
            )
        starts = torch.ones(num_tokens, dtype=torch.bool, device=pos.device)
        starts[1:] = pos[1:] != pos[:-1] + 1
        idx = torch.nonzero(starts).reshape(-1).cpu().tolist() + [num_tokens]
        lens = [b - a for a, b in zip(idx[:-1], idx[1:])]
    return AttentionLayout(cu_seqlens=(0, *accumulate(lens)), seq_lens=tuple(lens))


def _refuse(what: str, fix: str) -> ConfigError:
    return ConfigError(f'attn_implementation="{ATTN_IMPLEMENTATION}" {what}; {fix}')


def _check_call(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float,
    kwargs: dict[str, Any],
) -> None:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise _refuse(
            f"expects [B, H, T, D] query/key/value, got {tuple(query.shape)}, {tuple(key.shape)}, "
            f"{tuple(value.shape)}",
            "call it from a transformers attention layer",
        )
    if query.shape[0] != 1:
        raise _refuse(
            f"runs packed micro-batches with batch size 1, got batch size {query.shape[0]}",
            "pack the sequences into input_ids [1, T] with position_ids [1, T] restarting at 0 for each "
            "sequence (HFCausalLM does this for every micro-batch)",
        )
    if key.shape[2] != query.shape[2]:
        raise _refuse(
            f"got {query.shape[2]} queries for {key.shape[2]} keys (a KV cache or cross-attention)",
            "it trains on packed sequences: pass use_cache=False, and for generation switch the model to "
            'attn_implementation="sdpa" (model.set_attn_implementation("sdpa"))',
        )
    if key.shape[-1] != value.shape[-1]:
        raise _refuse(
            f"needs equal key and value head sizes, got {key.shape[-1]} and {value.shape[-1]}",
            "models with a separate value head size (multi-head latent attention) are not supported",
        )
    if attention_mask is not None:
        raise _refuse(
            f"takes no attention mask (got {type(attention_mask).__name__} of shape "
            f"{tuple(getattr(attention_mask, 'shape', ()))}): sequence boundaries come from the micro-batch "
            "layout",
            "pass attention_mask=None and give each packed sequence its own position_ids starting at 0",
        )
    if dropout and float(dropout) > 0.0:
        raise _refuse(
            f"does not apply attention dropout (the layer asked for p={float(dropout)})",
            "set the config's attention_dropout to 0.0 (config_overrides={'attention_dropout': 0.0})",
        )
    if kwargs.get("sliding_window") is not None:
        raise _refuse(
            f"has no sliding window (the layer asked for sliding_window={kwargs['sliding_window']})",
            "turn the window off: config_overrides={'sliding_window': None} (Qwen: 'use_sliding_window': "
            "False; models with layer_types: all 'full_attention')",
        )
    if kwargs.get("softcap") is not None:
        raise _refuse(
            f"does not soft-cap attention logits (softcap={kwargs['softcap']})",
            "set attn_logit_softcapping=None, or train this model with another attention",
        )
    if kwargs.get("s_aux") is not None:
        raise _refuse("does not support attention sinks", "train this model with another attention")
    if kwargs.get("position_bias") is not None:
        raise _refuse(
            "does not add a position bias (ALiBi or relative bias) to the scores",
            "train this model with another attention",
        )
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    if not causal:
        raise _refuse(
            "is causal only (the layer asked for non-causal attention)",
            "set the config's is_causal to True, or train this model with another attention",
        )


def bytescale_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``transformers.AttentionInterface`` entry: ``[1, H, T, D]`` in, ``([1, T, H, D], None)`` out.

    Runs :func:`lightning_bytescale.packed_attention.attention` with the layer's ``scaling`` (``None``:
    ``D ** -0.5``) on the micro-batch layout the strategy installed; outside any layout, on the
    sequences that ``position_ids`` delimit.
    """
    _check_call(module, query, key, value, attention_mask, dropout, kwargs)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D] views
    if current_scope() is not None:
        out = attention(q, k, v, scale=scaling)
    else:
        with attention_context(layout_from_positions(kwargs.get("position_ids"), q.shape[0])):
            out = attention(q, k, v, scale=scaling)
    return out[None], None


def bytescale_mask(
    batch_size: int,
    q_length: int | None = None,
    kv_length: int | None = None,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> None:
    """``transformers.AttentionMaskInterface`` entry: no mask at all for packed micro-batches.

    The attention takes sequence boundaries from the layout, so nothing of size ``T x T`` is
    ever built.  A 2-D padding mask is accepted only when it masks nothing.  (transformers
    before 5.2 passes ``cache_position`` instead of ``q_length``.)
    """
    if q_length is None and kwargs.get("cache_position") is not None:
        q_length = int(kwargs["cache_position"].shape[0])
    if batch_size != 1:
        raise _refuse(
            f"runs packed micro-batches with batch size 1, got batch size {batch_size}",
            "pack the sequences into input_ids [1, T] with position_ids [1, T]",
        )
    cached = kv_length is not None and kv_length != q_length
    if cached or (isinstance(kv_offset, int) and kv_offset != 0):
        raise _refuse(
            f"got {q_length} queries for {kv_length} keys (a KV cache)",
            "pass use_cache=False for training; for generation switch the model to "
            'attn_implementation="sdpa" (model.set_attn_implementation("sdpa"))',
        )
    if attention_mask is not None and not bool(attention_mask.all()):
        raise _refuse(
            "takes no padding: the attention_mask passed to the model masks some tokens",
            "pack real tokens only, pass attention_mask=None and give each packed sequence its own "
            "position_ids starting at 0",
        )
    return None


def register() -> None:
    """Register ``"bytescale"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, bytescale_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, bytescale_mask)
