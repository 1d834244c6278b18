"""``ByteScaleStrategy(tensor_parallel_size=N)``: what the ``(data_parallel, tensor_parallel)`` mesh changes.

With ``tensor_parallel_size=1`` (the default) nothing here runs but the check that
``configure_model`` applied no ``fully_shard`` (:func:`fsdp_driver`): every rank is one HDP rank over
the global group.  With ``N > 1`` an HDP rank is a group of ``N`` consecutive ranks
(:mod:`lightning_bytescale.parallel.dims`) and the strategy

* checks the sizes when the Trainer is made (:func:`check_world`) and refuses, by name, the
  options it cannot run exactly with TP yet (:func:`check_options`, :func:`check_setup`);
* builds the mesh once after the process group, its groups bounded by the strategy's ``timeout``
  (:func:`bound_mesh_groups`), and hands it to the LightningModule as ``device_mesh`` before
  ``configure_model``, with Lightning ``ModelParallelStrategy``'s names (:func:`build_mesh`);
* gives every rank HDP rank 0's parameters of its own lane (:func:`broadcast_state`): a TP
  shard only travels to the same shard of the other HDP ranks;
* runs the step's checks and gradient sum on the lane's data-parallel group, through
  :mod:`lightning_bytescale.parallel.step`'s pieces (the step loop calls them), and clips by the
  global norm over DTensor shards (:func:`clip_by_global_norm`);
* splits each lane's optimizer state (``zero=1``) and gradients (``zero=2``) over its HDP ranks
  (:class:`LaneZero`, :func:`gradient_owners`);
* drives FSDP2 when ``configure_model`` applied ``fully_shard`` over ``device_mesh["data_parallel"]``
  (:func:`fsdp_driver`, :func:`gathered`);
* materialises a model built on the meta device with only each rank's shards (:func:`materialize`);
* writes consolidated checkpoints with the DTensor state whole, gathered one tensor at a time onto
  global rank 0's host, and loads them back as each rank's shards, on any mesh
  (:func:`model_state`, :func:`optimizer_state`, :func:`load_model_state`,
  :func:`load_optimizer_states`); sharded checkpoints (every rank writes its own DTensor shards)
  are :mod:`lightning_bytescale.lightning.checkpoint`'s, told here which optimizer state a rank
  keeps (:func:`keeps_state`) and when ``"auto"`` means sharded (:func:`state_sharded_over_hdp_ranks`).

The data module plans for ``data_parallel`` ranks and reads the share of the rank's HDP rank
(``ByteScaleDataModule`` asks the strategy's :attr:`parallel_mesh`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.optim import Optimizer

from lightning_bytescale.engine.state_sync import broadcast_tensors
from lightning_bytescale.errors import ConfigError
from lightning_bytescale.parallel import (
    DATA_PARALLEL,
    FSDPSettingError,
    FSDPStepDriver,
    ParallelDims,
    ParallelMesh,
)
from lightning_bytescale.parallel import clip_grad_norm_ as mesh_clip_grad_norm_
from lightning_bytescale.parallel.materialize import materialize_sharded

if TYPE_CHECKING:
    import lightning.pytorch as pl


def check_options(tensor_parallel_size: Any) -> int:
    """``tensor_parallel_size`` itself (at construction).

    Every ZeRO level runs with it (``zero`` 1 and 2: :class:`LaneZero`), and both checkpoint formats.
    """
    tp = tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(
            f"tensor_parallel_size must be a positive integer (1: no tensor parallelism), got {tp!r}"
        )
    return tp


def check_world(
    tensor_parallel_size: int, num_processes: int, num_nodes: int, pipeline_parallel_size: int = 1
) -> ParallelDims:
    """The run's dims: TP (and pipelines) must divide the world, TP a node's processes (a ``ParallelDimsError`` otherwise)."""
    return ParallelDims(
        max(1, num_nodes) * max(1, num_processes),
        tensor_parallel_size,
        ranks_per_node=max(1, num_processes),
        pipeline=pipeline_parallel_size,
    )


def bound_mesh_groups(pmesh: ParallelMesh, timeout: timedelta | None) -> None:
    """Give the mesh's groups (one per lane, one per HDP rank) the strategy's process-group timeout.

    ``init_device_mesh`` makes them with the backend's default (30 minutes for gloo), so a rank
    waiting on a stuck TP partner in a layer's all-reduce, or on its lane's gradient sum, would
    outwait the strategy's ``timeout`` and end by its own watchdog, blaming itself, instead of
    failing with the peer error at the timeout as the global group's collectives do.  A
    pipeline's stages wait for each other in point-to-point receives, which gloo bounds only by
    the timeout a group was made with: those groups are made with it (:func:`build_mesh`).
    """
    if timeout is not None:
        for group in (pmesh.tp_group, pmesh.dp_group):
            _set_pg_timeout(timeout, group)


def build_mesh(strategy: Any, built: ParallelMesh | None = None) -> ParallelMesh:
    """The 2-D mesh (``built`` if given: its groups are made once), and the LightningModule's ``device_mesh``.

    Called in ``setup_environment``, after the process group and before ``configure_model``.
    """
    pmesh = built
    if pmesh is None:
        dims = check_world(
            strategy.tensor_parallel_size,
            strategy.num_processes,
            strategy.num_nodes,
            strategy.pipeline_parallel_size,
        )
        pmesh = dims.build(
            strategy.root_device.type, timeout=strategy._timeout
        )  # pipeline groups: made with it
        bound_mesh_groups(pmesh, strategy._timeout)
    module = strategy.lightning_module
    if module is not None:
        module._device_mesh = pmesh.mesh  # what Lightning's ModelParallelStrategy sets
    return pmesh


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _sharded_over_hdp_ranks(t: Any) -> bool:
    """A DTensor sharded on ``"data_parallel"`` (FSDP2): each HDP rank holds a different part."""
    names = tuple(t.device_mesh.mesh_dim_names or ())
    # not is_shard(): FSDP2 around a TP shard uses _StridedShard, which is no Shard in every torch release
    return DATA_PARALLEL in names and not t.placements[names.index(DATA_PARALLEL)].is_replicate()


@torch.no_grad()
def broadcast_state(module: nn.Module, pmesh: ParallelMesh) -> None:
    """Every rank starts from HDP rank 0's parameters and buffers of its own lane.

    Plain tensors (replicated on every lane: norms, tied embeddings, buffers) come from global
    rank 0; DTensor shards from the same lane of HDP rank 0, over the lane's data-parallel group.
    Parameters FSDP2 shards over the HDP ranks are left as they are: ``fully_shard`` cut each
    rank's part from the whole tensor that rank built, so every rank must build the same one
    (seed before building the model).
    """
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    plain: list[torch.Tensor] = []
    shards: list[torch.Tensor] = []
    for t in (*module.parameters(), *module.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        if not isinstance(t, DTensor):
            plain.append(t)
        elif not _sharded_over_hdp_ranks(t):
            shards.append(t)
    broadcast_tensors(plain, src=0)
    src = pmesh.dims.global_rank(0, pmesh.lane)
    broadcast_tensors([_local(t) for t in shards], src=src, group=pmesh.dp_group)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every DTensor gathered whole (a collective: call on every rank)."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}


def clip_by_global_norm(plugin: Any, pmesh: ParallelMesh, *, sharded_gradients: bool = False) -> None:
    """The precision plugin's ``clip_grad_by_norm`` by the norm over DTensor shards and plain replicas, each element once.

    ``sharded_gradients`` (ZeRO-2): each HDP rank of a lane (and stage) holds only the gradients it
    owns, so the norms of what the ranks hold are combined over the lane's data-parallel group.
    With pipelines each stage holds other parameters: the norms are combined over the pipeline too.
    """
    group = pmesh.dp_group if sharded_gradients else None
    pipeline_group = pmesh.pp_group if pmesh.dims.pipeline > 1 else None

    def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
        mesh_clip_grad_norm_(
            plugin.main_params(optimizer), clip_val, group=group, pipeline_group=pipeline_group
        )

    plugin.clip_grad_by_norm = clip_grad_by_norm


def fsdp_driver(module: nn.Module, pmesh: ParallelMesh | None) -> FSDPStepDriver | None:
    """The FSDP2 step driver when ``configure_model`` applied ``fully_shard`` (``None`` when it did not).

    The outermost unit (``fully_shard(self.model, ...)``, applied last) must hold every other one;
    it and every unit must shard over ``device_mesh["data_parallel"]`` with
    ``reshard_after_forward=False`` (:class:`~lightning_bytescale.parallel.FSDPStepDriver` refuses
    the rest by name).
    """
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not units:
        return None
    if pmesh is None:
        raise FSDPSettingError(
            "configure_model applied fully_shard, but ByteScaleStrategy runs FSDP2 only on its mesh: pass "
            'tensor_parallel_size > 1 and shard with fully_shard(..., mesh=self.device_mesh["data_parallel"])'
        )
    outer = [u for u in units if not any(u is not o and u in set(o.modules()) for o in units)]
    if len(outer) != 1:
        raise FSDPSettingError(
            f"configure_model made {len(outer)} outermost fully_shard units; apply fully_shard last to the one "
            "module that holds all of them (fully_shard(self.model, ...), with the LightningModule's parameters inside it)"
        )
    root = outer[0]
    inside = {id(p) for p in root.parameters()}
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        raise FSDPSettingError(
            f"parameters {outside[:3]} are outside the outermost fully_shard unit {type(root).__name__}; keep every "
            "trained parameter inside it"
        )
    driver = FSDPStepDriver(root, pmesh.dp_group)
    stale = [n for n, p in driver.unmanaged(module.named_parameters()) if p.requires_grad]
    if stale:
        raise FSDPSettingError(
            f"parameters {stale[:3]} are no longer the ones fully_shard manages (new Parameters assigned to the "
            "module after fully_shard?), so FSDP2 would gather and reduce others; assign parameters before "
            "fully_shard in configure_model"
        )
    return driver


@contextmanager
def gathered(fsdp: FSDPStepDriver | None) -> Iterator[None]:
    """An evaluation loop with FSDP2: every unit gathered once before it and resharded after it (no backward)."""
    if fsdp is None:
        yield
        return
    fsdp.begin_step()
    try:
        yield
    finally:
        for unit in fsdp.units:
            unit.reshard()


def check_setup(strategy: Any, trainer: pl.Trainer) -> None:
    """What cannot run with tensor parallelism yet, refused at set-up by the setting's name."""
    tp = strategy.tensor_parallel_size
    if getattr(strategy.precision_plugin, "scaler", None) is not None:
        raise ConfigError(
            f"tensor_parallel_size={tp} cannot run with a float16 GradScaler (precision='16-mixed'): each "
            "lane would decide on its own gradient shards whether to skip a step. Use precision='bf16-mixed' "
            "or '32-true'"
        )
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in strategy.model.parameters()):
        rank_zero_warn(
            f"ByteScaleStrategy(tensor_parallel_size={tp}): configure_model sharded no parameter (none is a "
            "DTensor), so every lane of an HDP rank runs the whole model on the same micro-batches. Apply "
            'parallelize_module(..., self.device_mesh["tensor_parallel"], plan) (or parallelize_llama / '
            "parallelize_hf) in configure_model, or use tensor_parallel_size=1"
        )


