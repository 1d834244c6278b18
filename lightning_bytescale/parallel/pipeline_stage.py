"""Pipeline stages of decoder models: a contiguous slice of the blocks, and each micro-batch's layout.

Stage ``p`` of ``P`` holds the blocks :func:`stage_layers` gives it (the first stage also the
embedding, the last also the final norm and the output head), under the model's own parameter
names, so a stage's ``named_parameters()`` are the whole model's restricted to that stage.
:class:`DecoderStage` is that split for any decoder made of "embedding, position tables, a list
of blocks, final norm, head"; a model family only says where these parts are and how one block
is called (:class:`LlamaStage` for the reference Llama here; Hugging Face decoders in
:mod:`lightning_bytescale.hf.pipeline`).

torch's pipeline schedules pass only tensors between stages (``[1, C]`` token ids into the first
stage, ``[1, C, dim]`` hidden states between stages, ``[1, C, vocab]`` logits out of the last),
but packed attention needs the micro-batch's layout (``cu_seqlens``, ring) and RoPE its positions.
Every stage of a pipeline builds the same micro-batches from the same plan
(:class:`~lightning_bytescale.parallel.pipeline_batch.PipelineStepBatch`), so the schedule hands
each stage only the micro-batch's slot number (a keyword argument, which torch passes to every
stage), and :meth:`DecoderStage.forward` looks the micro-batch up (:meth:`DecoderStage.bind`) and
runs its blocks on the micro-batch's own slots inside that layout's
:func:`~lightning_bytescale.packed_attention.attention_context`.  The padding slots after them
(up to C) run the blocks separately, as one causal sequence of their own, so no real token sees a
padding slot and a ring exchanges only its own slots (:func:`padded_attention` is the same
separation for a single attention call).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
        with attention_context(_one_sequence(pad)):
            padding = attention_fn(q[slots:], k[slots:], v[slots:])
        return torch.cat([real, padding])

    return run


def _one_sequence(length: int) -> AttentionLayout:
    return AttentionLayout(cu_seqlens=(0, length), seq_lens=(length,))


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


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` under the dotted ``path`` of ``root``, with plain containers on the way."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        if not hasattr(node, name):
            node.add_module(name, nn.Module())
        node = getattr(node, name)
    node.add_module(leaf, module)


class DecoderStage(nn.Module):
    """``forward(x [1, C] or [1, C, dim], *, slot [1]) -> [1, C, dim]`` (or ``[1, C, vocab]`` on the last stage).

    One stage of a decoder given by its parts (shared with the whole model, not copied), each
    registered under its dotted name in the whole model (``names``: ``"embed"``, ``"blocks"``,
    ``"norm"``, ``"head"``, and optionally ``"rope"`` for a module holding the position tables,
    which every stage keeps).  A subclass says how the tables are computed (:meth:`rope`) and
    how one block runs (:meth:`run_block`), on ``[1, T, dim]`` hidden states.  Tied embeddings
    must be refused by the subclass: the first and the last stage would each hold the one
    matrix, and its gradient would need a sum across stages.
    """

    hidden_size: int
    vocab_size: int

    def __init__(
        self,
        *,
        embed: nn.Module,
        blocks: Sequence[nn.Module],
        norm: nn.Module,
        head: nn.Module,
        names: dict[str, str],
        stage: int,
        stages: int,
        hidden_size: int,
        vocab_size: int,
        rope: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.stage, self.stages = stage, stages
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.layers = stage_layers(len(blocks), stages, stage)
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self._names = dict(names)
        if self.is_first:
            _place(self, names["embed"], embed)
        _place(self, names["blocks"], nn.ModuleDict({str(i): blocks[i] for i in self.layers}))
        if rope is not None:
            _place(self, names["rope"], rope)
        if self.is_last:
            _place(self, names["norm"], norm)
            _place(self, names["head"], head)
        self._micro_batches: Sequence[PackedMicroBatch] = ()

    def part(self, name: str) -> nn.Module:
        """The part ``name`` (``"embed"``, ``"blocks"``, ``"norm"``, ``"head"``, ``"rope"``) of this stage."""
        return self.get_submodule(self._names[name])

    def rope(self, position_ids: torch.Tensor, h: torch.Tensor) -> Any:
        """The position tables of ``position_ids [T]`` for hidden states ``h [1, T, dim]``."""
        raise NotImplementedError

    def run_block(
        self, block: nn.Module, h: torch.Tensor, tables: Any, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """``block`` on ``h [1, T, dim]`` with the tables of ``position_ids [T]``: ``[1, T, dim]``."""
        raise NotImplementedError

    def bind(self, micro_batches: Sequence[PackedMicroBatch]) -> None:
        """The step's micro-batches, in the pipeline order: ``slot`` ``i`` is ``micro_batches[i]``."""
        self._micro_batches = micro_batches

    def _blocks(self, h: torch.Tensor, position_ids: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
        tables = self.rope(position_ids, h)
        with attention_context(layout):
            for block in self.part("blocks").values():
                h = self.run_block(block, h, tables, position_ids)
        return h

    def forward(self, x: torch.Tensor, *, slot: torch.Tensor) -> torch.Tensor:
        mb = self._micro_batches[int(slot.reshape(-1)[0])]  # a host tensor: no device synchronisation
        h = self.part("embed")(x) if self.is_first else x
        positions = mb.position_ids.to(h.device)
        slots, total = mb.layout.num_slots, h.shape[1]
        parts = [self._blocks(h[:, :slots], positions[:slots], mb.layout)] if slots else []
        if slots < total:  # the padding slots: one causal sequence of their own
            parts.append(self._blocks(h[:, slots:], positions[slots:], _one_sequence(total - slots)))
        h = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if self.is_last:
            h = self.part("head")(self.part("norm")(h))
        return h


_LLAMA_NAMES = {"embed": "embed", "blocks": "blocks", "norm": "norm", "head": "lm_head"}


class LlamaStage(DecoderStage):
    """A :class:`DecoderStage` of the reference :class:`~lightning_bytescale.models.llama.LlamaModel`.

    Tied embeddings (``LlamaConfig(tie_embeddings=True)``) are refused.
    """

    def __init__(self, model: LlamaModel, stage: int, stages: int) -> None:
        if model.lm_head is None:
            raise PipelineModelError(
                "the model ties its input embedding to its output head (tie_embeddings=True); with pipeline "
                "stages the first and the last stage would both hold it. Use LlamaConfig(tie_embeddings=False)"
            )
        super().__init__(
            embed=model.embed,
            blocks=list(model.blocks),
            norm=model.norm,
            head=model.lm_head,
            names=_LLAMA_NAMES,
            stage=stage,
            stages=stages,
            hidden_size=model.config.dim,
            vocab_size=model.config.vocab,
        )
        self.config = model.config
        self.attention_fn = model.attention_fn

    def rope(self, position_ids: torch.Tensor, h: torch.Tensor) -> Any:
        return model_rope(self.config, position_ids, h[0])

    def run_block(
        self, block: nn.Module, h: torch.Tensor, tables: Any, position_ids: torch.Tensor
    ) -> torch.Tensor:
        cos, sin = tables
        return block(h[0], cos, sin, self.attention_fn).unsqueeze(0)


__all__ = ["DecoderStage", "LlamaStage", "padded_attention", "stage_layers"]
