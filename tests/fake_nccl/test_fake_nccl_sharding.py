"""Sharding a model on fake NCCL: meta-device loading and the vocabulary-sharded embedding.

A model that needs tensor parallelism is built on the meta device, sharded there, given storage
for its own shards on the GPU and filled (``parallel/materialize.py``): global rank 0 holds the
whole weights on its host (a checkpoint read there, ``HFCausalLM(tensor_parallel=True)``), and
each tensor goes to its GPU and is broadcast from there, one at a time, each rank keeping its
part; a rank that draws nothing (``materialize_sharded`` off rank 0) only receives.  Before any
tensor travels, rank 0 tells every rank whether its weights fit, in an object broadcast on the
GPU.  The vocabulary-sharded embedding (``parallel/vocab_embedding.py``) scatters rank 0's rows
over the lanes when it is applied (and broadcasts a subclass's other tensors, Gemma's
``embed_scale``), and its lookup sums the lanes' rows in one all-reduce.  The values are checked
on rank 0, where the tier's world gives them (a broadcast and a scatter move nothing to other
ranks); autograd cannot run on fake CUDA, so the lookup's forward is what runs here
(``tests/parallel/test_tensor_parallel_comm.py`` checks its backward on the host).
"""

from __future__ import annotations

import pytest
import torch
from _fake_nccl import CUDA, RECORDED, fake_nccl
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from lightning_bytescale.errors import ConfigError
from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.parallel import VocabParallelEmbedding
from lightning_bytescale.parallel.dims import ParallelDims
from lightning_bytescale.parallel.materialize import (
    fill_from_whole,
    materialize_sharded,
    named_tensors,
    to_empty_keeping_ties,
)
from lightning_bytescale.parallel.tensor_parallel import parallelize_llama

H2D = "a host-to-device copy that is not non-blocking from pinned memory"
CONFIG = LlamaConfig.preset("tiny", layers=1, vocab=63, tie_embeddings=False)  # 63 rows: uneven over 2 lanes


def _sharded_on_meta(pmesh) -> LlamaModel:
    with torch.device("meta"):
        model = LlamaModel(CONFIG)
    return parallelize_llama(model, pmesh.tp_mesh)


def _part(whole: torch.Tensor, t: torch.Tensor, lane: int) -> torch.Tensor:
    """The part of ``whole`` a rank holds in ``t``: its ``Shard(d)`` chunk, or all of it."""
    if isinstance(t, DTensor) and t.placements[0].is_shard():
        return whole.chunk(t.device_mesh.size(), dim=t.placements[0].dim)[lane]
    return whole


@pytest.mark.covers(
    "parallel/materialize.py:_copy_part:broadcast",
    "parallel/materialize.py:fill_from_whole:broadcast_object_list",
)
def test_rank_0s_host_weights_reach_the_shards_through_its_gpu_one_tensor_at_a_time():
    torch.manual_seed(0)
    host = dict(named_tensors(LlamaModel(CONFIG)))  # a checkpoint read on rank 0's host
    with fake_nccl(world_size=2, rank=0) as mode:
        pmesh = ParallelDims(2, tensor_parallel=2).build("cuda")
        model = _sharded_on_meta(pmesh)
        to_empty_keeping_ties(model, CUDA)
        RECORDED.clear()
        mode.syncs.clear()
        fill_from_whole(model, host, src=0)
        tensors = named_tensors(model)
        held = {n: mode.value(t.to_local() if isinstance(t, DTensor) else t).clone() for n, t in tensors}
        devices = {(t.to_local() if isinstance(t, DTensor) else t).device for _, t in tensors}
        copies = [s.kind for s in mode.syncs]
    assert devices == {CUDA} and isinstance(model.embed.weight, DTensor)
    for name, t in tensors:  # each rank's part of rank 0's whole tensor, exactly
        assert torch.equal(held[name], _part(host[name], t, 0)), name
    # one whole tensor at a time: one copy to the GPU and one broadcast per tensor, after the object
    # broadcast (its sizes and its bytes, two copies and two broadcasts) that tells every rank the
    # weights fit
    assert copies == [H2D] * (2 + len(tensors))
    assert [c.function for c in RECORDED] == ["fill_from_whole"] * 2 + ["_copy_part"] * len(tensors)