def materialize(module: nn.Module, device: torch.device) -> None:
    """A model on the meta device (``Trainer.init_module(empty_init=True)``, or built there in ``configure_model``
    and sharded there): each rank allocates its own shards on ``device`` only, with global rank 0's
    draws of each module's ``reset_parameters`` (:func:`~lightning_bytescale.parallel.materialize.materialize_sharded`),
    so the values are those Lightning's materialisation gives the unsharded model on one device.
    """
    missing = materialize_sharded(module, device)
    if missing:
        rank_zero_warn(
            "Parameter initialization incomplete. The following modules have parameters or buffers with uninitialized "
            f"memory because they don't define a `reset_parameters()` method for re-initialization: {', '.join(missing)}"
        )


# ----------------------------------------------------------------------------- ZeRO-1 on the mesh
@dataclass(frozen=True)
class _StateTensor:
    """What a non-owner needs to make room for one tensor of an owner's optimizer state (it travels pickled)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    dtensor: bool  # sharded like its parameter (AdamW's moments of a DTensor parameter)
    host: bool  # a plain tensor on the host: AdamW's ``step`` (unless fused or capturable)

    @classmethod
    def of(cls, t: torch.Tensor) -> _StateTensor:
        from torch.distributed.tensor import DTensor

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
        import torch.distributed as dist

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
    from torch.distributed.tensor import DTensor

    from lightning_bytescale.engine.zero import mark_step_calls

    zeros = []
    for opt in optimizers:
        fsdp = [
            p
            for g in opt.param_groups
            for p in g["params"]
            if isinstance(p, DTensor) and _sharded_over_hdp_ranks(p)
        ]
        if fsdp:
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


def _lane_zero_of(optimizer: Optimizer) -> LaneZero | None:
    return getattr(optimizer, "_bytescale_lane_zero", None)


def keeps_state(optimizer: Optimizer, param: torch.Tensor) -> bool:
    """Whether this rank keeps ``optimizer``'s state for ``param``: under ZeRO-1 on the mesh only its owner does."""
    zero = _lane_zero_of(getattr(optimizer, "_optimizer", optimizer))
    return zero is None or zero.owns(param)


