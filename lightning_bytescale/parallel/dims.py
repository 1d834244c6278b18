"""The parallel dimensions of a run, validated once: world = data_parallel x tensor_parallel, and its mesh.

ByteScale's HDP ranks are the units the planner plans for.  With tensor parallelism an HDP rank
is a *TP group*: ``tensor_parallel`` consecutive global ranks (TP is the inner dimension, so a
group sits inside one node, where its per-layer all-reduces run over NVLink), all running the
same micro-batches on their own shard of every layer's heads and features.  So a world of ``W``
ranks has ``W // tensor_parallel`` HDP ranks, and global rank ``g`` is

* HDP rank ``g // tensor_parallel`` (its coordinate on ``"data_parallel"``), and
* TP lane ``g % tensor_parallel`` (its coordinate on ``"tensor_parallel"``).

The 2-D :class:`~torch.distributed.device_mesh.DeviceMesh` uses Lightning
``ModelParallelStrategy``'s dimension names and layout (``("data_parallel",
"tensor_parallel")``, TP inner), so a model written for that strategy's
``self.device_mesh["tensor_parallel"]`` and ``["data_parallel"]`` finds the same mesh here.  It
is built once at set-up (:meth:`ParallelDims.build`); its sub-groups -- one data-parallel group
per lane, one TP group per HDP rank -- are the only process groups it adds, and rings never add
one: a ring over HDP ranks ``[h0, h1, ...]`` runs, in lane ``t``, between the global ranks
``h0 * tp + t, h1 * tp + t, ...`` on the one global communicator (:attr:`ParallelMesh.ring_ranks`).

A pipeline dimension (issue 30) will sit outside both, ``(pipeline, data_parallel,
tensor_parallel)``; nothing here assumes there is none beyond the names below.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from lightning_bytescale.parallel.errors import ParallelDimsError, TensorParallelHeadsError

DATA_PARALLEL = "data_parallel"
TENSOR_PARALLEL = "tensor_parallel"
MESH_DIM_NAMES = (DATA_PARALLEL, TENSOR_PARALLEL)  # Lightning ModelParallelStrategy's names, TP inner


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParallelDimsError(f"{name} must be a positive integer, got {value!r}")
    return value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """``world_size = data_parallel * tensor_parallel``, checked when made (before any process group exists).

    ``ranks_per_node`` (the processes of one node) bounds the TP size: a TP group must fit in a
    node and a node must hold whole TP groups.  ``None`` skips that check (one process per
    device, nodes unknown).
    """

    world_size: int
    tensor_parallel: int = 1
    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        world = _positive_int("world_size", self.world_size)
        tp = _positive_int("tensor_parallel_size", self.tensor_parallel)
        if world % tp:
            raise ParallelDimsError(
                f"tensor_parallel_size={tp} does not divide the world of {world} ranks: every HDP rank is a "
                f"group of {tp} ranks. Use a tensor_parallel_size that divides {world} ({_divisors(world)})"
            )
        if self.ranks_per_node is not None:
            per_node = _positive_int("ranks_per_node", self.ranks_per_node)
            if tp > per_node:
                raise ParallelDimsError(
                    f"tensor_parallel_size={tp} is larger than the {per_node} ranks of a node: tensor parallelism "
                    "exchanges activations in every layer and must stay inside a node. Use at most "
                    f"tensor_parallel_size={per_node} (or more devices per node)"
                )
            if per_node % tp:
                raise ParallelDimsError(
                    f"tensor_parallel_size={tp} does not divide the {per_node} ranks of a node, so some TP groups "
                    f"would span two nodes. Use a tensor_parallel_size that divides {per_node} "
                    f"({_divisors(per_node)})"
                )

    @property
    def data_parallel(self) -> int:
        """HDP ranks: the world the planner plans for."""
        return self.world_size // self.tensor_parallel

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ParallelDimsError(f"global rank {rank} is outside the world of {self.world_size} ranks")

    def hdp_rank(self, rank: int) -> int:
        """The HDP rank (data-parallel coordinate) of global ``rank``."""
        self._check_rank(rank)
        return rank // self.tensor_parallel

    def tp_lane(self, rank: int) -> int:
        """The TP lane (tensor-parallel coordinate) of global ``rank``."""
        self._check_rank(rank)
        return rank % self.tensor_parallel

    def global_rank(self, hdp_rank: int, lane: int) -> int:
        """The global rank of lane ``lane`` of HDP rank ``hdp_rank``."""
        if not 0 <= hdp_rank < self.data_parallel or not 0 <= lane < self.tensor_parallel:
            raise ParallelDimsError(
                f"(HDP rank {hdp_rank}, lane {lane}) is outside ({self.data_parallel}, {self.tensor_parallel})"
            )
        return hdp_rank * self.tensor_parallel + lane

    def lane_ranks(self, lane: int) -> tuple[int, ...]:
        """Global ranks of lane ``lane`` on every HDP rank, indexed by HDP rank (its data-parallel group)."""
        return tuple(self.global_rank(h, lane) for h in range(self.data_parallel))

    def tp_ranks(self, hdp_rank: int) -> tuple[int, ...]:
        """Global ranks of HDP rank ``hdp_rank``'s TP group, indexed by lane."""
        return tuple(self.global_rank(hdp_rank, t) for t in range(self.tensor_parallel))

    def check_heads(self, heads: int, kv_heads: int, *, model: str = "the model") -> None:
        """Refuse a model whose heads cannot be split whole over the TP ranks (:func:`check_heads`)."""
        check_heads(heads, kv_heads, self.tensor_parallel, model=model)

    def build(self, device_type: str) -> ParallelMesh:
        """The 2-D mesh over the initialised world, with this rank's coordinates (call once, on every rank)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not (dist.is_available() and dist.is_initialized()):
            raise ParallelDimsError(
                "the parallel mesh needs an initialised process group (init_process_group first)"
            )
        if dist.get_world_size() != self.world_size:
            raise ParallelDimsError(
                f"the process group has {dist.get_world_size()} ranks but these dims were made for {self.world_size}"
            )
        mesh = init_device_mesh(
            device_type, (self.data_parallel, self.tensor_parallel), mesh_dim_names=MESH_DIM_NAMES
        )
        expected = [list(self.tp_ranks(h)) for h in range(self.data_parallel)]
        if mesh.mesh.tolist() != expected:  # the rank layout every other part relies on
            raise ParallelDimsError(f"the device mesh has layout {mesh.mesh.tolist()}, expected {expected}")
        return ParallelMesh(self, mesh, dist.get_rank())


def check_heads(heads: int, kv_heads: int, tensor_parallel: int, *, model: str = "the model") -> None:
    """Every TP rank must hold whole query heads and whole key/value heads.

    Tensor parallelism shards the q, k and v projections by head, so ``heads`` and ``kv_heads``
    must both be multiples of the TP size.  Fewer key/value heads than TP ranks (GQA, e.g. 8 KV
    heads on 16 ranks) is refused rather than handled by replicating KV heads: replicas would be
    separate weights whose gradients must be summed across lanes to stay equal, a different
    parameterisation than the single-process model this project must match exactly.
    """
    tp = tensor_parallel
    if heads % tp:
        raise TensorParallelHeadsError(
            f"{model} has {heads} attention heads, which {tp} tensor-parallel ranks cannot split evenly (a head "
            f"cannot be split). Use a tensor_parallel_size that divides {heads} ({_divisors(heads)})"
        )
    if kv_heads % tp:
        fewer = "fewer key/value heads than" if kv_heads < tp else "key/value heads not a multiple of"
        fits = [d for d in _divisors(kv_heads) if heads % d == 0]
        raise TensorParallelHeadsError(
            f"{model} has {kv_heads} key/value heads (grouped-query attention), {fewer} the {tp} "
            "tensor-parallel ranks: each rank must hold whole key/value heads, and replicating them is not "
            f"supported. Use tensor_parallel_size in {fits}"
        )


@dataclass(frozen=True, eq=False)
class ParallelMesh:
    """The built mesh and this rank's place in it: what the step, the model and the loader need."""

    dims: ParallelDims
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh, 2-D, MESH_DIM_NAMES
    rank: int  # global rank of this process

    @property
    def hdp_rank(self) -> int:
        return self.dims.hdp_rank(self.rank)

    @property
    def lane(self) -> int:
        return self.dims.tp_lane(self.rank)

    @cached_property
    def dp_mesh(self) -> Any:
        """The 1-D ``"data_parallel"`` mesh of this lane (gradient sums, FSDP2 sharding)."""
        return self.mesh[DATA_PARALLEL]

    @cached_property
    def tp_mesh(self) -> Any:
        """The 1-D ``"tensor_parallel"`` mesh of this HDP rank (``parallelize_module``)."""
        return self.mesh[TENSOR_PARALLEL]

    @cached_property
    def dp_group(self) -> Any:
        return self.mesh.get_group(DATA_PARALLEL)

    @cached_property
    def tp_group(self) -> Any:
        return self.mesh.get_group(TENSOR_PARALLEL)

    @property
    def ring_ranks(self) -> tuple[int, ...]:
        """Global rank of every HDP rank in this lane: rings of a plan over HDP ranks run between these."""
        return self.dims.lane_ranks(self.lane)


__all__ = [
    "DATA_PARALLEL",
    "MESH_DIM_NAMES",
    "TENSOR_PARALLEL",
    "ParallelDims",
    "ParallelMesh",
    "check_heads",
]
