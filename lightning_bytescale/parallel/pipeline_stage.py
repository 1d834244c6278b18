"""A pipeline stage of the reference Llama: a contiguous slice of its blocks, and each micro-batch's layout.

Stage ``p`` of ``P`` holds the blocks :func:`stage_layers` gives it (the first stage also the
embedding, the last also the final norm and the output head), under the model's own parameter
names, so a stage's ``named_parameters()`` are the whole model's restricted to that stage.

torch's pipeline schedules pass only tensors between stages (``[1, C]`` token ids into the first
stage, ``[1, C, dim]`` hidden states between stages, ``[1, C, vocab]`` logits out of the last),
but packed attention needs the micro-batch's layout (``cu_seqlens``, ring) and RoPE its positions.
Every stage of a pipeline builds the same micro-batches from the same plan
(:class:`~lightning_bytescale.parallel.pipeline_batch.PipelineStepBatch`), so the schedule hands
each stage only the micro-batch's slot number (a keyword argument, which torch passes to every
stage), and :meth:`LlamaStage.forward` looks the micro-batch up (:meth:`LlamaStage.bind`) and runs
its blocks inside that layout's :func:`~lightning_bytescale.packed_attention.attention_context`.
The layout covers the micro-batch's own slots; the padding slots after them (up to C) get
attention as one causal sequence of their own (:func:`padded_attention`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_bytescale.engine.batch import PackedMicroBatch
from lightning_bytescale.models.llama import AttentionFn, LlamaModel, model_rope
from lightning_bytescale.packed_attention import attention_context
from lightning_bytescale.packed_attention.layout import AttentionLayout
from lightning_bytescale.parallel.errors import PipelineModelError


def padded_attention(attention_fn: AttentionFn, slots: int) -> AttentionFn:
    """``attention_fn`` on the first ``slots`` rows (the current layout's), and on the rest as one padding sequence.

    The two parts never see each other, so the real rows' outputs are those of the unpadded
    micro-batch (a ring exchanges only its own slots), and the padding rows attend only to
    padding.
    """

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        real = attention_fn(q[:slots], k[:slots], v[:slots])
        pad = q.shape[0] - slots
        with attention_context(AttentionLayout(cu_seqlens=(0, pad), seq_lens=(pad,))):
            padding = attention_fn(q[slots:], k[slots:], v[slots:])
        return torch.cat([real, padding])

    return run


def stage_layers(layers: int, stages: int, stage: int) -> range:
    """Blocks of ``stage``: ``layers`` split into ``stages`` contiguous runs, the first ones one longer."""
    if stages < 1 or not 0 <= stage < stages:
        raise PipelineModelError(f"stage {stage} is not one of {stages} pipeline stages")
    if layers < stages:
        raise PipelineModelError(
            f"the model has {layers} blocks, fewer than the {stages} pipeline stages: every stage needs at least "
            f"one block. Use pipeline_parallel_size <= {layers}"
        )
    base, extra = divmod(layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


class LlamaStage(nn.Module):
    """``forward(x [1, C] or [1, C, dim], *, slot [1]) -> [1, C, dim]`` (or ``[1, C, vocab]`` on the last stage).

    Built from a whole :class:`~lightning_bytescale.models.llama.LlamaModel` (its modules are
    shared, not copied).  Tied embeddings are refused: the first and the last stage would each
    hold the one matrix, and its gradient would need a sum across stages.
    """

    def __init__(self, model: LlamaModel, stage: int, stages: int) -> None:
        super().__init__()
        if model.lm_head is None:
            raise PipelineModelError(
                "the model ties its input embedding to its output head (tie_embeddings=True); with pipeline "
                "stages the first and the last stage would both hold it. Use LlamaConfig(tie_embeddings=False)"
            )
        self.config = model.config
        self.attention_fn = model.attention_fn
        self.stage, self.stages = stage, stages
        self.layers = stage_layers(len(model.blocks), stages, stage)
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self.embed = model.embed if self.is_first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in self.layers})
        self.norm = model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self._micro_batches: Sequence[PackedMicroBatch] = ()

    def bind(self, micro_batches: Sequence[PackedMicroBatch]) -> None:
        """The step's micro-batches, in the pipeline order: ``slot`` ``i`` is ``micro_batches[i]``."""
        self._micro_batches = micro_batches

    def forward(self, x: torch.Tensor, *, slot: torch.Tensor) -> torch.Tensor:
        mb = self._micro_batches[int(slot.reshape(-1)[0])]  # a host tensor: no device synchronisation
        h = self.embed(x[0]) if self.embed is not None else x[0]
        cos, sin = model_rope(self.config, mb.position_ids.to(h.device), h)
        slots = mb.layout.num_slots
        attn = self.attention_fn if slots == h.shape[0] else padded_attention(self.attention_fn, slots)
        with attention_context(mb.layout):
            for block in self.blocks.values():
                h = block(h, cos, sin, attn)
        if self.norm is not None and self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return h.unsqueeze(0)


__all__ = ["LlamaStage", "padded_attention", "stage_layers"]
