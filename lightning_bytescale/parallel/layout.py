"""Every run's layout: where this rank sits, its process groups, and everything that differs between layouts.

A run is one of three layouts.  Plain HDP (:class:`Layout`): every rank is one HDP rank, the
world's group is the data-parallel group, and there is no mesh (the sizes are 1).  HDP on the
tensor-parallel mesh (:class:`MeshLayout`): an HDP rank is a group of ``tensor_parallel``
ranks on the ``(data_parallel, tensor_parallel)`` mesh, with FSDP2 over ``"data_parallel"`` or
not.  HDP over pipelines (:class:`PipelineLayout`): an HDP rank is a pipeline of stages (times
its TP group) on the ``(pipeline, data_parallel, tensor_parallel)`` mesh
(:mod:`~lightning_bytescale.parallel.dims`).

:func:`layout_class` is the one place that chooses between them (degree 1 means off, as in
torchtitan's ``ParallelDims``); everything that differs is a method of the layout's class: its
place and groups, the view the data loader plans with (:class:`LoaderView`), the mesh it builds
(:meth:`Layout.build_mesh`, ``None`` exactly for plain HDP), what it refuses of a model at set-up
(:meth:`Layout.check_model`), how it materialises a meta-device model, the set-up broadcast of
parameters (:meth:`Layout.broadcast_state`), and its step runner (:func:`make_runner`:
:class:`~lightning_bytescale.engine.executor.HDPRunner`,
:class:`~lightning_bytescale.parallel.step.MeshRunner` or
:class:`~lightning_bytescale.parallel.pipeline_step.PipelineRunner`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_bytescale.engine.executor import HDPRunner
from lightning_bytescale.engine.runner import GradSyncCache, StepRunner, SyncOptions, no_buckets
from lightning_bytescale.engine.state_sync import broadcast_module_state, broadcast_tensors
from lightning_bytescale.errors import ConfigError, CostModelTensorParallelError
from lightning_bytescale.parallel.dims import DATA_PARALLEL, ParallelDims, ParallelMesh
from lightning_bytescale.parallel.errors import FSDPSettingError, ParallelDimsError, PipelineModelError
from lightning_bytescale.parallel.fsdp import FSDPStepDriver
from lightning_bytescale.parallel.materialize import materialize_sharded
from lightning_bytescale.parallel.pipeline_stage import DecoderStage
from lightning_bytescale.parallel.pipeline_step import (
    ComputeContext,
    PipelineRunner,
    StageSchedules,
    refuse_evaluation,
)
from lightning_bytescale.parallel.step import MeshRunner
from lightning_bytescale.planner.config import PlannerConfig

WarnFn = Callable[[str], None]


def check_size(name: str, value: Any, off: str) -> int:
    """A layout size as given (``off``: what 1 means), or a ``ConfigError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer (1: {off}), got {value!r}")
    return value


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


def check_cost_model_devices(config: PlannerConfig, tensor_parallel_size: int) -> None:
    """Refuse a cost model profiled for HDP ranks of another number of devices than the run's.

    A profile of one device times one device's layer and counts its whole activations; with
    ``tensor_parallel_size=N`` an HDP rank is a group of ``N``, whose layer time and per-lane
    bytes differ, so its plans would be balanced on the wrong costs.  The default cost model
    (``cost_model=None``) is not checked.
    """
    cost = config.cost_model
    if cost is None or cost.tensor_parallel == tensor_parallel_size:
        return
    raise CostModelTensorParallelError(
        f"the cost model {cost.name!r} was profiled with tensor_parallel={cost.tensor_parallel} devices per HDP "
        f"rank, but ByteScaleStrategy(tensor_parallel_size={tensor_parallel_size}) runs HDP ranks of "
        f"{tensor_parallel_size}; profile one HDP rank of this run (bytescale-profile --tensor-parallel "
        f"{tensor_parallel_size} ...) or pass cost_model=None for the planner's default"
    )


