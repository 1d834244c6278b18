"""What the installed torch offers the CUDA attention kernels, detected from its code, not its version.

The kernels' entry points change between torch releases, and a version number says little
about a given build.  So each is read from the installed torch itself:

* ``torch.nn.attention.varlen.varlen_attn`` (PyTorch's packed flash attention, the local
  kernel without flash-attn): whether the module exists at all, and which keywords the function
  takes (``inspect.signature``).  torch 2.11 takes ``return_aux``, ``scale`` and ``window_size``
  and passes grouped-query heads straight to the flash kernel; torch 2.13 adds ``enable_gqa``
  (and refuses fewer key/value heads than query heads without it), ``seqused_k``,
  ``block_table`` and ``num_splits``.  :func:`varlen_attn_call` passes ``enable_gqa`` only to a
  function that takes it, and :func:`varlen_attn_problem` says why one cannot be used.
* the ATen ops the ring's block kernels call (``aten._flash_attention_forward`` / ``_backward``,
  ``aten._efficient_attention_forward`` / ``_backward``): their argument *names* have changed
  between releases (the flash backward's dropout state was ``philox_seed, philox_offset``
  before it became ``rng_state, unused``) while their order held.  :func:`bind` maps the
  adapters' values onto the schema of the installed op by position, and :func:`op_problem`
  refuses a schema of another shape (a kernel reported unavailable with the reason, never a
  ``TypeError`` in the middle of a step).

Detections are cached (the signature per function object, the schemas per op).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

import torch

# The aten ops behind each adapter, and what the adapters pass: the number of positional
# arguments (in schema order) and the keyword-only arguments they need.
ATEN_OPS: dict[str, str] = {
    "flash_forward": "_flash_attention_forward",
    "flash_backward": "_flash_attention_backward",
    "efficient_forward": "_efficient_attention_forward",
    "efficient_backward": "_efficient_attention_backward",
}
POSITIONAL: dict[str, int] = {
    "flash_forward": 10,  # q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask
    "flash_backward": 14,  # dout, q, k, v, out, lse, cum_seq_q/k, max_q/k, dropout_p, is_causal, rng state (2)
    "efficient_forward": 11,  # q, k, v, bias, cu_seqlens_q/k, max_seqlen_q/k, dropout_p, mask type, compute lse
    "efficient_backward": 16,  # dout, q, k, v, bias, out, cu_seqlens_q/k, max_q/k, lse, dropout, philox (2), mask, bias grad
}
KEYWORDS: frozenset[str] = frozenset({"scale"})

# varlen_attn keywords the local path needs (causal through window_size=(-1, 0))
VARLEN_NEEDS: frozenset[str] = frozenset({"scale", "window_size"})


@dataclass(frozen=True)
class OpSchema:
    """An op's arguments: the positional ones in order, and the keyword-only ones."""

    name: str
    positional: tuple[str, ...]
    keywords: frozenset[str]


@cache
def op_schema(adapter: str) -> OpSchema | None:
    """The installed schema of the aten op behind ``adapter`` (``None`` when this torch has no such op)."""
    packet = getattr(torch.ops.aten, ATEN_OPS[adapter], None)
    overload = getattr(packet, "default", None) if packet is not None else None
    if overload is None:
        return None
    args = overload._schema.arguments
    return OpSchema(
        overload._schema.name,
        tuple(a.name for a in args if not a.kwarg_only),
        frozenset(a.name for a in args if a.kwarg_only),
    )


def op_problem(adapter: str) -> str | None:
    """Why the installed op behind ``adapter`` cannot be called as the adapter calls it, or ``None``."""
    schema = op_schema(adapter)
    if schema is None:
        return f"this torch has no aten.{ATEN_OPS[adapter]}"
    if len(schema.positional) != POSITIONAL[adapter] or not schema.keywords >= KEYWORDS:
        shown = ", ".join([*schema.positional, *(["*", *sorted(schema.keywords)] if schema.keywords else [])])
        return (
            f"this torch's {schema.name} takes ({shown}), not the {POSITIONAL[adapter]} positional arguments "
            f"and the keywords {sorted(KEYWORDS)} the adapter passes"
        )
    return None


def bind(adapter: str, positional: Sequence[Any], **keywords: Any) -> dict[str, Any]:
    """Keyword arguments for the op behind ``adapter``: ``positional`` named by the installed schema."""
    problem = op_problem(adapter)
    if problem is not None:
        raise RuntimeError(problem)
    schema = op_schema(adapter)
    assert schema is not None and len(positional) == len(schema.positional), (adapter, len(positional))
    return {**dict(zip(schema.positional, positional)), **keywords}


@cache
def _varlen_module() -> Any:
    try:
        return importlib.import_module("torch.nn.attention.varlen")
    except ImportError:
        return None


def varlen_attn() -> Callable[..., torch.Tensor] | None:
    """``torch.nn.attention.varlen.varlen_attn``, or ``None`` when this torch has none.

    Looked up at each call (an attribute read), so the function in the module is the one used.
    """
    module = _varlen_module()
    return None if module is None else getattr(module, "varlen_attn", None)


@lru_cache(maxsize=8)
def _keywords(fn: Callable[..., Any]) -> frozenset[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))


def varlen_attn_keywords() -> frozenset[str]:
    """The keyword arguments the installed ``varlen_attn`` takes (empty when there is none)."""
    fn = varlen_attn()
    return frozenset() if fn is None else _keywords(fn)


def varlen_attn_problem() -> str | None:
    """Why the local path cannot use ``varlen_attn`` on this torch, or ``None`` when it can."""
    if varlen_attn() is None:
        return "this torch has no torch.nn.attention.varlen.varlen_attn"
    missing = VARLEN_NEEDS - varlen_attn_keywords()
    if missing:
        return f"this torch's varlen_attn takes no {', '.join(sorted(missing))}"
    return None


def varlen_attn_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    *,
    scale: float,
) -> torch.Tensor:
    """Causal ``varlen_attn`` over packed sequences, with the keywords this torch's function takes."""
    fn = varlen_attn()
    if fn is None:
        raise RuntimeError(varlen_attn_problem())
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] and "enable_gqa" in varlen_attn_keywords() else {}
    return fn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale, window_size=(-1, 0), **gqa)


def report() -> dict[str, Any]:
    """What was detected, for a device check's record."""
    return {
        "torch": torch.__version__,
        "varlen_attn": None if varlen_attn() is None else sorted(varlen_attn_keywords()),
        "varlen_attn_problem": varlen_attn_problem(),
        "aten_ops": {
            name: (None if op_schema(name) is None else list(op_schema(name).positional))  # type: ignore[union-attr]
            for name in ATEN_OPS
        },
        "aten_problems": {name: op_problem(name) for name in ATEN_OPS if op_problem(name)},
    }
