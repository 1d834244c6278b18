"""The reference Llama's tensor parallelism: its collectives and the embedding gradient's size, on one process.

On torch's fake process group (``tests/_tp_comm.py``: collectives are issued but move no data),
``parallelize_llama`` on 2 lanes:

* ``CommDebugMode`` counts the all-reduces of one backward: 2 per block (the attention's input
  gradient and the MLP's, each summed once over the lanes, as Megatron does) plus the head's, for
  1 and 2 layers, untied and tied; the forward keeps its own (the embedding's, and one per
  row-wise projection).
* The vocabulary-sharded embedding's weight gradient is a ``Shard(0)`` DTensor whose local shard
  has this lane's rows only, equal in float64 to those rows of one process's gradient (the same
  weights, ids and output gradient), on both lanes of an uneven vocabulary, and no op of the
  backward produces a tensor with more elements than the lane's rows; the lane's forward rows
  are the single-process rows of the ids it holds and zeros for the others (the all-reduce that
  sums them over the lanes moves no data here; the multi-process suites check the sum).
* Its state dict keys the same ``embed.weight``, a ``Shard(0)`` DTensor, as before.
* A subclass with tensors of its own (Gemma's scaled embedding: an ``embed_scale`` buffer, here
  a parameter too) keeps them plain, so its forward combines them with the plain lookup; its
  output and weight gradient are the single-process ones of the lane's rows.
"""

from __future__ import annotations

import pytest
import torch
from _tp_comm import TP, LargestTensor, backward_all_reduces, fake_tp_mesh
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode

from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.parallel import parallelize_llama

VOCAB = 63  # uneven over 2 lanes: rows 0..31 and 32..62


def _model(layers: int, tied: bool = False) -> LlamaModel:
    from lightning_bytescale.engine.reference import causal_attention

    torch.manual_seed(0)
    config = LlamaConfig.preset("tiny", layers=layers, vocab=VOCAB, tie_embeddings=tied)
    return LlamaModel(config, attention_fn=causal_attention).double()


def _ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.cat([torch.randint(0, VOCAB, (20,), generator=g), torch.tensor([5, 5, 40, 40, 0, 62])])


@pytest.mark.parametrize("tied", [False, True])
def test_a_block_all_reduces_twice_in_backward_and_the_head_once(tied):
    counts = {}
    with fake_tp_mesh() as mesh:
        for layers in (1, 2):
            model = parallelize_llama(_model(layers, tied), mesh)
            with CommDebugMode() as forward:
                logits = model(_ids())
            counts[layers] = (backward_all_reduces(logits.sum()), forward.get_comm_counts())
    head = 0 if tied else 1  # the gathered logits' input gradient (a tied head is a replicated matmul)
    for layers, (backward, _) in counts.items():
        assert backward == 2 * layers + head, (layers, backward)
    assert counts[2][0] - counts[1][0] == 2  # per block
    for layers, (_, forward) in counts.items():
        by_name = {str(op): n for op, n in forward.items()}
        assert sum(n for name, n in by_name.items() if "all_reduce" in name or "allreduce" in name) == (
            2 * layers + head  # wo and w2 per block, the vocabulary-sharded lookup
        ), by_name
        assert sum(n for name, n in by_name.items() if "all_gather" in name) == head, by_name


