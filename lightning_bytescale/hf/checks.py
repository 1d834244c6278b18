"""Refuse, before any step, the Hugging Face models that packed attention would train wrongly.

The ``"bytescale"`` attention is causal, full and unbiased within each packed sequence.  A
model whose config asks for anything else (a sliding window, chunked attention, soft-capped
logits, attention sinks, ALiBi, bidirectional attention, attention dropout, a RoPE that
rescales with the longest position in the batch) or whose layers mix tokens outside the
attention interface (state-space and linear-attention hybrids) would train, but not on what
its config says, and differently from single-sequence training.  :func:`config_problems` lists
every such field of a config; :func:`check_config` and :func:`check_model` raise one
:class:`~lightning_bytescale.errors.ConfigError` naming them all and how to turn them off.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from lightning_bytescale.errors import ConfigError
from lightning_bytescale.hf.attention import ATTN_IMPLEMENTATION

DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")
# RoPE variants whose frequencies follow max(position_ids) of the whole batch: packing sequences
# together (or sharding one) would change every sequence's rotation.
BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")
ALIBI_MODEL_TYPES = ("bloom",)


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _rope_types(config: Any) -> list[tuple[str, str]]:
    """``(field, rope_type)`` of every RoPE entry (per layer type where the config has several)."""
    found = []
    for field in ("rope_parameters", "rope_scaling"):  # rope_scaling: older configs (an alias in v5)
        params = getattr(config, field, None)
        if not isinstance(params, dict):
            continue
        if found:
            break
        entries = (
            params.items() if all(isinstance(v, dict) for v in params.values()) and params else [("", params)]
        )
        for label, entry in entries:
            kind = entry.get("rope_type", entry.get("type"))
            if kind is not None:
                found.append((f"{field}[{label!r}]" if label else field, str(kind)))
    return found


def _causal_lm_class(config: Any) -> type | None:
    """The ``AutoModelForCausalLM`` class for ``config`` (``None`` for remote code or an unknown type)."""
    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError):
        return None


def _class_problem(cls: type) -> str | None:
    if getattr(cls, "_supports_attention_backend", False):
        return None
    return (
        f"{cls.__name__} does not route its attention through transformers.AttentionInterface (or mixes "
        "tokens in other layers, such as state-space or convolution layers), so its layers would attend "
        "across packed sequences"
    )


def config_problems(config: Any, *, training: bool = True) -> list[str]:
    """Every config field the packed causal attention cannot honour, with the fix (empty: fine)."""
    cfg = _text_config(config)
    problems: list[str] = []
    cls = _causal_lm_class(config)
    if cls is not None and (problem := _class_problem(cls)) is not None:
        problems.append(problem)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        full = {"full_attention"}
        if getattr(cfg, "sliding_window", None) is None:  # a sliding layer without a window attends fully
            full.add("sliding_attention")
        other = sorted({str(t) for t in layer_types} - full)
        if other:
            problems.append(
                f"layer_types has {other} layers ({sum(t not in full for t in layer_types)} of "
                f"{len(layer_types)}): only 'full_attention' runs on packed causal attention. Set every entry "
                "to 'full_attention' (Qwen2/Qwen3: use_sliding_window=False) if the model may train without them"
            )
    window = getattr(cfg, "sliding_window", None)
    if window is not None and layer_types is None and getattr(cfg, "use_sliding_window", True):
        problems.append(
            f"sliding_window={window}: sliding-window attention is not supported. Set sliding_window=None "
            "(config_overrides={'sliding_window': None}); for sequences no longer than the window this is "
            "the same model"
        )
    chunk = getattr(cfg, "attention_chunk_size", None)
    if chunk is not None:
        problems.append(
            f"attention_chunk_size={chunk}: chunked attention is not supported; set attention_chunk_size=None"
        )
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    if softcap is not None:
        problems.append(
            f"attn_logit_softcapping={softcap}: soft-capped attention logits are not supported; set it to None"
        )
    if getattr(cfg, "is_causal", True) is False:
        problems.append("is_causal=False: only causal attention is supported; set is_causal=True")
    if training:
        for field in DROPOUT_FIELDS:
            p = getattr(cfg, field, None)
            if isinstance(p, (int, float)) and p > 0:
                problems.append(f"{field}={p}: attention dropout is not supported; set {field}=0.0")
    attn_config = getattr(cfg, "attn_config", None)
    attn_alibi = (
        attn_config.get("alibi") if isinstance(attn_config, dict) else getattr(attn_config, "alibi", None)
    )
    if (
        getattr(cfg, "alibi", False) is True
        or attn_alibi is True
        or getattr(cfg, "position_embedding_type", None) == "alibi"
        or getattr(cfg, "model_type", None) in ALIBI_MODEL_TYPES
    ):
        problems.append(
            f"ALiBi position biases (model_type={getattr(cfg, 'model_type', None)!r}) are not supported: the "
            "attention adds no bias to its scores"
        )
    for field, kind in _rope_types(cfg):
        if any(
            kind == bad or kind.startswith(f"{bad}_") or kind.endswith(f"_{bad}")
            for bad in BATCH_DEPENDENT_ROPE
        ):
            problems.append(
                f"{field} rope_type={kind!r} rescales the rotary frequencies with the largest position of the "
                "whole batch, so packed and sharded sequences would rotate differently from sequences alone; use "
                "a static RoPE ('default', 'linear', 'llama3', 'yarn')"
            )
    return problems


def _raise(problems: list[str], what: str) -> None:
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(
            f'{what} cannot train with attn_implementation="{ATTN_IMPLEMENTATION}" (packed causal attention):\n'
            f"{listed}"
        )


def check_config(config: Any, *, training: bool = True) -> None:
    """Raise a :class:`ConfigError` naming every unsupported field of ``config`` (see :func:`config_problems`)."""
    _raise(config_problems(config, training=training), f"The {type(config).__name__}")


def model_problems(model: nn.Module) -> list[str]:
    """What a built model does that packed attention cannot (beyond its config's fields)."""
    problems = []
    if (problem := _class_problem(type(model))) is not None:
        problems.append(problem)
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation != ATTN_IMPLEMENTATION:
        problems.append(
            f'the model runs attn_implementation="{implementation}"; build or load it with '
            f'attn_implementation="{ATTN_IMPLEMENTATION}" (or call model.set_attn_implementation("bytescale"))'
        )
    sinks = [name for name, m in model.named_modules() if isinstance(getattr(m, "sinks", None), nn.Parameter)]
    if sinks:
        problems.append(f"attention sinks ({sinks[0]}.sinks and {len(sinks) - 1} more) are not supported")
    return problems


def check_model(model: nn.Module, *, training: bool = True) -> None:
    """Raise a :class:`ConfigError` for an unsupported config field or model structure."""
    config = getattr(model, "config", None)
    problems = config_problems(config, training=training) if config is not None else []
    problems += [p for p in model_problems(model) if p not in problems]
    _raise(problems, type(model).__name__)
