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
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from lightning_bytescale.engine.state_sync import broadcast_tensors
from lightning_bytescale.errors import ConfigError
from lightning_bytescale.parallel import FSDPSettingError, FSDPStepDriver, ParallelMesh
from lightning_bytescale.parallel import clip_grad_norm_ as mesh_clip_grad_norm_
from lightning_bytescale.parallel.full_state import (
    full_state_dict,
    keyed_by_name,
    load_model_state,
    load_optimizer_states,
    model_state,
    optimizer_state,
)
from lightning_bytescale.parallel.layout import bound_mesh_groups, check_world, sharded_over_hdp_ranks
from lightning_bytescale.parallel.materialize import materialize_sharded
from lightning_bytescale.parallel.zero import (
    LaneZero,
    gradient_owners,
    keeps_state,
    lane_zero,
    state_sharded_over_hdp_ranks,
)

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
        elif not sharded_over_hdp_ranks(t):
            shards.append(t)
    broadcast_tensors(plain, src=0)
    src = pmesh.dims.global_rank(0, pmesh.lane)
    broadcast_tensors([t.to_local() for t in shards], src=src, group=pmesh.dp_group)


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


__all__ = [
    "LaneZero",
    "lane_zero",
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
