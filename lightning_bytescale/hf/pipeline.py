"""Pipeline stages of Hugging Face decoders: :class:`HFDecoderStage`.

A Llama-layout causal LM (``model.model.embed_tokens``, ``model.model.layers``,
``model.model.norm``, ``model.model.rotary_emb``, ``model.lm_head``: Llama, Qwen2, Qwen3,
Mistral) splits into :class:`~lightning_bytescale.parallel.DecoderStage`\\ s like the reference
Llama: stage ``p`` holds its contiguous run of layers (the first stage also the embedding, the
last also the final norm and ``lm_head``; every stage the rotary embedding, which has no
parameters), under the model's own names (``model.layers.3.mlp...``), so the stage's parameters
are the whole model's restricted to it.  A stage computes the rotary tables from the
micro-batch's ``position_ids`` and calls each decoder layer as the model's own forward does
(``attention_mask=None``, ``position_embeddings``, ``position_ids``); attention goes through
``attn_implementation="bytescale"``, which reads the micro-batch layout the stage installs.

Refused by name (:class:`~lightning_bytescale.parallel.PipelineModelError`): tied embeddings
(the first and the last stage would both hold the matrix), a model type whose forward does
more than "embed, layers, norm, head" (embedding or logit multipliers, soft-capping: another
split would be silently wrong), a layout without these parts, fewer layers than stages, and an
attention implementation other than ``"bytescale"``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_bytescale.hf.attention import ATTN_IMPLEMENTATION
from lightning_bytescale.parallel import DecoderStage, PipelineModelError

# Model types whose CausalLM forward is exactly lm_head(norm(layers(embed_tokens(ids)))) with the
# rotary tables of position_ids, each layer called with (hidden, position_embeddings, position_ids).
PIPELINE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

HF_STAGE_NAMES = {
    "embed": "model.embed_tokens",
    "blocks": "model.layers",
    "norm": "model.norm",
    "rope": "model.rotary_emb",
    "head": "lm_head",
}


def _part(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError as err:
        raise PipelineModelError(
            f"{type(model).__name__} has no {path!r}: HFDecoderStage splits causal LMs laid out as model.model."
            f"embed_tokens / .layers / .norm / .rotary_emb and model.lm_head (model types {PIPELINE_MODEL_TYPES}). "
            "Train this model with pipeline_parallel_size=1"
        ) from err


def _check_splittable(model: nn.Module, stages: int) -> dict[str, nn.Module]:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in PIPELINE_MODEL_TYPES:
        raise PipelineModelError(
            f"HFDecoderStage cannot split model_type={model_type!r} ({type(model).__name__}) exactly: only "
            f"{PIPELINE_MODEL_TYPES}, whose forward is embed, layers, norm and head and nothing else, are split. "
            "Train this model with pipeline_parallel_size=1"
        )
    parts = {key: _part(model, path) for key, path in HF_STAGE_NAMES.items()}
    if not isinstance(parts["blocks"], nn.ModuleList):
        raise PipelineModelError(
            f"{type(model).__name__}.model.layers is a {type(parts['blocks']).__name__}, not an nn.ModuleList of "
            "decoder layers; HFDecoderStage cannot split it. Train this model with pipeline_parallel_size=1"
        )
    layers = int(getattr(config, "num_hidden_layers", len(parts["blocks"])))
    if layers != len(parts["blocks"]):
        raise PipelineModelError(
            f"the config has num_hidden_layers={layers} but model.model.layers holds {len(parts['blocks'])} "
            "layers; build the model from its config unchanged"
        )
    head, embed = parts["head"], parts["embed"]
    if getattr(config, "tie_word_embeddings", False) or head.weight is embed.weight:
        raise PipelineModelError(
            "the model ties its input embedding to its output head (tie_word_embeddings=True); with pipeline "
            "stages the first and the last stage would both hold it. Train a model with an untied head "
            "(config_overrides={'tie_word_embeddings': False} for a model built from its config), or use "
            "pipeline_parallel_size=1"
        )
    attn = getattr(config, "_attn_implementation", None)
    if attn != ATTN_IMPLEMENTATION:
        raise PipelineModelError(
            f'the model runs attn_implementation="{attn}"; a pipeline stage runs packed micro-batches whose layout '
            f'only "{ATTN_IMPLEMENTATION}" reads. Build it with attn_implementation="{ATTN_IMPLEMENTATION}"'
        )
    if stages > layers:
        raise PipelineModelError(
            f"the model has {layers} layers, fewer than the {stages} pipeline stages: every stage needs at least "
            f"one layer. Use pipeline_parallel_size <= {layers}"
        )
    return parts


class HFDecoderStage(DecoderStage):
    """Stage ``stage`` of ``stages`` of a Hugging Face causal LM (module docstring); modules shared, not copied.

    ``forward(x [1, C] or [1, C, hidden], *, slot [1]) -> [1, C, hidden]`` (``[1, C, vocab]`` on
    the last stage), as :class:`~lightning_bytescale.parallel.DecoderStage`.
    """

    def __init__(self, model: nn.Module, stage: int, stages: int) -> None:
        parts = _check_splittable(model, stages)
        config = model.config
        super().__init__(
            embed=parts["embed"],
            blocks=list(parts["blocks"]),
            norm=parts["norm"],
            head=parts["head"],
            rope=parts["rope"],
            names=HF_STAGE_NAMES,
            stage=stage,
            stages=stages,
            hidden_size=int(config.hidden_size),
            vocab_size=int(config.vocab_size),
        )
        self.config = config

    def rope(self, position_ids: torch.Tensor, h: torch.Tensor) -> Any:
        return self.part("rope")(h, position_ids[None])

    def run_block(
        self, block: nn.Module, h: torch.Tensor, tables: Any, position_ids: torch.Tensor
    ) -> torch.Tensor:
        out = block(
            h,
            attention_mask=None,
            position_embeddings=tables,
            position_ids=position_ids[None],
            use_cache=False,
        )
        return out[0] if isinstance(out, tuple) else out


__all__ = ["HF_STAGE_NAMES", "PIPELINE_MODEL_TYPES", "HFDecoderStage"]
