"""`ByteScaleStrategy`: Hybrid Data Parallelism as a Lightning strategy (the glue, not the algorithm).

One Lightning batch is one optimizer step: every rank's loader yields one
:class:`~lightning_bytescale.engine.batch.StepBatch` holding *its own* micro-batches (their number
differs between ranks), which the step loop (:mod:`~lightning_bytescale.lightning.step`) runs with
the LightningModule's ``training_step`` as the forward; ``backward``, which every rank runs once
per step, joins the gradient sync before the backward hooks.  Losses are token sums over the
global token count, so training equals one process on the whole global batch.

The model is never wrapped in ``DistributedDataParallel`` (DDP needs the same number of
synchronised backwards on every rank).  The strategy is three bases and the glue that joins them:
what DDP's strategy would do (:mod:`~lightning_bytescale.lightning.process_strategy`), Lightning's
step hooks over the step loop (:mod:`~lightning_bytescale.lightning.step_hooks`) and its
checkpoint hooks per layout (:mod:`~lightning_bytescale.lightning.checkpoint_hooks`).  This file
builds the run's layout and runner (:mod:`~lightning_bytescale.parallel.layout`) and calls modules
that take narrow inputs, never the strategy: argument checks (``strategy_options``), refusals
(``run_checks``), guards (``run_guards``), ZeRO (``parallel.zero``), clipping (``clipping``), the
measured cost model (``auto_cost``, ``cost_refinement``).  ``bytescale`` (popen launcher),
``bytescale_spawn`` and ``bytescale_fork`` are registered at the end.
"""

from __future__ import annotations

import inspect
import warnings
from contextlib import suppress
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_bytescale.engine.failures import add_peer_failure_hint
from lightning_bytescale.engine.runner import StepRunner
from lightning_bytescale.engine.zero import resolve_zero_level

# Modules of this floor that import Lightning are imported as modules: the first import of
# Lightning imports this module (it registers the strategy names), maybe while one of them is
# still being imported.
from lightning_bytescale.lightning import (
    auto_cost,
    clipping,
    cost_refinement,
    process_groups,
    run_checks,
    run_guards,
)
from lightning_bytescale.lightning import compat as compat
from lightning_bytescale.lightning import epoch_metrics as epoch_metrics
from lightning_bytescale.lightning import progress as progress
from lightning_bytescale.lightning import step as step_loop
from lightning_bytescale.lightning import strategy_options as options_
from lightning_bytescale.lightning.checkpoint_hooks import LayoutCheckpointHooks
from lightning_bytescale.lightning.process_strategy import ProcessGroupStrategy
from lightning_bytescale.lightning.step_hooks import StepLoopHooks
from lightning_bytescale.parallel.errors import ParallelDimsError
from lightning_bytescale.parallel.layout import (
    Layout,
    LoaderView,
    RunnerOptions,
    check_cost_model_devices,
    check_size,
    check_world,
    layout_class,
    make_runner,
)
from lightning_bytescale.parallel.pipeline_stage import DecoderStage
from lightning_bytescale.parallel.pipeline_step import StageSchedules
from lightning_bytescale.parallel.zero import ClipFn, shard_optimizers
from lightning_bytescale.planner.config import PlannerConfig

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.accelerators import Accelerator

    from lightning_bytescale.engine.watchdog import StepWatchdog
    from lightning_bytescale.lightning.preemption import PreemptionHandler

# Deprecations inside our dependencies that a user can do nothing about, printed by every rank
# at every start: Lightning 2.6's pytree helper (torch 2.13) and torchdata's loader.
warnings.filterwarnings(
    "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
)
warnings.filterwarnings("ignore", message=r"'set_vital' is deprecated", category=UserWarning)

__all__ = ["ByteScaleStrategy"]


