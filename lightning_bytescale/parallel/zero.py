"""ZeRO for every layout: one entry that shards the optimizers, and ZeRO on the mesh (:class:`LaneZero`).

``ByteScaleStrategy(zero=level)`` calls :func:`shard_optimizers` once, with the run's layout:
plain HDP wraps each optimizer in ``ZeroRedundancyOptimizer`` over the world
(:func:`lightning_bytescale.engine.zero.shard_optimizers`); on a mesh (tensor parallelism,
pipelines) :class:`LaneZero` splits each lane's (and stage's) optimizer state over its HDP
ranks.  The entry also says how clipping by norm must combine the ranks' norms in that layout
(:class:`ShardedOptimizers`), which the strategy installs once, and gives ZeRO-2's gradient
owners to the step runner.

A sharded checkpoint asks :func:`keeps_state` which optimizer state a rank holds; "auto" is a
sharded save on the mesh exactly when :func:`state_sharded_over_hdp_ranks`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_bytescale.engine import zero as engine_zero
from lightning_bytescale.engine.state_sync import broadcast_tensors
from lightning_bytescale.engine.zero import mark_step_calls, owner_ranks
from lightning_bytescale.errors import ConfigError
from lightning_bytescale.parallel.clip import clip_grad_norm_ as mesh_clip_grad_norm_
from lightning_bytescale.parallel.dims import ParallelMesh
from lightning_bytescale.parallel.fsdp import FSDPStepDriver
from lightning_bytescale.parallel.layout import Layout, sharded_over_hdp_ranks

ClipFn = Callable[[Optimizer, Sequence[Tensor], float], Tensor]
"""``clip(optimizer, parameters, max_norm)``: clip by the norm of the whole gradient, return it."""


@dataclass(frozen=True)
class ShardedOptimizers:
    """What :func:`shard_optimizers` made of a run's optimizers."""

    optimizers: list[Optimizer]
    """The optimizers to step: plain HDP's wrapped in ``ZeroRedundancyOptimizer``, the mesh's the user's own."""

    owners: dict[int, int] | None
    """ZeRO-2: ``id(parameter) -> global rank`` that keeps its gradient (the step runner's sync needs it)."""

    clip: ClipFn | None
    """How clipping by norm must combine the ranks' norms here; ``None``: the precision plugin's own is right."""


def shard_optimizers(
    optimizers: Sequence[Optimizer], layout: Layout, level: int, *, schedulers: Iterable[Any] = ()
) -> ShardedOptimizers:
    """The one ZeRO entry: ``level`` 0, 1 or 2 on ``layout``, ``ZeroRedundancyOptimizer`` or :class:`LaneZero`.

    Plain HDP: level 1 and 2 wrap each optimizer (``schedulers`` that step one are pointed at
    its wrapper); level 2 reduces each gradient to the rank owning its state, so clipping by
    norm combines the owners' norms.  On a mesh: level 1 and 2 split each lane's (and stage's)
    state over its HDP ranks (:class:`LaneZero`), and clipping always takes the norm over
    DTensor shards (and over the stages of a pipeline), combined over the lane's data-parallel
    group when each rank holds only the gradients it owns.
    """
    if layout.mesh is None:
        wrapped = engine_zero.shard_optimizers(optimizers, schedulers) if level >= 1 else list(optimizers)
        return ShardedOptimizers(
            wrapped, owner_ranks(wrapped) if level == 2 else None, _clip_over_owners if level == 2 else None
        )
    zeros = lane_zero(list(optimizers), layout.mesh, level) if level >= 1 else []
    group = layout.dp_group if level == 2 else None
    pipeline_group = layout.pipeline_group

    def clip(optimizer: Optimizer, params: Sequence[Tensor], max_norm: float) -> Tensor:
        return mesh_clip_grad_norm_(params, max_norm, group=group, pipeline_group=pipeline_group)

    return ShardedOptimizers(list(optimizers), gradient_owners(zeros) if level == 2 else None, clip)