def bound_mesh_groups(pmesh: ParallelMesh, timeout: timedelta | None) -> None:
    """Give the mesh's groups (one per lane, one per HDP rank) the run's process-group timeout.

    ``init_device_mesh`` makes them with the backend's default (30 minutes for gloo), so a rank
    waiting on a stuck TP partner in a layer's all-reduce, or on its lane's gradient sum, would
    outwait the run's ``timeout`` and end by its own watchdog, blaming itself, instead of
    failing with the peer error at the timeout as the global group's collectives do.  A
    pipeline's stages wait for each other in point-to-point receives, which gloo bounds only by
    the timeout a group was made with: those groups are made with it (:meth:`ParallelDims.build`).
    """
    if timeout is not None:
        for group in (pmesh.tp_group, pmesh.dp_group):
            _set_pg_timeout(timeout, group)


@dataclass(frozen=True)
class LoaderView:
    """What the data loader (and each of its worker processes) needs of the layout: picklable numbers."""

    hdp_rank: int
    """This rank's HDP rank: the share of every plan it reads (every TP lane and stage of it reads the same)."""

    hdp_ranks: int
    """The HDP ranks the planner plans for (``world // (tensor_parallel * pipeline)``)."""

    ring_ranks: tuple[int, ...] | None
    """The global rank of every HDP rank in this lane and stage, which rings run between (``None``: the HDP ranks)."""

    pipeline_stages: int
    """The stages of every pipeline (1: no pipelines): the loader pads each pipeline's micro-batches for them."""

    tensor_parallel: int
    """Devices per HDP rank: a node of N devices holds ``N // tensor_parallel`` HDP ranks."""

    def hdp_ranks_per_node(self, devices: int | None) -> int | None:
        """The HDP ranks on a node of ``devices`` devices (the planner's ``ranks_per_node`` counts HDP ranks)."""
        return None if devices is None else max(1, int(devices) // self.tensor_parallel)


@dataclass(frozen=True)
class RunnerOptions:
    """What the strategy tells :func:`make_runner` besides the layout and the model."""

    bucket_bytes: int | None = None
    """The bucketed gradient sync's bucket size; ``None``: the flat sync."""

    owners: Mapping[int, int] | None = None
    """ZeRO-2: ``id(parameter) -> global rank`` that keeps its gradient."""

    stop_requested: Callable[[], bool] | None = None
    """Whether this rank asks to stop at this step boundary (preemption), asked once a step."""

    bucket_group: Callable[[], Any] | None = None
    """Makes plain HDP's bucket group (``None``: the default group); on a mesh the lane's data-parallel group is used."""

    stage_schedules: Callable[[DecoderStage], StageSchedules] | None = None
    """A pipeline's stages and schedules kept between steps (``None``: kept by the runner)."""

    compute_context: ComputeContext | None = None
    """Entered around every forward and loss of a pipeline stage (the precision plugin's autocast)."""


class Layout:
    """Plain HDP: every rank one HDP rank, the world's group its data-parallel group, no mesh.

    Made for the run with :meth:`of`; the class is chosen by :func:`layout_class`.  A degree of
    1 means off: plain HDP is the layout whose sizes are 1, so its place is lane 0, stage 0,
    and the HDP rank is the global rank.
    """

    mesh: ParallelMesh | None = None
    """The run's mesh: ``None`` exactly for plain HDP (tensor and pipeline sizes 1), before it is built too."""

    whole_layers = True
    """Every rank holds whole layers of the model (no tensor-parallel shard, no pipeline stage): what one device measures."""

    def __init__(self, dims: ParallelDims, rank: int, mesh: ParallelMesh | None = None) -> None:
        self._dims, self.rank = dims, rank

    @classmethod
    def of(cls, mesh: ParallelMesh | None, *, world_size: int, rank: int) -> Layout:
        """This rank's layout: ``rank`` of ``world_size`` (a mesh layout reads both from its ``mesh``).

        Plain HDP's place is its world: ``world_size=0`` (a strategy not given its devices yet) is
        a ``ParallelDimsError``, not a world of one, so the data module plans with its trainer's ranks.
        """
        return cls(ParallelDims(world_size), rank, mesh)

    # ------------------------------------------------------------------ place and groups
    @property
    def dims(self) -> ParallelDims:
        return self._dims

    @property
    def hdp_rank(self) -> int:
        return self.rank

    @property
    def lane(self) -> int:
        """This rank's tensor-parallel lane (0 without tensor parallelism)."""
        return 0

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (0 without pipelines)."""
        return 0

    @property
    def ring_ranks(self) -> tuple[int, ...] | None:
        """Global ranks rings over HDP ranks run between; ``None``: the HDP ranks are the global ranks."""
        return None

    @property
    def dp_group(self) -> Any:
        """The group the same shard of every HDP rank is summed on: the world's for plain HDP."""
        return dist.group.WORLD

    @property
    def tp_group(self) -> Any:
        raise ParallelDimsError("plain HDP (tensor_parallel_size=1) has no tensor-parallel group")

    @property
    def pp_group(self) -> Any:
        raise ParallelDimsError("a run without pipelines (pipeline_parallel_size=1) has no pipeline group")

    @property
    def pipeline_group(self) -> Any:
        """The group a norm over every stage is combined on; ``None`` without pipelines."""
        return None

    @property
    def device_mesh(self) -> Any:
        """The ``DeviceMesh`` the LightningModule gets as ``device_mesh`` (``None`` for plain HDP)."""
        return None

    @property
    def sampler_kwargs(self) -> dict[str, int]:
        """A ``DistributedSampler``'s replicas and rank: one replica per HDP rank."""
        return {"num_replicas": self.dims.data_parallel, "rank": self.hdp_rank}

    @property
    def loader_view(self) -> LoaderView:
        dims = self.dims
        return LoaderView(
            self.hdp_rank, dims.data_parallel, self.ring_ranks, dims.pipeline, dims.tensor_parallel
        )

    # ------------------------------------------------------------------ set-up
    @classmethod
    def build_mesh(
        cls, dims: ParallelDims, *, device_type: str, timeout: timedelta | None
    ) -> ParallelMesh | None:
        """The run's mesh, made once after the process group (on every rank); plain HDP has none."""
        return None

    @classmethod
    def check_before_launch(cls, *, scaler: Any, pipelines: int) -> None:
        """What the layout refuses before any rank starts (the precision plugin's ``scaler``; ``pipelines``: its size)."""

    def check_model(
        self, model: nn.Module, *, scaler: Any, run: str, warn: WarnFn, validates: bool = False
    ) -> None:
        """What the layout cannot run, refused at set-up by the setting's name.

        ``run``: the Trainer's ``fit``, ``validate``, ...; ``validates``: this ``fit`` runs validation
        batches (the Lightning floor's ``compat.fit_validates``).
        """

    def materialize(
        self,
        model: nn.Module,
        device: torch.device,
        *,
        default: Callable[[nn.Module, torch.device], None],
        warn: WarnFn,
    ) -> None:
        """A model on the meta device on ``device``: ``default`` (Lightning's, each module's ``reset_parameters``)."""
        default(model, device)

    def fsdp_driver(self, model: nn.Module) -> FSDPStepDriver | None:
        """The FSDP2 driver when ``configure_model`` applied ``fully_shard``: refused without the mesh."""
        if any(isinstance(m, FSDPModule) for m in model.modules()):
            raise FSDPSettingError(
                "configure_model applied fully_shard, but ByteScaleStrategy runs FSDP2 only on its mesh: pass "
                'tensor_parallel_size > 1 and shard with fully_shard(..., mesh=self.device_mesh["data_parallel"])'
            )
        return None

    @torch.no_grad()
    def broadcast_state(self, module: nn.Module) -> None:
        """Every rank starts from rank 0's parameters and buffers, as DDP makes them start."""
        broadcast_module_state(module)

    def make_runner(
        self, model: nn.Module, options: RunnerOptions, fsdp: FSDPStepDriver | None = None
    ) -> StepRunner:
        """Plain HDP's runner: the buckets on their own group (ring exchanges may run beside them on the world's)."""
        buckets = options.bucket_bytes is not None and options.bucket_group is not None
        group = options.bucket_group() if buckets else None  # type: ignore[misc]
        return HDPRunner(None, _sync_options(options, group))


def _of_the_mesh(name: str) -> Any:
    """A layout property read from its built mesh (:class:`~lightning_bytescale.parallel.dims.ParallelMesh`'s ``name``)."""
    return property(lambda self: getattr(self._mesh, name), doc=f"The mesh's ``{name}``.")


class MeshLayout(Layout):
    """HDP on the tensor-parallel mesh: an HDP rank is a TP group, with FSDP2 over ``"data_parallel"`` or not."""

    whole_layers = False

    def __init__(self, dims: ParallelDims, rank: int, mesh: ParallelMesh | None = None) -> None:
        super().__init__(dims, rank)
        self.mesh = mesh

    @classmethod
    def of(cls, mesh: ParallelMesh | None, *, world_size: int, rank: int) -> Layout:
        """This rank's layout on ``mesh`` (``None`` until set-up builds it): its place and world are the mesh's."""
        return cls(ParallelDims(max(1, world_size)), rank, mesh)

    @property
    def _mesh(self) -> ParallelMesh:
        if self.mesh is None:
            raise ParallelDimsError(
                "the layout's mesh is built at set-up (setup_environment); it is not built yet"
            )
        return self.mesh

    dims = _of_the_mesh("dims")
    hdp_rank = _of_the_mesh("hdp_rank")
    lane = _of_the_mesh("lane")
    stage = _of_the_mesh("stage")

    @property
    def ring_ranks(self) -> tuple[int, ...] | None:
        return tuple(self._mesh.ring_ranks)

    dp_group = _of_the_mesh("dp_group")
    tp_group = _of_the_mesh("tp_group")

    @property
    def device_mesh(self) -> Any:
        return self._mesh.mesh

    @classmethod
    def build_mesh(
        cls, dims: ParallelDims, *, device_type: str, timeout: timedelta | None
    ) -> ParallelMesh | None:
        """The mesh, its groups bounded by ``timeout`` (a pipeline's groups are made with it)."""
        pmesh = dims.build(device_type, timeout=timeout)
        bound_mesh_groups(pmesh, timeout)
        return pmesh

    def check_model(
        self, model: nn.Module, *, scaler: Any, run: str, warn: WarnFn, validates: bool = False
    ) -> None:
        """A float16 ``GradScaler`` is refused; a model with no parameter sharded over the lanes is warned about."""
        tp = self.dims.tensor_parallel
        if scaler is not None:
            raise ConfigError(
                f"tensor_parallel_size={tp} cannot run with a float16 GradScaler (precision='16-mixed'): each "
                "lane would decide on its own gradient shards whether to skip a step. Use precision='bf16-mixed' "
                "or '32-true'"
            )
        if not any(isinstance(p, DTensor) for p in model.parameters()):
            warn(
                f"ByteScaleStrategy(tensor_parallel_size={tp}): configure_model sharded no parameter (none is a "
                "DTensor), so every lane of an HDP rank runs the whole model on the same micro-batches. Apply "
                'parallelize_module(..., self.device_mesh["tensor_parallel"], plan) (or parallelize_llama / '
                "parallelize_hf) in configure_model, or use tensor_parallel_size=1"
            )

    def materialize(
        self,
        model: nn.Module,
        device: torch.device,
        *,
        default: Callable[[nn.Module, torch.device], None],
        warn: WarnFn,
    ) -> None:
        """Each rank allocates only its own shards, with global rank 0's draws of each module's ``reset_parameters``.

        The values are those Lightning's materialisation gives the unsharded model on one device
        (:func:`~lightning_bytescale.parallel.materialize.materialize_sharded`).
        """
        missing = materialize_sharded(model, device)
        if missing:
            warn(
                "Parameter initialization incomplete. The following modules have parameters or buffers with "
                "uninitialized memory because they don't define a `reset_parameters()` method for "
                f"re-initialization: {', '.join(missing)}"
            )

    def fsdp_driver(self, model: nn.Module) -> FSDPStepDriver | None:
        """The FSDP2 step driver when ``configure_model`` applied ``fully_shard`` (``None`` when it did not).

        The outermost unit (``fully_shard(self.model, ...)``, applied last) must hold every other one;
        it and every unit must shard over ``device_mesh["data_parallel"]`` with
        ``reshard_after_forward=False`` (:class:`~lightning_bytescale.parallel.FSDPStepDriver` refuses
        the rest by name).
        """
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if not units:
            return None
        outer = [u for u in units if not any(u is not o and u in set(o.modules()) for o in units)]
        if len(outer) != 1:
            raise FSDPSettingError(
                f"configure_model made {len(outer)} outermost fully_shard units; apply fully_shard last to the one "
                "module that holds all of them (fully_shard(self.model, ...), with the LightningModule's parameters inside it)"
            )
        root = outer[0]
        inside = {id(p) for p in root.parameters()}
        outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in inside]
        if outside:
            raise FSDPSettingError(
                f"parameters {outside[:3]} are outside the outermost fully_shard unit {type(root).__name__}; keep every "
                "trained parameter inside it"
            )
        driver = FSDPStepDriver(root, self.dp_group)
        stale = [n for n, p in driver.unmanaged(model.named_parameters()) if p.requires_grad]
        if stale:
            raise FSDPSettingError(
                f"parameters {stale[:3]} are no longer the ones fully_shard manages (new Parameters assigned to the "
                "module after fully_shard?), so FSDP2 would gather and reduce others; assign parameters before "
                "fully_shard in configure_model"
            )
        return driver

    @torch.no_grad()
    def broadcast_state(self, module: nn.Module) -> None:
        """Every rank starts from HDP rank 0's parameters and buffers of its own lane.

        Plain tensors (replicated on every lane: norms, tied embeddings, buffers) come from global
        rank 0; DTensor shards from the same lane of HDP rank 0, over the lane's data-parallel group.
        Parameters FSDP2 shards over the HDP ranks are left as they are: ``fully_shard`` cut each
        rank's part from the whole tensor that rank built, so every rank must build the same one
        (seed before building the model).
        """
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
        src = self.dims.global_rank(0, self.lane)
        broadcast_tensors([t.to_local() for t in shards], src=src, group=self.dp_group)

    def make_runner(
        self, model: nn.Module, options: RunnerOptions, fsdp: FSDPStepDriver | None = None
    ) -> StepRunner:
        """The mesh's runner: the buckets sum local shards on the lane's data-parallel group; FSDP2 reduces its own."""
        return MeshRunner(self._mesh, fsdp, _sync_options(options, self.dp_group))


