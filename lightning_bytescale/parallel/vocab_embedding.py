"""A vocabulary-sharded embedding whose weight gradient stays this lane's shard.

Tensor parallelism shards an untied embedding over the vocabulary: lane ``t`` of ``tp`` holds
rows ``[t * V / tp, (t + 1) * V / tp)`` of the ``[V, dim]`` weight, a ``Shard(0)`` DTensor
(DTensor's ``RowwiseParallel`` on ``nn.Embedding``, transformers' ``"embedding_rowwise"``). Their
lookup runs through DTensor's ``aten.embedding`` rule (each lane looks up the ids in its rows,
the others give zeros, the partial rows are summed over the lanes), but DTensor has no row-wise
rule for ``aten.embedding_dense_backward`` (torch 2.11 and 2.13): autograd computes the weight's
gradient as a whole ``[V, dim]`` tensor on every lane and only then keeps the lane's rows, 2 GiB
per lane in float32 for V = 128K, dim 4096, where the lane's rows are ``2 / tp`` GiB.

Here the weight keeps its placements (``Shard(0)`` on the tensor-parallel mesh: the same
parameter, state-dict key and checkpoint layout), and the lookup is an autograd function on the
lane's shard: forward, the lane's rows for the ids it holds, zeros for the others, one all-reduce
of the output over the tensor-parallel group (DTensor's rule does the same); backward, the
lane's rows of the gradient only (``aten.embedding_dense_backward`` on the local ids, the
single-process kernel, so each row is the same sum in the same order), handed back as a
``Shard(0)`` DTensor, with no communication: the output gradient is the same on every lane.

:class:`VocabParallelEmbedding` is the parallel style for ``parallelize_module`` plans (the
reference Llama's); :func:`shard_embedding_lookup` gives an embedding whose weight is already
sharded (transformers' ``"embedding_rowwise"``) the same lookup.  A subclass's own forward is
kept (Gemma's scaled embedding multiplies the lookup): only its
``torch.nn.functional.embedding`` call on the module's weight is replaced.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.overrides import TorchFunctionMode

from lightning_bytescale.parallel.errors import EmbeddingShardError

_EMBEDDING_SIGNATURE = inspect.signature(F.embedding)


def _shard_rows(weight: DTensor) -> tuple[int, int]:
    """``(first row, row count)`` of this lane's shard of a ``Shard(0)`` weight on a 1-D mesh.

    DTensor splits a dimension as ``torch.chunk`` does: ``ceil(V / tp)`` rows per lane, fewer
    (or none) on the last lanes when ``tp`` does not divide ``V``.
    """
    _check_weight(weight)
    vocab, lanes = weight.shape[0], weight.device_mesh.size()
    chunk = -(-vocab // lanes)
    start = min(chunk * weight.device_mesh.get_local_rank(), vocab)
    rows = weight.to_local().shape[0]
    if rows != max(0, min(chunk, vocab - start)):
        raise EmbeddingShardError(
            f"the embedding's local shard has {rows} rows where Shard(0) of {vocab} rows over {lanes} lanes "
            f"gives lane {weight.device_mesh.get_local_rank()} rows {start}..{min(start + chunk, vocab)}; shard the "
            "weight with distribute_tensor(weight, tp_mesh, [Shard(0)])"
        )
    return start, rows


def _check_weight(weight: Any) -> None:
    if (
        not isinstance(weight, DTensor)
        or weight.device_mesh.ndim != 1
        or tuple(weight.placements) != (Shard(0),)
    ):
        placements = getattr(weight, "placements", "a plain tensor")
        raise EmbeddingShardError(
            f"the vocabulary-sharded lookup needs the embedding weight as a Shard(0) DTensor on the 1-D "
            f"tensor-parallel mesh, got {placements}; shard it with VocabParallelEmbedding() in the "
            "parallelize_module plan (or transformers' 'embedding_rowwise')"
        )


class _ShardLookup(torch.autograd.Function):
    """``ids [...] -> [..., dim]``: this lane's rows, summed over the lanes; the weight's gradient a ``Shard(0)`` DTensor."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: DTensor, padding_idx: int | None) -> torch.Tensor:  # type: ignore[override]
        start, rows = _shard_rows(weight)
        local = weight.to_local()
        local_ids = ids - start
        outside = (local_ids < 0) | (local_ids >= rows)
        local_ids = local_ids.masked_fill(outside, 0)
        if rows:
            out = F.embedding(local_ids, local).masked_fill_(outside.unsqueeze(-1), 0)
        else:  # a lane without rows (tp > V / ceil(V / tp)) looks nothing up
            out = local.new_zeros((*ids.shape, local.shape[1]))
        dist.all_reduce(out, group=weight.device_mesh.get_group())
        pad = -1 if padding_idx is None else padding_idx - start
        ctx.save_for_backward(local_ids, outside)
        ctx.rows, ctx.pad = rows, pad if 0 <= pad < rows else -1
        ctx.layout = (weight.device_mesh, weight.placements, weight.shape, weight.stride())
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[None, DTensor, None]:  # type: ignore[override]
        local_ids, outside = ctx.saved_tensors
        # the ids other lanes hold point at row 0 here with a zero gradient: adding 0.0 leaves it exact
        grad_out = grad_out.masked_fill(outside.unsqueeze(-1), 0)
        if ctx.rows:
            grad = torch.ops.aten.embedding_dense_backward(grad_out, local_ids, ctx.rows, ctx.pad, False)
        else:
            grad = grad_out.new_zeros((0, grad_out.shape[-1]))
        mesh, placements, shape, stride = ctx.layout
        return (
            None,
            DTensor.from_local(grad, mesh, placements, run_check=False, shape=shape, stride=stride),
            None,
        )


