"""The parallel dimensions of a run, validated once: world = pipeline x data_parallel x tensor_parallel, and its mesh.

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

With pipeline parallelism (``pipeline`` P > 1, docs/pipelines.md) an HDP rank is one *pipeline*
of P stages (times its TP group), and the pipeline dimension is the outermost:
``(pipeline, data_parallel, tensor_parallel)``.  Global rank ``g`` is stage
``g // (data_parallel * tensor_parallel)``, so stage p of every pipeline is one contiguous block
of ranks, and within it the layout above holds: HDP rank ``(g // tensor_parallel) %
data_parallel``, lane ``g % tensor_parallel``.  The ``"data_parallel"`` sub-group of a rank is
then stage p's copies in every pipeline (its gradient sum), the ``"pipeline"`` sub-group the P
stages of its own pipeline (their activation and gradient transfers), and a ring over HDP ranks
runs, at stage p, between stage p of its member pipelines.  With P = 1 the mesh is the 2-D one
above, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import Any

from lightning_bytescale.parallel.errors import ParallelDimsError, TensorParallelHeadsError

PIPELINE = "pipeline"
DATA_PARALLEL = "data_parallel"
TENSOR_PARALLEL = "tensor_parallel"
MESH_DIM_NAMES = (DATA_PARALLEL, TENSOR_PARALLEL)  # Lightning ModelParallelStrategy's names, TP inner
PIPELINE_MESH_DIM_NAMES = (PIPELINE, DATA_PARALLEL, TENSOR_PARALLEL)  # with pipelines: stage outermost


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParallelDimsError(f"{name} must be a positive integer, got {value!r}")
    return value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """``world_size = pipeline * data_parallel * tensor_parallel``, checked when made (before any process group exists).

    ``ranks_per_node`` (the processes of one node) bounds the TP size: a TP group must fit in a
    node and a node must hold whole TP groups.  ``None`` skips that check (one process per
    device, nodes unknown).  ``pipeline`` is the number of stages of every HDP rank (1: no
    pipeline parallelism).
    """

    world_size: int
    tensor_parallel: int = 1
    ranks_per_node: int | None = None
    pipeline: int = 1

    def __post_init__(self) -> None:
        world = _positive_int("world_size", self.world_size)
        tp = _positive_int("tensor_parallel_size", self.tensor_parallel)
        pp = _positive_int("pipeline_parallel_size", self.pipeline)
        if world % tp:
            raise ParallelDimsError(
                f"tensor_parallel_size={tp} does not divide the world of {world} ranks: every HDP rank is a "
                f"group of {tp} ranks. Use a tensor_parallel_size that divides {world} ({_divisors(world)})"
            )
        if world % (tp * pp):
            fits = _divisors(world // tp)
            raise ParallelDimsError(
                f"pipeline_parallel_size={pp} times tensor_parallel_size={tp} does not divide the world of "
                f"{world} ranks: every HDP rank is a pipeline of {pp} stages of {tp} ranks each. Use a "
                f"pipeline_parallel_size in {fits} (or another world size)"
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
        return self.world_size // (self.tensor_parallel * self.pipeline)

    @property
    def stage_size(self) -> int:
        """Global ranks of one pipeline stage over all HDP ranks (one contiguous block per stage)."""
        return self.data_parallel * self.tensor_parallel

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ParallelDimsError(f"global rank {rank} is outside the world of {self.world_size} ranks")

    def hdp_rank(self, rank: int) -> int:
        """The HDP rank (data-parallel coordinate) of global ``rank``."""
        self._check_rank(rank)
        return (rank // self.tensor_parallel) % self.data_parallel

    def stage(self, rank: int) -> int:
        """The pipeline stage (pipeline coordinate) of global ``rank``; 0 without pipelines."""
        self._check_rank(rank)
        return rank // self.stage_size

    def tp_lane(self, rank: int) -> int:
        """The TP lane (tensor-parallel coordinate) of global ``rank``."""
        self._check_rank(rank)
        return rank % self.tensor_parallel

    def global_rank(self, hdp_rank: int, lane: int, stage: int = 0) -> int:
        """The global rank of lane ``lane`` of stage ``stage`` of HDP rank ``hdp_rank``."""
        if (
            not 0 <= hdp_rank < self.data_parallel
            or not 0 <= lane < self.tensor_parallel
            or not 0 <= stage < self.pipeline
        ):
            raise ParallelDimsError(
                f"(HDP rank {hdp_rank}, lane {lane}, stage {stage}) is outside ({self.data_parallel}, "
                f"{self.tensor_parallel}, {self.pipeline})"
            )
        return stage * self.stage_size + hdp_rank * self.tensor_parallel + lane

    def lane_ranks(self, lane: int, stage: int = 0) -> tuple[int, ...]:
        """Global ranks of lane ``lane`` at ``stage`` on every HDP rank, indexed by HDP rank (its data-parallel group)."""
        return tuple(self.global_rank(h, lane, stage) for h in range(self.data_parallel))

    def tp_ranks(self, hdp_rank: int, stage: int = 0) -> tuple[int, ...]:
        """Global ranks of HDP rank ``hdp_rank``'s TP group at ``stage``, indexed by lane."""
        return tuple(self.global_rank(hdp_rank, t, stage) for t in range(self.tensor_parallel))

    def pipeline_ranks(self, hdp_rank: int, lane: int = 0) -> tuple[int, ...]:
        """Global ranks of the stages of HDP rank ``hdp_rank``'s pipeline in lane ``lane``, indexed by stage."""
        return tuple(self.global_rank(hdp_rank, lane, p) for p in range(self.pipeline))

    def check_heads(self, heads: int, kv_heads: int, *, model: str = "the model") -> None:
        """Refuse a model whose heads cannot be split whole over the TP ranks (:func:`check_heads`)."""
        check_heads(heads, kv_heads, self.tensor_parallel, model=model)

    def build(self, device_type: str, *, timeout: timedelta | None = None) -> ParallelMesh:
        """The 2-D mesh over the initialised world, with this rank's coordinates (call once, on every rank).

        ``timeout``: with pipelines, the ``"pipeline"`` groups are made again with it
        (:attr:`ParallelMesh.pp_group`).  A stage waits for its neighbour in a point-to-point
        receive, which gloo bounds by the timeout the group was *made* with (setting it later
        bounds collectives only), and ``init_device_mesh`` makes its groups with the backend's
        default (30 minutes for gloo), so a stage waiting on a stuck neighbour would outwait the
        run's timeout.
        """
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
        if self.pipeline == 1:
            mesh = init_device_mesh(
                device_type, (self.data_parallel, self.tensor_parallel), mesh_dim_names=MESH_DIM_NAMES
            )
            expected: list = [list(self.tp_ranks(h)) for h in range(self.data_parallel)]
        else:
            mesh = init_device_mesh(
                device_type,
                (self.pipeline, self.data_parallel, self.tensor_parallel),
                mesh_dim_names=PIPELINE_MESH_DIM_NAMES,
            )
            expected = [
                [list(self.tp_ranks(h, p)) for h in range(self.data_parallel)] for p in range(self.pipeline)
            ]
        if mesh.mesh.tolist() != expected:  # the rank layout every other part relies on
            raise ParallelDimsError(f"the device mesh has layout {mesh.mesh.tolist()}, expected {expected}")
        pipeline_group = None
        if self.pipeline > 1 and timeout is not None:  # every pipeline's stages in stage order, every rank
            pipelines = [
                [self.global_rank(h, lane, p) for p in range(self.pipeline)]
                for h in range(self.data_parallel)
                for lane in range(self.tensor_parallel)
            ]
            pipeline_group, _ = dist.new_subgroups_by_enumeration(pipelines, timeout=timeout)
        return ParallelMesh(self, mesh, dist.get_rank(), pipeline_group)


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
    mesh: Any  # DeviceMesh: 2-D MESH_DIM_NAMES, or 3-D PIPELINE_MESH_DIM_NAMES with pipelines
    rank: int  # global rank of this process
    pipeline_group: Any = None  # the "pipeline" group made with the run's timeout (ParallelDims.build)

    @property
    def hdp_rank(self) -> int:
        return self.dims.hdp_rank(self.rank)

    @property
    def lane(self) -> int:
        return self.dims.tp_lane(self.rank)

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (0 without pipelines)."""
        return self.dims.stage(self.rank)

    @cached_property
    def pp_group(self) -> Any:
        """The ``"pipeline"`` group: the stages of this rank's pipeline, in stage order (P > 1 only).

        The one made with the run's timeout when :meth:`ParallelDims.build` got one, else the mesh's.
        """
        if self.dims.pipeline == 1:
            raise ParallelDimsError(
                "a mesh without pipelines (pipeline_parallel_size=1) has no pipeline group"
            )
        return self.pipeline_group if self.pipeline_group is not None else self.mesh.get_group(PIPELINE)

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
        """Global rank of every HDP rank in this lane and stage: rings of a plan over HDP ranks run between these."""
        return self.dims.lane_ranks(self.lane, self.stage)


__all__ = [
    "DATA_PARALLEL",
    "MESH_DIM_NAMES",
    "PIPELINE",
    "PIPELINE_MESH_DIM_NAMES",
    "TENSOR_PARALLEL",
    "ParallelDims",
    "ParallelMesh",
    "check_heads",
]