class ByteScaleStrategy(LayoutCheckpointHooks, StepLoopHooks, ProcessGroupStrategy):
    """Hybrid Data Parallelism (ByteScale) over all ranks of one global process group.

    Every option is in docs/strategy.md's table.

    Args:
        planner, capacity, cp_size, offload, slack, seed, cost_model, comm_aware, ranks_per_node,
            num_buckets, pipeline_degree, max_micro_batches, options: the fields of
            :class:`~lightning_bytescale.planner.config.PlannerConfig` (docs/planner.md), kept as
            ``strategy.planner_config``, which the data module plans with; ``planner`` may be a
            whole ``PlannerConfig`` (then leave the others at their defaults).  Here
            ``offload=False`` (off) is the default, an ``ActivationOffloader`` is used as it is,
            and ``pipeline_degree`` follows ``pipeline_parallel_size`` (leave it at 1).
            ``cost_model="auto"`` measures the model on each rank's device at set-up, once, the
            same on every rank, cached on disk (:mod:`~lightning_bytescale.lightning.auto_cost`).
        refine_cost_model: refit the cost model from the run's micro-batch times while training
            (:mod:`~lightning_bytescale.lightning.cost_refinement`): ``None`` (default) with
            ``cost_model="auto"`` only, ``True``/``False``, or a ``RefitConfig``.
        check_finite, locate_non_finite, check_loss_normalization, check_attention,
            check_parameters_every_n_steps, log_loss, loss_name, offloader_options: the step
            loop's options, the fields of :class:`~lightning_bytescale.lightning.step.LoopOptions`
            (a docstring each), kept as ``strategy.loop_options``.
        zero: ZeRO level: ``0`` (default) nothing sharded; ``1`` optimizer state sharded with
            ``ZeroRedundancyOptimizer``; ``2`` gradients too, each reduced to the rank owning its
            state (:mod:`~lightning_bytescale.engine.zero`); clipping uses the global norm at every level.
            On the mesh (``tensor_parallel_size`` or ``pipeline_parallel_size`` > 1) each lane's and
            stage's HDP ranks split them (:class:`~lightning_bytescale.parallel.zero.LaneZero`).
        zero1: the older spelling of ``zero=1`` (``True``); contradicting ``zero`` is an error.
        tensor_parallel_size: ``N > 1``: an HDP rank is a group of ``N`` ranks on the mesh
            ``(data_parallel, tensor_parallel)``, the LightningModule's ``device_mesh`` in
            ``configure_model`` (:class:`~lightning_bytescale.parallel.layout.MeshLayout`, docs/tensor-parallel.md).
        pipeline_parallel_size: ``P > 1``: an HDP rank is a pipeline of ``P`` stages (times its TP
            group) on the mesh ``(pipeline, data_parallel, tensor_parallel)``; ``configure_model``
            replaces the model by its ``LlamaStage`` and the step runs torch's pipeline schedule
            (:class:`~lightning_bytescale.parallel.layout.PipelineLayout`, docs/pipelines.md).
        gradient_sync: ``"bucketed"`` (default): bucket all-reduces overlapped with the last
            micro-batch's backward (:mod:`~lightning_bytescale.engine.grad_sync`); ``"flat"``: one
            all-reduce of every gradient copied into one buffer after the loop.
        bucket_cap_mb: bucket size in MB for ``gradient_sync="bucketed"`` (DDP's default, 25).
        watchdog: a rank whose step makes no progress for ``timeout`` (or ``watchdog``) seconds
            writes where it was and exits with code 124 (:mod:`~lightning_bytescale.engine.watchdog`); ``False``: off.
        preemption: SIGTERM (or the signals named) sets a flag agreed in the step's all-reduce (on
            the mesh in the lanes' too, so every rank agrees on the step); at the next step boundary
            every rank saves ``hpc_ckpt_<n>.ckpt`` and exits with code 143
            (:mod:`~lightning_bytescale.lightning.preemption`); ``False`` leaves Lightning's handler.
        checkpoint_format: ``"sharded"`` (a folder every rank writes its part of, resharding on
            load: :mod:`~lightning_bytescale.lightning.checkpoint`), ``"consolidated"`` (one file
            from rank 0) or ``"auto"`` (sharded exactly when ZeRO or, with ``tensor_parallel_size > 1``,
            FSDP2 splits the optimizer state; always with pipelines); both formats load.
        timeout, accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend, start_method: the process group's and the launch's, as for
            :class:`~lightning_bytescale.lightning.process_strategy.ProcessGroupStrategy`.
    """

    strategy_name = "bytescale"
    description = "ByteScale Hybrid Data Parallelism"

    def __init__(
        self,
        planner: str | PlannerConfig = "balance",
        capacity: int = 8192,
        cp_size: int | None = None,
        offload: Any = False,
        offloader_options: dict[str, Any] | None = None,
        slack: float = 0.05,
        seed: int | None = None,
        cost_model: Any = None,
        refine_cost_model: Any = None,
        comm_aware: bool = True,
        ranks_per_node: int | None = None,
        num_buckets: int = 8,
        pipeline_degree: int = 1,
        max_micro_batches: int | None = None,
        options: dict[str, Any] | None = None,
        zero: int = 0,
        zero1: bool | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        timeout: float | int | timedelta | None = default_pg_timeout,
        check_finite: bool = True,
        locate_non_finite: bool = False,
        check_loss_normalization: bool = True,
        check_attention: bool = True,
        check_parameters_every_n_steps: int = 100,
        gradient_sync: Literal["bucketed", "flat"] = "bucketed",
        bucket_cap_mb: float = 25.0,
        watchdog: bool | float = True,
        preemption: bool | tuple[str, ...] = True,
        checkpoint_format: Literal["auto", "sharded", "consolidated"] = "auto",
        log_loss: bool = True,
        loss_name: str = "train/loss",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        start_method: Literal["popen", "spawn", "fork"] = "popen",
        **unknown: Any,
    ) -> None:
        signature = inspect.signature(ByteScaleStrategy.__init__).parameters
        options_.refuse_unknown_options(unknown, [p for p in signature if p not in ("self", "unknown")])
        tp = check_size("tensor_parallel_size", tensor_parallel_size, "no tensor parallelism")
        pp = check_size("pipeline_parallel_size", pipeline_parallel_size, "no pipelines")
        # the run's layout, chosen once from its sizes (1 means off), and how it saves and loads
        self._layout_class = layout_class(tensor_parallel=tp, pipeline=pp)
        self.init_checkpoints(self._layout_class, pipelines=pp, checkpoint_format=checkpoint_format)
        cost_model, self._cost_model_auto = auto_cost.split_auto(cost_model)  # "auto": measured in setup
        planner_config = options_.strategy_planner_config(
            planner, {k: p.default for k, p in signature.items()}, pipelines=pp,
            capacity=capacity, cp_size=cp_size, offload=offload, slack=slack, seed=seed,
            cost_model=cost_model, comm_aware=comm_aware, ranks_per_node=ranks_per_node,
            num_buckets=num_buckets, pipeline_degree=pipeline_degree, max_micro_batches=max_micro_batches,
            options=options,
        )  # fmt: skip
        options_.check_step_options(
            check_parameters_every_n_steps=check_parameters_every_n_steps, start_method=start_method,
            offloader_options=offloader_options, gradient_sync=gradient_sync, bucket_cap_mb=bucket_cap_mb,
            watchdog=watchdog,
        )  # fmt: skip
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices,
            cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin, process_group_backend=process_group_backend, timeout=timeout,
            start_method=start_method,
        )  # fmt: skip
        self.planner_config: PlannerConfig = planner_config  # what the data module plans with
        self.zero = resolve_zero_level(zero, zero1)
        self.zero1 = self.zero >= 1  # optimizer state is sharded (ZeRO-1 and ZeRO-2)
        self._grad_owners: dict[int, int] | None = None  # ZeRO-2: id(parameter) -> owning global rank
        self.tensor_parallel_size: int = tp
        self.pipeline_parallel_size: int = pp
        check_cost_model_devices(planner_config, tp)
        if self._cost_model_auto:
            auto_cost.check_auto(self._layout_class, tp, pp)
        cost_refinement.check_option(refine_cost_model, self._layout_class, tp, pp)
        self.refine_cost_model, self._refine_auto = refine_cost_model, self._cost_model_auto
        self.cost_refinement: Any = None  # this rank's CostRefinement while fitting
        self._mesh: Any = None  # the ParallelMesh (tensor or pipeline parallelism), built at set-up
        self._layout: Layout | None = None
        self._runner: StepRunner | None = None  # the layout's step runner, made at set-up
        self.fsdp: Any = None  # the FSDPStepDriver when configure_model applied fully_shard
        self._stage_schedules: Any = None  # pipelines: the StageSchedules kept between steps
        self._fitting = False
        self.loop_options = step_loop.LoopOptions(
            check_finite=bool(check_finite), locate_non_finite=bool(locate_non_finite),
            check_loss_normalization=bool(check_loss_normalization), check_attention=bool(check_attention),
            check_parameters_every_n_steps=check_parameters_every_n_steps, log_loss=bool(log_loss),
            loss_name=loss_name, offload=offload if hasattr(offload, "micro_batch_context") else planner_config.offload,
            offloader_options=dict(offloader_options or {}), pg_seconds=self.timeout_seconds,
        )  # fmt: skip
        self.gradient_sync = gradient_sync
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.watchdog: bool | float = watchdog if isinstance(watchdog, bool) else float(watchdog)
        self.preemption = preemption
        self.init_step_loop()
        self._watchdog: StepWatchdog | None = None
        self._preemption: PreemptionHandler | None = None
        self._grad_group: Any = None

    # ------------------------------------------------------------------ the layout
    @property
    def parallel_mesh(self) -> Any:
        """The run's ``ParallelMesh`` (tensor or pipeline parallelism), built at set-up; ``None`` for plain HDP."""
        return self._mesh

    @parallel_mesh.setter
    def parallel_mesh(self, pmesh: Any) -> None:
        self._mesh, self._layout = pmesh, None  # a mesh built elsewhere (its groups are made once)
        self._stage_schedules = None  # a pipeline's stages were made for the mesh it replaces

    @property
    def layout(self) -> Layout:
        """This rank's :class:`~lightning_bytescale.parallel.layout.Layout` (plain HDP: sizes 1, no mesh).

        Plain HDP's is known once the Trainer gave the strategy its devices (a ``ParallelDimsError`` before).
        """
        if self._layout is None:
            world = self.num_nodes * self.num_processes
            self._layout = self._layout_class.of(self._mesh, world_size=world, rank=self.global_rank)
        return self._layout

    @property
    def loader_view(self) -> LoaderView | None:
        """What the data loader plans with (:class:`~lightning_bytescale.parallel.layout.LoaderView`).

        ``None`` before the mesh is built, or before a plain HDP strategy has its devices: the
        data module then plans with its trainer's ranks.
        """
        with suppress(ParallelDimsError):
            return self.layout.loader_view
        return None

    # ------------------------------------------------------------------ what the step loop reads (StepHost)
    @property
    def step_runner(self) -> StepRunner:
        if self._runner is None:
            raise RuntimeError("ByteScaleStrategy's step runner is made at set-up (Trainer.fit/validate/...)")
        return self._runner

    @property
    def counts_tokens(self) -> bool:
        return self.layout.lane == 0

    @property
    def step_watchdog(self) -> StepWatchdog | None:
        return self._watchdog

    @property
    def preemption_handler(self) -> PreemptionHandler | None:
        return self._preemption

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.layout.sampler_kwargs  # one replica per HDP rank

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Restore weights after the precision plugin converted the module (a 64-true run whose
        # module was built in float32 would otherwise load its float64 checkpoint through float32).
        return True

    @override
    def _configure_launcher(self) -> None:
        check_world(  # in Trainer(...)
            self.tensor_parallel_size, self.num_processes, self.num_nodes, self.pipeline_parallel_size
        )
        super()._configure_launcher()

    def check_before_launch(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        """What can be refused before any rank starts, once: the launchers call it with the run's arguments.

        Gradient accumulation over Lightning batches, a float16 ``GradScaler`` with pipelines, a
        cost model whose attention heads are not the model's (where the module already holds its
        model; set-up checks again after ``configure_model``), and a data module whose own planner
        arguments contradict :attr:`planner_config` or whose options the HDP ranks cannot run
        (``ByteScaleDataModule.validate``: a ``context_length`` longer than the planner can place).
        """
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        run_checks.check_trainer(
            trainer, config=self.planner_config, module=self.lightning_module, tensor_parallel_size=tp
        )
        self._layout_class.check_before_launch(
            scaler=getattr(self.precision_plugin, "scaler", None), pipelines=pp
        )
        progress.prefer_step_bar(trainer)  # Lightning's default bar reads "Epoch 0/-2" on step-bounded runs
        hdp_ranks = max(1, self.num_nodes * self.num_processes // (tp * pp))
        run_checks.check_data_modules((*args, *kwargs.values()), self.planner_config, hdp_ranks=hdp_ranks)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the device, ranks and default process group
        # the mesh (once; none for plain HDP), the module's device_mesh before configure_model
        if self._mesh is None:
            dims = check_world(
                self.tensor_parallel_size, self.num_processes, self.num_nodes, self.pipeline_parallel_size
            )
            self._mesh = self._layout_class.build_mesh(
                dims, device_type=self.root_device.type, timeout=self._timeout
            )
        self._layout = None
        if self.lightning_module is not None:  # what Lightning's ModelParallelStrategy sets (None: no mesh)
            self.lightning_module._device_mesh = self.layout.device_mesh

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        module = trainer.lightning_module
        run_checks.check_trainer(  # again: configure_model has built the model
            trainer, config=self.planner_config, module=module, tensor_parallel_size=self.tensor_parallel_size
        )
        fitting = run_checks.check_fit(trainer)
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        layout, scaler = self.layout, getattr(self.precision_plugin, "scaler", None)
        validates = fitting and compat.fit_validates(trainer)
        layout.check_model(
            self.model, scaler=scaler, run=trainer.state.fn.value, warn=rank_zero_warn, validates=validates
        )
        # a model on the meta device: on the mesh each rank allocates its own shards, with rank 0's draws
        layout.materialize(
            self.model, self.root_device, default=compat._materialize_distributed_module, warn=rank_zero_warn
        )
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # What DDP does when it wraps a model: every rank starts from rank 0's state (of its lane and stage).
        self.phase = "the broadcast of rank 0's parameters and buffers"
        self.fsdp = layout.fsdp_driver(self.model)  # fully_shard in configure_model
        layout.broadcast_state(self.model)
        if self._cost_model_auto:  # once, on every rank, before any loader plans
            self.planner_config = auto_cost.resolve_auto(
                self.planner_config, module, device=self.root_device,
                precision=str(self.precision_plugin.precision), world_size=self.world_size,
            )  # fmt: skip
            self._cost_model_auto = False
            options_.check_cost_model_heads(self.planner_config, module, self.tensor_parallel_size)
        self.cost_refinement = cost_refinement.attach(
            trainer, self.planner_config, self.refine_cost_model, auto=self._refine_auto,
            rank=self.global_rank, whole_layers=layout.whole_layers,
        )  # fmt: skip
        self._fitting = fitting
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            compat._optimizers_to_device(self.optimizers, self.root_device)
        self._loop.steps_run = 0
        self._runner = make_runner(layout, self.model, self._runner_options(), self.fsdp)
        if fitting and not any(isinstance(c, epoch_metrics.TrainEpochMetrics) for c in trainer.callbacks):
            trainer.callbacks.append(epoch_metrics.TrainEpochMetrics(self.reduce))
        # the run's guards: the step watchdog, and the preemption handler (its callback installs it at train start)
        if self._watchdog is None:
            self._watchdog = run_guards.start_watchdog(
                self.watchdog, pg_seconds=self.timeout_seconds, rank=self.global_rank
            )
        handler = run_guards.preemption_handler(trainer, self.preemption)
        if handler is not None:  # a fit with preemption on (another run keeps the last fit's)
            self._preemption = handler

    @override
    def teardown(self) -> None:
        try:
            if self._runner is not None:
                self._runner.close()
        finally:
            if self._watchdog is not None:
                self._watchdog.stop()
                self._watchdog = None
            # a step that failed part-way leaves its state (and the works it holds) here; the
            # group stays registered with torch.distributed (as DDP's do) but this strategy no
            # longer holds it: once the user destroys the process groups nothing keeps it alive
            self._loop.step = None
            self._grad_group = None
            self._runner = None
            self._stage_schedules = None  # the pipeline stages and their receive buffers
        super().teardown()

    @override
    def on_train_start(self) -> None:
        assert self.lightning_module is not None
        run_checks.warn_if_fit_never_validates(self.lightning_module.trainer, warn=rank_zero_warn)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        schedulers = [c.scheduler for c in self.lr_scheduler_configs]
        sharded = shard_optimizers(self.optimizers, self.layout, self.zero, schedulers=schedulers)
        self.optimizers = sharded.optimizers
        self._grad_owners = sharded.owners  # ZeRO-2: id(parameter) -> the global rank keeping its gradient
        self._clip_by_global_norm(sharded.clip)

    def _clip_by_global_norm(self, clip: ClipFn | None = None) -> None:
        """The one install of clipping by norm (:func:`~lightning_bytescale.lightning.clipping.install_clip_by_norm`)."""
        clipping.install_clip_by_norm(self.precision_plugin, clip, zero=self.zero)

    def _runner_options(self) -> RunnerOptions:
        """What the layout's runner is made with: the gradient sync, ZeRO-2's owners, the stop flag, a pipeline's stages."""
        bucketed = self.gradient_sync == "bucketed"
        return RunnerOptions(
            bucket_bytes=int(self.bucket_cap_mb * 2**20) if bucketed else None,
            owners=self._grad_owners,
            stop_requested=self._loop.stop_requested,
            bucket_group=self._bucket_group,
            stage_schedules=lambda stage: stage_schedules(self, stage),
            compute_context=self.precision_plugin.train_step_context,  # autocast under "bf16-mixed"
        )

    def _bucket_group(self) -> Any:
        """Plain HDP's bucket group: its own (:func:`~lightning_bytescale.lightning.process_groups.new_bucket_group`, once, when training), else the default group."""
        if self._grad_group is None and self._fitting:
            self._grad_group = process_groups.new_bucket_group(
                backend=self._process_group_backend, timeout=self._timeout, world_size=self.world_size
            )
        return self._grad_group

    # ------------------------------------------------------------------ options
    def planner_options(self) -> dict[str, Any]:
        """:attr:`planner_config` as flat ``make_plan`` options (a view; the config is the truth)."""
        return self.planner_config.as_options()

    # The planner options as attributes (``strategy.capacity``): read-only views of ``planner_config``,
    # whose one door is the constructor (setting one is a ConfigError naming the constructor option).
    planner = options_.planner_view("planner")
    capacity = options_.planner_view("capacity")
    cp_size = options_.planner_view("cp_size")
    slack = options_.planner_view("slack")
    seed = options_.planner_view("seed")
    cost_model = options_.planner_view("cost_model")
    comm_aware = options_.planner_view("comm_aware")
    ranks_per_node = options_.planner_view("ranks_per_node")
    offload = options_.planner_view("offload", read=lambda strategy: strategy.loop_options.offload)

    # ------------------------------------------------------------------ errors
    @override
    def on_exception(self, exception: BaseException) -> None:
        add_peer_failure_hint(exception, rank=self.global_rank, timeout=self._timeout, phase=self.phase)


def stage_schedules(strategy: Any, stage: DecoderStage) -> StageSchedules:
    """The strategy's :class:`StageSchedules` of ``stage``: kept between steps, bounded by the planner's ``max_micro_batches``."""
    schedules = strategy._stage_schedules
    if getattr(schedules, "module", None) is not stage:  # none yet, or made for another stage module
        schedules = strategy._stage_schedules = StageSchedules(
            stage, strategy.parallel_mesh, max_micro_batches=strategy.planner_config.max_micro_batches
        )
    return schedules


ByteScaleStrategy.register_strategies(StrategyRegistry)