def vocab_parallel_lookup(ids: torch.Tensor, weight: DTensor, padding_idx: int | None = None) -> torch.Tensor:
    """``F.embedding(ids, weight, padding_idx)`` for a ``Shard(0)`` DTensor weight: a plain, replicated output."""
    if isinstance(ids, DTensor):
        ids = ids.to_local()
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return _ShardLookup.apply(ids, weight, padding_idx)


def _check_module(module: nn.Module) -> None:
    if not isinstance(module, nn.Embedding):
        raise EmbeddingShardError(
            f"VocabParallelEmbedding shards an nn.Embedding (or a subclass), got {type(module).__name__}"
        )
    unsupported = [
        name
        for name, value in (("max_norm", module.max_norm), ("scale_grad_by_freq", module.scale_grad_by_freq),
                            ("sparse", module.sparse))
        if value
    ]  # fmt: skip
    if unsupported:
        raise EmbeddingShardError(
            f"the vocabulary-sharded lookup of {type(module).__name__} does not support {unsupported} (rows "
            "renormalised in place, gradients scaled by the batch's counts, sparse gradients); build the "
            "embedding without them or train it with tensor_parallel_size=1"
        )


class _LookupMode(TorchFunctionMode):
    """Inside the module's forward: its ``F.embedding`` on its own weight becomes :func:`vocab_parallel_lookup`."""

    def __init__(self, module: nn.Embedding) -> None:
        super().__init__()
        self.module = module
        self.lookups = 0

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.embedding:
            return func(*args, **kwargs)
        call = _EMBEDDING_SIGNATURE.bind(*args, **kwargs).arguments
        if call["weight"] is not self.module.weight:
            return func(*args, **kwargs)
        if call.get("max_norm") is not None or call.get("scale_grad_by_freq") or call.get("sparse"):
            raise EmbeddingShardError(
                f"{type(self.module).__name__} calls F.embedding with max_norm, scale_grad_by_freq or sparse, "
                "which the vocabulary-sharded lookup does not support; train it with tensor_parallel_size=1"
            )
        self.lookups += 1
        return vocab_parallel_lookup(call["input"], call["weight"], call.get("padding_idx"))


def shard_embedding_lookup(module: nn.Embedding) -> nn.Embedding:
    """Give ``module`` (weight already a ``Shard(0)`` DTensor on the TP mesh) the lookup of this module; returns it.

    Wraps ``module.forward`` so that the subclass's forward still runs and only its
    ``F.embedding`` on ``module.weight`` is replaced; a forward that never calls it is refused
    (its gradient would be DTensor's whole ``[V, dim]`` one).
    """
    _check_module(module)
    _check_weight(module.weight)
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        mode = _LookupMode(module)
        with mode:
            out = original(*args, **kwargs)
        if not mode.lookups:
            raise EmbeddingShardError(
                f"{type(module).__name__}.forward does not look its weight up with torch.nn.functional.embedding, "
                "so the vocabulary-sharded lookup cannot replace it"
            )
        return out

    module.forward = forward  # type: ignore[method-assign]
    return module


class VocabParallelEmbedding(ParallelStyle):
    """``RowwiseParallel(input_layouts=Replicate())`` for ``nn.Embedding`` with a ``Shard(0)`` weight gradient.

    The weight is distributed as ``RowwiseParallel`` does (``Shard(0)`` over the vocabulary, rank
    ``src_data_rank``'s values), the ids are taken as they are on every lane (replicated), and
    the output is a plain replicated tensor; the lookup is :func:`shard_embedding_lookup`'s.  A
    subclass's other tensors (Gemma's ``embed_scale`` buffer) get rank 0's values, as
    ``RowwiseParallel`` gives them, but stay plain tensors, so its forward can combine them with
    the plain lookup.
    ``parallelize_module(..., src_data_rank=None)`` makes every lane keep its own rows instead.
    """

    def _partition(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        if name == "":  # the module itself, not a submodule
            weight = module.weight
            module.register_parameter(
                "weight",
                nn.Parameter(
                    distribute_tensor(weight, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank),
                    requires_grad=weight.requires_grad,
                ),
            )

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        _check_module(module)
        if getattr(device_mesh, "ndim", None) != 1:
            raise EmbeddingShardError(
                f"VocabParallelEmbedding takes the 1-D tensor-parallel mesh, got {device_mesh!r}"
            )
        distribute_module(module, device_mesh, self._partition)
        _plain_replicas(module)
        return shard_embedding_lookup(module)  # type: ignore[arg-type]


def _plain_replicas(module: nn.Module) -> None:
    """Every tensor of ``module`` but its weight back to a plain tensor: the replicated DTensor's local copy.

    ``distribute_module`` makes the module's other parameters and buffers (Gemma's
    ``embed_scale``) ``Replicate()`` DTensors of rank 0's values, as ``RowwiseParallel`` does; but
    the lookup's output here is a plain tensor, and a forward that combines the two
    (``lookup * self.embed_scale``) fails with mixed ``torch.Tensor`` and ``DTensor``.  Plain
    replicas are what the model's other unsharded tensors (the norms) are.
    """
    for sub in module.modules():
        for name, t in list(sub._parameters.items()):
            if isinstance(t, DTensor) and not (sub is module and name == "weight"):
                sub._parameters[name] = nn.Parameter(t.to_local().detach(), requires_grad=t.requires_grad)
        for name, t in list(sub._buffers.items()):
            if isinstance(t, DTensor):
                sub._buffers[name] = t.to_local().detach()


__all__ = ["VocabParallelEmbedding", "shard_embedding_lookup", "vocab_parallel_lookup"]