class PipelineLayout(MeshLayout):
    """HDP over pipelines: an HDP rank is a pipeline of stages (times its TP group); the model is one stage.

    Not yet with pipelines, refused by the setting's name: a float16 ``GradScaler`` (before the
    launch and at set-up), prediction, a model on the meta device, ``fully_shard``.  Validation and
    test run the pipeline's forward-only schedule (:meth:`PipelineRunner.evaluate`).
    """

    pp_group = _of_the_mesh("pp_group")
    pipeline_group = _of_the_mesh("pp_group")

    @classmethod
    def check_before_launch(cls, *, scaler: Any, pipelines: int) -> None:
        """A float16 ``GradScaler`` (``precision="16-mixed"``) is refused: before the launch, and again at set-up."""
        if scaler is not None:
            raise ConfigError(
                f"pipeline_parallel_size={pipelines}: {_NOT_WITH_PIPELINES['precision=16-mixed']}"
            )

    def check_model(
        self, model: nn.Module, *, scaler: Any, run: str, warn: WarnFn, validates: bool = False
    ) -> None:
        """What cannot run with pipelines yet, refused by the setting's name; the stage is checked (:func:`stage_of`)."""
        pp = self.dims.pipeline
        type(self).check_before_launch(scaler=scaler, pipelines=pp)
        if run == "predict":  # at set-up, not at the first batch
            raise refuse_evaluation("trainer.predict()", pp)
        if validates or run in ("validate", "test"):
            hook = "test_step" if run == "test" else "validation_step"
            warn(
                f"pipeline_parallel_size={pp}: the LightningModule's {hook} is not called; each pipeline runs its "
                f"micro-batches through the forward-only schedule and the strategy logs "
                f"{'test' if run == 'test' else 'val'}/loss, the token mean of the split (as training_step is not "
                "called and the last stage computes the token loss)"
            )
        refusals = {
            "empty_init=True": any(p.is_meta for p in model.parameters()),
            "fully_shard": any(isinstance(m, FSDPModule) for m in model.modules()),
        }
        for setting, refused in refusals.items():
            if refused:
                raise ConfigError(f"pipeline_parallel_size={pp}: {_NOT_WITH_PIPELINES[setting]}")
        stage_of(model, self._mesh)

    materialize = Layout.materialize  # nothing is on the meta device (refused at set-up): as without a mesh

    def fsdp_driver(self, model: nn.Module) -> FSDPStepDriver | None:
        return None  # refused at set-up (check_model)

    @torch.no_grad()
    def broadcast_state(self, module: nn.Module) -> None:
        """Every rank starts from HDP rank 0's parameters and buffers of its own stage (and lane).

        Plain tensors come from lane 0 of HDP rank 0 of the stage (over the TP group, then the
        stage's data-parallel group); DTensor shards from the same lane of HDP rank 0 of the stage.
        """
        tensors = list({id(t): t for t in (*module.parameters(), *module.buffers())}.values())
        plain = [t for t in tensors if not isinstance(t, DTensor)]
        dims, stage = self.dims, self.stage
        if dims.tensor_parallel > 1:
            broadcast_tensors(plain, src=dims.global_rank(self.hdp_rank, 0, stage), group=self.tp_group)
        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        broadcast_tensors(local, src=dims.global_rank(0, self.lane, stage), group=self.dp_group)

    def make_runner(
        self, model: nn.Module, options: RunnerOptions, fsdp: FSDPStepDriver | None = None
    ) -> StepRunner:
        """The pipeline's runner for this rank's stage: the buckets on the stage's data-parallel group."""
        return PipelineRunner(
            stage_of(model, self._mesh),
            self._mesh,
            _sync_options(options, self.dp_group),
            schedules=options.stage_schedules,
            compute_context=options.compute_context,
        )