def test_weights_that_do_not_fit_are_refused_on_every_rank_before_any_tensor_travels():
    torch.manual_seed(0)
    host = dict(named_tensors(LlamaModel(CONFIG)))
    host["norm.weight"] = host["norm.weight"].double()
    with fake_nccl(world_size=2, rank=0):
        pmesh = ParallelDims(2, tensor_parallel=2).build("cuda")
        model = _sharded_on_meta(pmesh)
        to_empty_keeping_ties(model, CUDA)
        RECORDED.clear()
        with pytest.raises(ConfigError, match=r"'norm.weight' is \(32,\) torch.float32 .* torch.float64"):
            fill_from_whole(model, host, src=0)
    assert [c.function for c in RECORDED] == ["fill_from_whole"] * 2  # the object broadcast only


@pytest.mark.covers("parallel/materialize.py:_copy_part:broadcast")
def test_a_rank_that_draws_nothing_receives_each_shard_on_its_gpu():
    with fake_nccl(world_size=4, rank=3) as mode:
        pmesh = ParallelDims(4, tensor_parallel=2).build("cuda")
        model = _sharded_on_meta(pmesh)
        RECORDED.clear()
        mode.syncs.clear()
        assert materialize_sharded(model, CUDA) == []
        tensors = named_tensors(model)
        devices = {(t.to_local() if isinstance(t, DTensor) else t).device for _, t in tensors}
        syncs = list(mode.syncs)
    assert devices == {CUDA} and not any(t.is_meta for _, t in tensors)
    assert [c.kind for c in RECORDED] == ["broadcast"] * len(tensors) and syncs == []


class ScaledEmbedding(nn.Embedding):
    """Gemma's scaled embedding (transformers' ``Gemma3TextScaledWordEmbedding``): a buffer times the lookup."""

    def __init__(self, num: int, dim: int, scale: float) -> None:
        super().__init__(num, dim)
        self.register_buffer("embed_scale", torch.tensor(scale), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


@pytest.mark.covers(
    "parallel/vocab_embedding.py:VocabParallelEmbedding._apply:distribute_module",
    "parallel/vocab_embedding.py:VocabParallelEmbedding._partition:distribute_tensor",
    "parallel/vocab_embedding.py:_ShardLookup.forward:all_reduce",
)
def test_the_vocabulary_sharded_embedding_scatters_its_rows_and_sums_the_lookup_on_the_gpu():
    torch.manual_seed(0)
    whole = ScaledEmbedding(63, 8, scale=8**0.5)  # rows 0..31 on lane 0, 32..62 on lane 1
    ids = torch.tensor([[0, 31, 32, 62, 5]])
    with fake_nccl(world_size=4, rank=0) as mode:
        pmesh = ParallelDims(4, tensor_parallel=2).build("cuda")
        module = mode.module_to_cuda(ScaledEmbedding(63, 8, scale=8**0.5))
        module.load_state_dict(whole.state_dict())
        start = len(RECORDED)
        parallelize_module(module, pmesh.tp_mesh, VocabParallelEmbedding())
        applied = [(c.function, c.kind) for c in RECORDED[start:]]
        rows = mode.value(module.weight.to_local()).clone()
        scale = module.embed_scale
        start = len(RECORDED)
        out = module(mode.cuda(ids))
        looked_up = [(c.function, c.kind) for c in RECORDED[start:]]
        value = mode.value(out).clone()
    assert applied == [
        ("VocabParallelEmbedding._partition", "scatter"),  # rank 0's rows, a shard per lane
        ("VocabParallelEmbedding._apply", "broadcast"),  # rank 0's embed_scale, kept a plain tensor
    ]
    assert looked_up == [("_ShardLookup.forward", "all_reduce")]
    assert torch.equal(rows, whole.weight.detach()[:32])
    assert not isinstance(scale, DTensor) and scale.device == CUDA and module.weight.placements == (Shard(0),)
    assert out.device == CUDA and not isinstance(out, DTensor)
    # lane 0's rows of the ids it holds, zeros for the others (the other lane adds nothing here)
    mine = (ids < 32).unsqueeze(-1)
    assert torch.equal(value, torch.where(mine, whole(ids).detach(), 0.0))