def _clip_over_owners(optimizer: Optimizer, params: Sequence[Tensor], max_norm: float) -> Tensor:
    """Plain ZeRO-2: each rank holds only its gradients; one all-reduce over the optimizer's group combines the norms."""
    return engine_zero.clip_grad_norm_(params, max_norm, group=getattr(optimizer, "process_group", None))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class _StateTensor:
    """What a non-owner needs to make room for one tensor of an owner's optimizer state (it travels pickled)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    dtensor: bool  # sharded like its parameter (AdamW's moments of a DTensor parameter)
    host: bool  # a plain tensor on the host: AdamW's ``step`` (unless fused or capturable)

    @classmethod
    def of(cls, t: torch.Tensor) -> _StateTensor:
        dtensor = isinstance(t, DTensor)
        return cls(tuple(t.shape), t.dtype, dtensor, not dtensor and t.device.type == "cpu")

    def zeros_like(self, p: torch.Tensor) -> torch.Tensor:
        """Zeros for this state of parameter ``p``: a DTensor like ``p``, or a plain tensor where the owner keeps it."""
        if self.dtensor:
            return torch.zeros_like(p, dtype=self.dtype)
        return torch.zeros(self.shape, dtype=self.dtype, device="cpu" if self.host else _local(p).device)


class LaneZero:
    """ZeRO-1 and ZeRO-2 on the mesh: each lane's optimizer state split over its HDP ranks.

    Every parameter (a DTensor shard or a plain replica) has one owner among the HDP ranks,
    chosen the same way on every rank (largest first, to the least loaded).  The optimizer is the
    user's own; its ``step`` runs the closure (forward, backward, the gradient sum over the lane's
    data-parallel group, clipping on every rank as without ZeRO), hides the gradients of the
    parameters this rank does not own (so the optimizer keeps no state for them and skips them),
    steps, and then every owner broadcasts its updated local shards over the lane's data-parallel
    group.  The update of a parameter is the one one process would make (AdamW and SGD are per
    parameter), so the result is exact.  For a consolidated checkpoint
    :meth:`materialized` gives every rank the whole state for a moment (the owners broadcast it),
    which ``get_optimizer_state_dict`` then gathers across the lanes; :meth:`drop_unowned` frees it
    again (and after a load).

    ZeRO-2 adds the gradients: the step's sync reduces each gradient to its owner over the lane's
    data-parallel group (:attr:`gradient_owners`, handed to
    :func:`~lightning_bytescale.engine.executor.sync_step`) and the other ranks drop it, so the
    optimizer finds the others' gradients gone already; the state and checkpoints are ZeRO-1's.

    With pipelines the same holds per stage: the parameters are this rank's stage's, the group is
    the stage's data-parallel group (``pmesh.dp_group``: this stage and lane of every pipeline)
    and the owners' global ranks are those of this rank's stage (``ParallelDims.global_rank(...,
    stage)``).
    """

    def __init__(self, optimizer: Optimizer, pmesh: ParallelMesh) -> None:
        self.optimizer, self.pmesh = optimizer, pmesh
        self.params = list(dict.fromkeys(p for g in optimizer.param_groups for p in g["params"]))
        loads = [0] * pmesh.dims.data_parallel
        self.owner: dict[int, int] = {}
        for p in sorted(self.params, key=lambda p: -p.numel()):  # stable: ties in parameter order
            i = loads.index(min(loads))
            self.owner[id(p)] = i
            loads[i] += p.numel()
        self.split = True  # False: step every parameter (the state set-up of a checkpoint load)
        inner = optimizer.step

        def step(closure: Any = None, **kwargs: Any) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            held = {}
            for p in self.params if self.split else ():
                if not self.owns(p) and p.grad is not None:
                    held[p], p.grad = p.grad, None
            try:
                inner(**kwargs)
            finally:
                for p, g in held.items():
                    p.grad = g
            if self.split:
                self.broadcast_params()
            return loss

        optimizer.step = step  # type: ignore[method-assign]

    def owns(self, p: torch.Tensor) -> bool:
        return self.owner[id(p)] == self.pmesh.hdp_rank

    @property
    def gradient_owners(self) -> dict[int, int]:
        """``id(parameter) -> global rank`` of its owner in this rank's lane and stage (ZeRO-2's gradient sync)."""
        return {key: self._src(i) for key, i in self.owner.items()}

    def _src(self, i: int) -> int:
        return self.pmesh.dims.global_rank(i, self.pmesh.lane, self.pmesh.stage)

    @torch.no_grad()
    def broadcast_params(self) -> None:
        for i in range(self.pmesh.dims.data_parallel):
            mine = [_local(p) for p in self.params if self.owner[id(p)] == i]
            broadcast_tensors(mine, src=self._src(i), group=self.pmesh.dp_group)

    @torch.no_grad()
    def materialize(self) -> None:
        """Every rank of a lane gets the whole optimizer state of the lane (the owners broadcast it)."""
        state = self.optimizer.state
        for i in range(self.pmesh.dims.data_parallel):
            owned = [p for p in self.params if self.owner[id(p)] == i]
            meta = [None]
            if i == self.pmesh.hdp_rank:
                meta = [
                    [
                        {k: _StateTensor.of(v) if torch.is_tensor(v) else v for k, v in state[p].items()}
                        if p in state
                        else None
                        for p in owned
                    ]
                ]
            dist.broadcast_object_list(meta, src=self._src(i), group=self.pmesh.dp_group)
            tensors = []
            for p, keys in zip(owned, meta[0]):
                if keys is None:
                    continue
                if i != self.pmesh.hdp_rank:
                    state[p] = {
                        k: v.zeros_like(p) if isinstance(v, _StateTensor) else v for k, v in keys.items()
                    }
                tensors.extend(_local(v) for v in state[p].values() if torch.is_tensor(v))
            broadcast_tensors(tensors, src=self._src(i), group=self.pmesh.dp_group)

    def drop_unowned(self) -> None:
        for p in self.params:
            if not self.owns(p):
                self.optimizer.state.pop(p, None)

    @contextmanager
    def materialized(self) -> Iterator[None]:
        self.materialize()
        try:
            yield
        finally:
            self.drop_unowned()


def lane_zero(optimizers: list[Optimizer], pmesh: ParallelMesh, level: int = 1) -> list[LaneZero]:
    """ZeRO on the mesh for each optimizer (``ByteScaleStrategy(zero=level)`` with ``tensor_parallel_size`` or ``pipeline_parallel_size``, level 1 or 2)."""
    zeros = []
    for opt in optimizers:
        split_by_fsdp = [
            p
            for g in opt.param_groups
            for p in g["params"]
            if isinstance(p, DTensor) and sharded_over_hdp_ranks(p)
        ]
        if split_by_fsdp:
            raise ConfigError(
                f"ByteScaleStrategy(zero={level}) cannot run with fully_shard over the data-parallel dimension: "
                "FSDP2 already splits the parameters, their optimizer state and (with its reduce-scatter) their "
                "gradients over the HDP ranks. Use zero=0 with FSDP2"
            )
        zero = LaneZero(opt, pmesh)
        opt._bytescale_lane_zero = zero  # type: ignore[attr-defined]
        mark_step_calls(opt)
        zeros.append(zero)
    return zeros


def gradient_owners(zeros: list[LaneZero]) -> dict[int, int]:
    """ZeRO-2 on the mesh: ``id(parameter) -> global rank`` that keeps its gradient, over every optimizer."""
    owners: dict[int, int] = {}
    for zero in zeros:
        owners.update(zero.gradient_owners)
    return owners


def lane_zero_of(optimizer: Optimizer) -> LaneZero | None:
    return getattr(optimizer, "_bytescale_lane_zero", None)


def keeps_state(optimizer: Optimizer, param: torch.Tensor) -> bool:
    """Whether this rank keeps ``optimizer``'s state for ``param``: under ZeRO-1 on the mesh only its owner does."""
    zero = lane_zero_of(getattr(optimizer, "_optimizer", optimizer))
    return zero is None or zero.owns(param)


def state_sharded_over_hdp_ranks(optimizers: list[Optimizer], fsdp: FSDPStepDriver | None) -> bool:
    """Whether the HDP ranks hold different parts of the optimizer state (ZeRO-1 on the mesh, or FSDP2).

    What ``checkpoint_format="auto"`` means by "sharded" with tensor parallelism: then a
    consolidated save would gather the HDP ranks' parts on rank 0, so each rank writes its own.
    """
    return fsdp is not None or any(lane_zero_of(getattr(o, "_optimizer", o)) is not None for o in optimizers)


__all__ = [
    "ClipFn",
    "LaneZero",
    "ShardedOptimizers",
    "gradient_owners",
    "keeps_state",
    "lane_zero",
    "lane_zero_of",
    "shard_optimizers",
    "state_sharded_over_hdp_ranks",
]
