"""Tensor parallelism for the reference Llama: one function, DTensor's own parallel styles.

:func:`parallelize_llama` shards the model Megatron-style with
:func:`torch.distributed.tensor.parallel.parallelize_module`, as a ``configure_model`` written for
Lightning's ``ModelParallelStrategy`` would: in every block the q, k, v projections and the
MLP's gate and up projections column-wise (each rank computes its own heads and its slice of
the hidden features), the attention output and MLP down projections row-wise (partial sums
all-reduced, so each block's output is replicated again).  The projections hand back local
tensors, so :func:`lightning_bytescale.attention` receives this rank's heads, ``[T, H / tp, D]``
and ``[T, Hkv / tp, D]``, and a ring exchanges only those (each TP lane with the same lane of
its ring peers).

The attention's and the MLP's inputs enter as replicated DTensors (``PrepareModuleInput``,
``use_local_output=False``): the column-wise projections that read one input hand back their
input gradients as partial sums, which add up as DTensors and are all-reduced once where the
input became a DTensor.  So a block's backward all-reduces twice (once for the attention's
input, once for the MLP's), as Megatron's does; with each projection taking a plain tensor it
would be once per projection, five times.  The norms before them stay plain replicated modules
that receive the all-reduced, replicated gradient.

Untied embeddings are sharded over the vocabulary with
:class:`~lightning_bytescale.parallel.vocab_embedding.VocabParallelEmbedding` (each lane's
rows looked up and summed over the lanes; the weight's gradient is computed as the lane's
``Shard(0)`` rows only) and the output head column-wise with its logits gathered, so the loss
sees the whole vocabulary on every lane; tied embeddings stay replicated (one weight cannot be
sharded two ways).  Norm weights stay plain replicated tensors: their inputs and output
gradients are replicated, so their gradients agree on every lane without a collective.

No sequence parallelism (activations between blocks are replicated) and no loss parallelism:
each TP lane holds the whole ``[T, vocab]`` logits of its micro-batch.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from lightning_bytescale.models.llama import LlamaModel
from lightning_bytescale.parallel.dims import check_heads
from lightning_bytescale.parallel.errors import ParallelDimsError
from lightning_bytescale.parallel.vocab_embedding import VocabParallelEmbedding


def _replicated_input(positional: int) -> PrepareModuleInput:
    """The first of ``positional`` arguments as a replicated DTensor (the rest as they are): its gradient is all-reduced once."""
    layouts = (Replicate(),) + (None,) * (positional - 1)
    return PrepareModuleInput(input_layouts=layouts, desired_input_layouts=layouts, use_local_output=False)


def llama_tp_plan(model: LlamaModel) -> dict[str, Any]:
    """The ``parallelize_module`` plan of :func:`parallelize_llama` (module name patterns -> styles)."""
    plan: dict[str, Any] = {
        "blocks.*.attn": _replicated_input(4),  # Attention.forward(x, cos, sin, attn)
        "blocks.*.attn.wq": ColwiseParallel(),
        "blocks.*.attn.wk": ColwiseParallel(),
        "blocks.*.attn.wv": ColwiseParallel(),
        "blocks.*.attn.wo": RowwiseParallel(),
        "blocks.*.mlp": _replicated_input(1),
        "blocks.*.mlp.w1": ColwiseParallel(),
        "blocks.*.mlp.w3": ColwiseParallel(),
        "blocks.*.mlp.w2": RowwiseParallel(),
    }
    if model.lm_head is not None:
        plan["embed"] = VocabParallelEmbedding()
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def parallelize_llama(model: LlamaModel, tp_mesh: Any) -> LlamaModel:
    """Shard ``model`` over the 1-D ``tp_mesh`` (``device_mesh["tensor_parallel"]``), in place; returns it.

    Refuses (:class:`~lightning_bytescale.parallel.errors.TensorParallelHeadsError`) heads or
    key/value heads that the TP size does not divide.  A mesh of one rank leaves the model as it is.
    """
    if not isinstance(model, LlamaModel):
        raise ParallelDimsError(
            f"parallelize_llama shards a lightning_bytescale LlamaModel, got {type(model).__name__}; for a "
            "Hugging Face model use lightning_bytescale.hf.parallelize_hf"
        )
    if getattr(tp_mesh, "ndim", None) != 1:
        raise ParallelDimsError(
            'parallelize_llama takes the 1-D tensor-parallel mesh (device_mesh["tensor_parallel"]), got '
            f"{tp_mesh!r}"
        )
    tp = tp_mesh.size()
    check_heads(model.config.heads, model.config.kv_heads, tp, model="LlamaModel")
    if tp > 1:
        parallelize_module(model, tp_mesh, llama_tp_plan(model))
    return model


__all__ = ["llama_tp_plan", "parallelize_llama"]