@pytest.mark.parametrize("lane", range(TP))
def test_the_embedding_gradient_is_this_lanes_rows_of_one_process_gradient(lane):
    ref = _model(1)
    ids = _ids()
    grad_out = torch.randn(
        len(ids), ref.config.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(4)
    )
    ref_out = ref.embed(ids)
    ref_out.backward(grad_out)
    chunk = -(-VOCAB // TP)
    start, stop = lane * chunk, min((lane + 1) * chunk, VOCAB)
    with fake_tp_mesh(lane) as mesh:
        model = parallelize_llama(_model(1), mesh)
        assert list(model.state_dict()) == list(ref.state_dict())
        weight = model.embed.weight
        assert isinstance(weight, DTensor) and weight.placements == (Shard(0),)
        assert tuple(weight.to_local().shape) == (stop - start, ref.config.dim)
        with torch.no_grad():  # the fake group's scatter of rank 0's rows moved nothing
            weight.to_local().copy_(ref.embed.weight[start:stop])
        out = model.embed(ids)
        mine = (ids >= start) & (ids < stop)
        assert not isinstance(out, DTensor)
        assert torch.equal(out, torch.where(mine[:, None], ref_out.detach(), torch.zeros_like(ref_out)))
        with LargestTensor() as largest:
            out.backward(grad_out)
        grad = weight.grad
        assert isinstance(grad, DTensor) and grad.placements == (Shard(0),), grad
        local = grad.to_local()
        assert tuple(local.shape) == (stop - start, ref.config.dim)
        assert (local - ref.embed.weight.grad[start:stop]).abs().max().item() <= 1e-12
        assert local.abs().sum() > 0 and ref.embed.weight.grad[start:stop].abs().sum() > 0
        # nothing the size of the whole [V, dim] gradient: at most this lane's rows
        assert largest.numel <= (stop - start) * ref.config.dim < VOCAB * ref.config.dim, largest.numel


class ScaledEmbedding(nn.Embedding):
    """Gemma's scaled embedding (transformers' ``Gemma3TextScaledWordEmbedding``): a buffer times the lookup."""

    def __init__(self, num: int, dim: int, scale: float) -> None:
        super().__init__(num, dim, dtype=torch.float64)
        self.register_buffer("embed_scale", torch.tensor(scale, dtype=torch.float64), persistent=False)
        self.offset = nn.Parameter(torch.full((dim,), 0.25, dtype=torch.float64))  # a parameter of its own

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype) + self.offset


@pytest.mark.parametrize("lane", range(TP))
def test_a_subclass_with_tensors_of_its_own_keeps_them_plain_and_its_forward_runs(lane):
    """``distribute_module`` replicates an embedding's other tensors as DTensors; the plain lookup could not mix with them."""
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_bytescale.parallel import VocabParallelEmbedding

    torch.manual_seed(0)
    ref = ScaledEmbedding(VOCAB, 8, scale=8**0.5)
    ids = _ids()
    grad_out = torch.randn(len(ids), 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    ref_out = ref(ids)
    ref_out.backward(grad_out)
    chunk = -(-VOCAB // TP)
    start, stop = lane * chunk, min((lane + 1) * chunk, VOCAB)
    with fake_tp_mesh(lane) as mesh:
        torch.manual_seed(0)
        module = parallelize_module(ScaledEmbedding(VOCAB, 8, scale=8**0.5), mesh, VocabParallelEmbedding())
        assert isinstance(module.weight, DTensor) and module.weight.placements == (Shard(0),)
        assert not isinstance(module.embed_scale, DTensor) and not isinstance(module.offset, DTensor)
        assert isinstance(module.offset, nn.Parameter) and module.offset.requires_grad
        assert (
            module.embed_scale.item() == ref.embed_scale.item()
        )  # the fake group moved nothing: lane 0's own
        with torch.no_grad():  # the fake group's scatter of rank 0's rows moved nothing
            module.weight.to_local().copy_(ref.weight[start:stop])
        out = module(ids)
        mine = (ids >= start) & (ids < stop)
        expected = torch.where(mine[:, None], ref.weight[ids] * ref.embed_scale, 0.0) + ref.offset
        assert not isinstance(out, DTensor) and (out - expected).abs().max().item() <= 1e-12
        out.backward(grad_out)
        local = module.weight.grad.to_local()
        assert (local - ref.weight.grad[start:stop]).abs().max().item() <= 1e-12
        assert torch.equal(module.offset.grad, ref.offset.grad)


def test_embeddings_the_sharded_lookup_cannot_serve_are_refused():
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_bytescale.parallel import EmbeddingShardError, VocabParallelEmbedding

    class Renormed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4, max_norm=1.0)

    class Gathered(nn.Embedding):
        def forward(self, ids):  # no F.embedding on the weight
            return torch.zeros(*ids.shape, self.embedding_dim)

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = Gathered(8, 4)

    with fake_tp_mesh() as mesh:
        with pytest.raises(EmbeddingShardError, match=r"does not support \['max_norm'\]"):
            parallelize_module(Renormed(), mesh, {"embed": VocabParallelEmbedding()})
        holder = parallelize_module(Holder(), mesh, {"embed": VocabParallelEmbedding()})
        with pytest.raises(
            EmbeddingShardError, match="does not look its weight up with torch.nn.functional.embedding"
        ):
            holder.embed(torch.tensor([1, 2]))