_NOT_WITH_PIPELINES = {
    "precision=16-mixed": "a float16 GradScaler (precision='16-mixed') is not supported: the loss is computed "
    "inside torch's pipeline schedule, which the scaler does not see, and each stage's optimizer would decide on "
    "its own gradients whether to skip a step. Use precision='bf16-mixed' (no scaler), '32-true' or '64-true'",
    "empty_init=True": "the model has parameters on the meta device (Trainer.init_module(empty_init=True)); build "
    "it on the device in configure_model and replace it by its LlamaStage",
    "fully_shard": "configure_model applied fully_shard, which is not supported with pipelines yet: FSDP2's "
    "gathers and reduce-scatters are not driven inside torch's pipeline schedule. Remove fully_shard (each stage "
    "already holds only its own blocks)",
}


def layout_class(*, tensor_parallel: int, pipeline: int) -> type[Layout]:
    """The run's layout from its sizes (1 means off): the one place that chooses between layouts."""
    if pipeline > 1:
        return PipelineLayout
    if tensor_parallel > 1:
        return MeshLayout
    return Layout


def make_runner(
    layout: Layout, model: nn.Module, options: RunnerOptions, fsdp: FSDPStepDriver | None = None
) -> StepRunner:
    """The layout's step runner for ``model`` (``fsdp``: its FSDP2 driver on the mesh, :meth:`Layout.fsdp_driver`)."""
    return layout.make_runner(model, options, fsdp)


