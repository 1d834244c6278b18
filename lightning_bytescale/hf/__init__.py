"""Hugging Face models on packed micro-batches: ``attn_implementation="bytescale"`` and `HFCausalLM`.

``import lightning_bytescale.hf`` registers ``"bytescale"`` with transformers' attention and
mask interfaces, so ``AutoModelForCausalLM.from_config(cfg, attn_implementation="bytescale")``
and ``.from_pretrained(path, attn_implementation="bytescale")`` run local variable-length or
zigzag ring attention on packed ``input_ids [1, T]`` / ``position_ids [1, T]``.
:class:`HFCausalLM` (imported on first use: it needs Lightning) is the LightningModule that
builds or loads such a model and trains it under ``ByteScaleStrategy``; :func:`parallelize_hf`
shards one over a tensor-parallel mesh with transformers' own plan, and :class:`HFDecoderStage`
is one pipeline stage of a Llama-layout decoder (Llama, Qwen2, Qwen3, Mistral);
:func:`export_pretrained` writes an ``HFCausalLM``'s sharded checkpoint (pipelines, tensor
parallelism) as a Hugging Face folder.

transformers is an optional dependency: ``pip install "lightning-bytescale[hf]"``.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "lightning_bytescale.hf needs transformers 5: pip install 'lightning-bytescale[hf]' "
        "(or pip install 'transformers>=5,<6')"
    ) from err

from lightning_bytescale._lazy import lazy_getattr
from lightning_bytescale.hf.attention import (
    ATTN_IMPLEMENTATION,
    bytescale_attention,
    bytescale_mask,
    layout_from_positions,
    register,
)
from lightning_bytescale.hf.checks import check_config, check_model, config_problems, model_problems
from lightning_bytescale.packed_attention.calls import count_attention_calls

register()

_LAZY = {
    "HFCausalLM": "lightning_bytescale.hf.module",
    "HFDecoderStage": "lightning_bytescale.hf.pipeline",
    "LoadReport": "lightning_bytescale.hf.module",
    "ModelSource": "lightning_bytescale.hf.loading",
    "OptimizerOptions": "lightning_bytescale.hf.optim",
    "export_pretrained": "lightning_bytescale.hf.export",
    "parallelize_hf": "lightning_bytescale.hf.tensor_parallel",
}


__getattr__ = lazy_getattr(globals(), _LAZY)


__all__ = [
    "ATTN_IMPLEMENTATION",
    "HFCausalLM",
    "HFDecoderStage",
    "LoadReport",
    "ModelSource",
    "OptimizerOptions",
    "bytescale_attention",
    "bytescale_mask",
    "check_config",
    "check_model",
    "config_problems",
    "count_attention_calls",
    "export_pretrained",
    "layout_from_positions",
    "model_problems",
    "parallelize_hf",
    "register",
]