def state_sharded_over_hdp_ranks(optimizers: list[Optimizer], fsdp: FSDPStepDriver | None) -> bool:
    """Whether the HDP ranks hold different parts of the optimizer state (ZeRO-1 on the mesh, or FSDP2).

    What ``checkpoint_format="auto"`` means by "sharded" with tensor parallelism: then a
    consolidated save would gather the HDP ranks' parts on rank 0, so each rank writes its own.
    """
    return fsdp is not None or any(_lane_zero_of(getattr(o, "_optimizer", o)) is not None for o in optimizers)


# ----------------------------------------------------------------------------- consolidated checkpoints
# With tensor parallelism (and FSDP2) the model and AdamW state are DTensors.  A consolidated
# checkpoint holds them whole: torch.distributed.checkpoint.state_dict gathers them one tensor at a
# time (collectives on the mesh), global rank 0 keeps each on its host and every other rank drops it
# at once (its state dicts are empty; rank 0 writes the file), as Lightning's ModelParallelStrategy
# saves.  On load it gives each rank its own shards of the whole tensors, so a checkpoint resumes on
# any mesh, any data-parallel size included.


def _full_options(strict: bool = True, *, saving: bool = False) -> Any:
    """Whole tensors; for a save (``saving``) on rank 0's host only, one tensor on the device at a time."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=saving, strict=strict)


def model_state(module: nn.Module) -> dict[str, Any]:
    """The module's state with every DTensor whole, on global rank 0's host; empty on the other ranks (call on every rank)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module, options=_full_options(saving=True))


def optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's state by parameter name, every DTensor whole, on global rank 0's host; empty on the others (call on every rank)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    zero = _lane_zero_of(optimizer)
    if zero is None:
        return get_optimizer_state_dict(module, optimizer, options=_full_options(saving=True))
    with zero.materialized():  # ZeRO-1: every rank of a lane holds the whole state while it is gathered
        return get_optimizer_state_dict(module, optimizer, options=_full_options(saving=True))


def load_model_state(module: nn.Module, state: dict[str, Any], strict: bool) -> None:
    """Whole tensors into the module: each rank keeps its shards."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(module, state, options=_full_options(strict))


def keyed_by_name(module: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """PyTorch's indexed optimizer state (the one file of a run without TP, an exported sharded folder) keyed
    by parameter name, as torch's full optimizer state dict is; a state keyed by name as it is.

    Index ``i`` is the ``i``-th parameter of ``optimizer``'s groups, the order ``optimizer.state_dict()`` numbers them in.
    """
    indices = [*state["state"], *(i for g in state["param_groups"] for i in g["params"])]
    if not all(isinstance(i, int) for i in indices):
        return state
    names = {id(p): n for n, p in module.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    return {
        "state": {order[i]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def load_optimizer_states(
    module: nn.Module, optimizers: list[Optimizer], states: list[dict[str, Any]]
) -> None:
    """Whole tensors (keyed by name or, as PyTorch saves them, by index) into the optimizers: each rank keeps its shards."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    for optimizer, state in zip(optimizers, states):
        state = keyed_by_name(module, optimizer, state)
        zero = _lane_zero_of(getattr(optimizer, "_optimizer", optimizer))
        if zero is None:
            set_optimizer_state_dict(module, optimizer, state, options=_full_options())
            continue
        # ZeRO-1: torch sets up an empty state with a zero-learning-rate step of every parameter, so
        # the whole state is loaded first; then each rank keeps its own parameters' state only
        zero.split = False
        try:
            set_optimizer_state_dict(module, optimizer, state, options=_full_options())
        finally:
            zero.split = True
        zero.drop_unowned()


__all__ = [
    "bound_mesh_groups",
    "broadcast_state",
    "build_mesh",
    "check_options",
    "check_setup",
    "check_world",
    "clip_by_global_norm",
    "fsdp_driver",
    "full_state_dict",
    "gathered",
    "gradient_owners",
    "keeps_state",
    "keyed_by_name",
    "load_model_state",
    "load_optimizer_states",
    "materialize",
    "model_state",
    "optimizer_state",
    "state_sharded_over_hdp_ranks",
]