def stage_of(module: nn.Module, pmesh: ParallelMesh) -> DecoderStage:
    """The one :class:`DecoderStage` (``LlamaStage``, ``HFDecoderStage``) of ``module``: this rank's stage, holding every trained parameter."""
    pp = pmesh.dims.pipeline
    stages = [m for m in module.modules() if isinstance(m, DecoderStage)]
    if len(stages) != 1:
        raise PipelineModelError(
            f"with pipeline_parallel_size={pp} the LightningModule must hold exactly one pipeline stage, a "
            f"lightning_bytescale.parallel.DecoderStage (it holds {len(stages)}): in configure_model replace the "
            'model by this rank\'s stage, self.model = LlamaStage(model, self.device_mesh["pipeline"].get_local_rank(), '
            f"{pp}) for the reference Llama (HFCausalLM does this itself with an HFDecoderStage; the recipes' model "
            "too), or a DecoderStage subclass of your own for another decoder (docs/pipelines.md)"
        )
    stage = stages[0]
    if (stage.stage, stage.stages) != (pmesh.stage, pp):
        raise PipelineModelError(
            f"the {type(stage).__name__} is stage {stage.stage} of {stage.stages} but this rank is stage {pmesh.stage} of {pp}; "
            f'build it as {type(stage).__name__}(model, self.device_mesh["pipeline"].get_local_rank(), '
            'self.device_mesh["pipeline"].size())'
        )
    held = set(map(id, stage.parameters()))
    trained_elsewhere = sorted(
        name for name, p in module.named_parameters() if p.requires_grad and id(p) not in held
    )
    if not trained_elsewhere:
        return stage
    raise PipelineModelError(
        f"parameters {trained_elsewhere[:3]} are trained but are not in the {type(stage).__name__}; with pipelines only the "
        "stage runs, so keep every trained parameter inside it (or set requires_grad=False)"
    )


def sharded_over_hdp_ranks(t: Any) -> bool:
    """A DTensor sharded on ``"data_parallel"`` (FSDP2): each HDP rank holds a different part."""
    names = tuple(t.device_mesh.mesh_dim_names or ())
    # not is_shard(): FSDP2 around a TP shard uses _StridedShard, which is no Shard in every torch release
    return DATA_PARALLEL in names and not t.placements[names.index(DATA_PARALLEL)].is_replicate()


def _sync_options(options: RunnerOptions, group: Any) -> SyncOptions:
    """The runner's gradient sync on ``group``: buckets of ``options.bucket_bytes`` (or flat), ZeRO-2's owners, the stop request."""
    buckets = (
        no_buckets
        if options.bucket_bytes is None
        else GradSyncCache(group=group, bucket_bytes=options.bucket_bytes, owners=options.owners)
    )
    return SyncOptions(buckets=buckets, owners=options.owners, stop_requested=options.stop_requested)


__all__ = [
    "Layout",
    "LoaderView",
    "MeshLayout",
    "PipelineLayout",
    "RunnerOptions",
    "WarnFn",
    "bound_mesh_groups",
    "check_cost_model_devices",
    "check_size",
    "check_world",
    "layout_class",
    "make_runner",
    "sharded_over_hdp_ranks",
    "stage_of",
]
