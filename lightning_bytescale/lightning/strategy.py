"""`ByteScaleStrategy`: Hybrid Data Parallelism as a Lightning strategy (the glue, not the algorithm).

One Lightning batch is one optimizer step: every rank's loader yields one
:class:`~lightning_bytescale.engine.batch.StepBatch` holding *its own* micro-batches (their
number differs between ranks).  The strategy hands them to the engine's one step loop
(:func:`~lightning_bytescale.engine.executor.run_micro_batches`, with the LightningModule's
``training_step`` as the forward and the precision plugin's backward), and before clipping and
the optimizer step joins the engine's single all-reduce
(:func:`~lightning_bytescale.engine.executor.sync_step`).  Losses are token sums divided by the
global token count, so the result equals single-process training on the whole global batch.

The model is never wrapped in ``DistributedDataParallel`` (DDP needs the same number of
synchronised backwards on every rank), so the strategy is a ``ParallelStrategy``, like
Lightning's ``ModelParallelStrategy``, and does itself what DDP would: it sets the device,
initialises the process group (NCCL on CUDA, gloo on CPU), materialises meta-device models
from ``configure_model``, and broadcasts rank 0's parameters and buffers so every rank starts
from the same model.  Registration of ``bytescale`` (popen launcher), ``bytescale_spawn`` and
``bytescale_fork`` is at the end of this file.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_bytescale.engine.batch import PackedMicroBatch, StepBatch
from lightning_bytescale.engine.executor import (
    LocalResult,
    StepResult,
    check_step,
    describe_micro_batch,
    run_micro_batches,
    sync_step,
)
from lightning_bytescale.engine.failures import is_peer_failure, peer_failure_message
from lightning_bytescale.engine.grad_sync import BucketedGradSync
from lightning_bytescale.engine.loss import IGNORE_INDEX
from lightning_bytescale.engine.loss_check import LossScaling
from lightning_bytescale.engine.state_sync import broadcast_module_state
from lightning_bytescale.engine.zero import (
    clip_grad_norm_,
    drop_unowned_gradients,
    owner_ranks,
    resolve_zero_level,
)
from lightning_bytescale.errors import ConfigError
from lightning_bytescale.lightning import compat as compat
from lightning_bytescale.planner.config import PlannerConfig

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.accelerators import Accelerator

    from lightning_bytescale.engine.watchdog import StepWatchdog
    from lightning_bytescale.lightning.preemption import PreemptionHandler

log = logging.getLogger(__name__)

# Deprecations inside our dependencies that a user can do nothing about, printed by every rank
# at every start: Lightning 2.6's pytree helper (torch 2.13) and torchdata's loader.
warnings.filterwarnings(
    "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
)
warnings.filterwarnings("ignore", message=r"'set_vital' is deprecated", category=UserWarning)

LOSS_PROBE_STEPS = 3  # steps in which each rank probes the loss normalisation until one probe is conclusive


def _as_timedelta(timeout: float | int | timedelta | None) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"timeout must be positive seconds or a timedelta, got {timeout!r}")
    return timedelta(seconds=float(timeout))


def _planner_config(planner: str | PlannerConfig, **given: Any) -> PlannerConfig:
    """The strategy's :class:`PlannerConfig`: ``planner`` itself when it is one (the other
    planner arguments then stay at their defaults), else one built from the arguments.

    ``offload=None`` means off here (the strategy offloads only when asked), and an
    ``ActivationOffloader`` means on; the strategy runs no pipeline stages.
    """
    offloader = hasattr(given["offload"], "micro_batch_context")
    if isinstance(planner, PlannerConfig):
        defaults = inspect.signature(ByteScaleStrategy.__init__).parameters
        clash = sorted(
            k
            for k, v in given.items()
            if v is not defaults[k].default
            and v != defaults[k].default
            and not (k == "offload" and offloader)
        )
        if clash:
            raise ConfigError(
                f"ByteScaleStrategy got planner=PlannerConfig(...) and also {', '.join(clash)}; give the planner "
                f"options one way: inside the PlannerConfig (config.replace({clash[0]}=...)) or as keyword arguments"
            )
        config = planner
        if offloader or planner.offload is None:
            config = planner.replace(offload=offloader)
    else:
        if offloader:  # an ActivationOffloader: the planner only needs "on"
            given["offload"] = True
        elif given["offload"] is None:
            given["offload"] = False
        given["options"] = given["options"] or {}
        config = PlannerConfig.from_options(planner=planner, **given)
    if config.pipeline_degree != 1:
        raise ConfigError(
            f"pipeline_degree={config.pipeline_degree}: ByteScaleStrategy runs no pipeline stages, so it plans with "
            "pipeline_degree=1; pipelines are for bytescale-plan and bytescale-sim"
        )
    return config


_DDP_ONLY = {
    "find_unused_parameters",
    "static_graph",
    "gradient_as_bucket_view",
    "broadcast_buffers",
    "ddp_comm_hook",
    "ddp_comm_state",
    "ddp_comm_wrapper",
    "model_averaging_period",
}


def _planner_view(name: str) -> property:
    """A strategy attribute that reads ``planner_config.<name>`` and, when set, replaces the config."""

    def get(self: ByteScaleStrategy) -> Any:
        return getattr(self.planner_config, name)

    def set_(self: ByteScaleStrategy, value: Any) -> None:
        self.planner_config = self.planner_config.replace(**{name: value})

    return property(get, set_, doc=f"``planner_config.{name}`` (setting it validates a new config).")


class ByteScaleStrategy(ParallelStrategy):
    """Hybrid Data Parallelism (ByteScale) over all ranks of one global process group.

    Args:
        planner: a registered planner name: ``"balance"`` (HDP with the balance scheduler),
            ``"naive"`` (HDP, equal micro-batch counts), ``"static"`` (the fixed DP x CP
            baseline), or one added with ``register_planner``; or a whole
            :class:`~lightning_bytescale.planner.config.PlannerConfig` (then leave the other
            planner arguments at their defaults).  The planner arguments below are
            ``PlannerConfig``'s fields (docs/planner.md); the strategy keeps them in
            ``strategy.planner_config``, which the data module plans with.
        capacity: tokens one rank holds resident in one micro-batch (C).
        cp_size: context-parallel degree of the ``static`` planner (``None``: the planner's default).
        offload: selective activation offload: ``False`` (default, off), ``True``, the planner's
            ``OffloadConfig`` (or its dict), or a ready ``ActivationOffloader``.
        offloader_options: keyword arguments for the ``ActivationOffloader`` the strategy builds.
        slack: balance-scheduler slack (fraction of the ideal per-rank time it may exceed).
        seed: planning seed, identical on every rank (``None``: the data module's own seed).
        cost_model: ``None`` (the planner's default), a ``CostModel``, its dict, or the path of
            a ``bytescale-profile`` JSON file, read once here so every rank plans alike.
        comm_aware: plan on the communication-aware cost model (``False``: the paper's
            compute-only model, the ablation).
        ranks_per_node: ranks per node for ring placement (``None``: the cost model's value).
        num_buckets: the balance scheduler's buckets of about equal work.
        pipeline_degree: must be 1 (the strategy runs no pipeline stages; a ``PlannerConfig`` field).
        options: the planner's own options, e.g. ``{"pp_reading": "round_robin"}`` or a
            registered planner's keyword parameters.
        zero: ZeRO level: ``0`` (default) every rank keeps all optimizer state and gradients;
            ``1`` shards optimizer state over all ranks with ``ZeroRedundancyOptimizer``; ``2``
            also shards gradients: each is reduced to the rank that owns its optimizer state
            instead of all-reduced, and the other ranks drop it (:mod:`~lightning_bytescale.engine.zero`).
            Gradient clipping uses the global norm, so ``gradient_clip_val`` gives the same
            result at every level.
        zero1: the older spelling of ``zero=1`` (``True``); contradicting ``zero`` is an error.
        timeout: process-group timeout (seconds or ``timedelta``): a dead or stuck peer gives
            an error within it instead of a hang.
        check_finite: stop with :class:`~lightning_bytescale.errors.NonFiniteError` (naming the
            ranks, micro-batches and sequences) when a loss or gradient is not finite.  Every
            micro-batch's loss is checked; a rank's accumulated gradients once a step, after its
            last micro-batch (a NaN or inf stays in the sum).  Gradients are not checked while a
            float16 grad scaler is active (it skips such steps itself).
        locate_non_finite: check the accumulated gradients after every micro-batch instead, so
            the error names the one that first made them non-finite (one pass over the
            gradients per micro-batch instead of per step: turn it on to find a NaN's source).
        check_loss_normalization: in the first steps, run one micro-batch per rank a second
            time without gradients with ``num_global_tokens`` doubled, and stop with
            :class:`~lightning_bytescale.errors.LossNormalizationError` if the loss did not
            change (a per-micro-batch mean such as ``F.cross_entropy`` instead of
            ``mb.loss(logits)``); warns if it changed but not by half.
        check_parameters_every_n_steps: every N steps (and on the first step of each run),
            fingerprint every parameter inside the step's all-reduce and stop with
            :class:`~lightning_bytescale.errors.ParameterDivergenceError` naming the ranks and
            the first parameters that differ; ``0`` turns it off.
        gradient_sync: ``"bucketed"`` (default): the gradients live in buckets of
            ``bucket_cap_mb`` and each bucket's all-reduce starts during the last micro-batch's
            backward as soon as its gradients are final, on a process group of its own, with no
            extra copy; the step's scalars travel in one small all-reduce after them
            (:mod:`~lightning_bytescale.engine.grad_sync`).  ``"flat"``: every gradient and the
            scalars in ONE all-reduce of one flat buffer after the loop (a full copy of the
            gradients).
        bucket_cap_mb: bucket size in MB for ``gradient_sync="bucketed"`` (DDP's default, 25).
        watchdog: a rank whose step makes no progress for ``timeout`` seconds (or for
            ``watchdog`` seconds when it is a number: a stuck ``training_step``, a hung data
            worker it waits on) writes where it was (phase, step, micro-batch, ring, its stack),
            ends its own children and exits with code 124 (:mod:`~lightning_bytescale.engine.watchdog`).
            Collectives and ring micro-batches get the process-group timeout plus a margin, so
            that ranks waiting for a stuck peer fail with the peer error.  ``False`` turns it off.
        preemption: SIGTERM (or the signals named, e.g. ``("SIGTERM", "SIGUSR1")``) sets a flag
            that rides in the step's all-reduce; at the next step boundary every rank saves
            ``<default_root_dir>/hpc_ckpt_<n>.ckpt`` and exits with code 143
            (:mod:`~lightning_bytescale.lightning.preemption`).  ``False`` leaves Lightning's handler.
        checkpoint_format: ``"sharded"``: every rank writes its part of a checkpoint folder with
            ``torch.distributed.checkpoint`` (the model once, optimizer state by parameter name
            from the rank that holds it), and loading reshards onto any world size and ZeRO
            level (:mod:`~lightning_bytescale.lightning.checkpoint`); ``"consolidated"``: rank 0
            gathers everything and writes one file; ``"auto"`` (default): sharded exactly when
            optimizer state is sharded (``zero >= 1``).  Both formats load whatever the option.
        log_loss: log the global token-mean loss of the step as ``loss_name`` (progress bar too).
        loss_name: the metric name used by ``log_loss``.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            as for every Lightning strategy (the Trainer fills them in).
        process_group_backend: ``None`` picks NCCL on CUDA and gloo on CPU.
        start_method: ``"popen"`` (default: the script is run again for each rank),
            ``"spawn"`` or ``"fork"``.
    """

    strategy_name = "bytescale"

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
        comm_aware: bool = True,
        ranks_per_node: int | None = None,
        num_buckets: int = 8,
        pipeline_degree: int = 1,
        options: dict[str, Any] | None = None,
        zero: int = 0,
        zero1: bool | None = None,
        timeout: float | int | timedelta | None = default_pg_timeout,
        check_finite: bool = True,
        locate_non_finite: bool = False,
        check_loss_normalization: bool = True,
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
        _refuse_unknown_options(unknown)
        planner_config = _planner_config(
            planner, capacity=capacity, cp_size=cp_size, offload=offload, slack=slack, seed=seed,
            cost_model=cost_model, comm_aware=comm_aware, ranks_per_node=ranks_per_node,
            num_buckets=num_buckets, pipeline_degree=pipeline_degree, options=options,
        )  # fmt: skip
        if not isinstance(check_parameters_every_n_steps, int) or check_parameters_every_n_steps < 0:
            raise ConfigError(
                "check_parameters_every_n_steps must be a non-negative integer (0 turns the check off), "
                f"got {check_parameters_every_n_steps!r}"
            )
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ConfigError(f"start_method must be 'popen', 'spawn' or 'fork', got {start_method!r}")
        if offloader_options is not None and not isinstance(offloader_options, dict):
            raise ConfigError(f"offloader_options must be a dict, got {type(offloader_options).__name__}")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = _as_timedelta(timeout)
        self._start_method = start_method
        self.planner_config: PlannerConfig = planner_config  # what the data module plans with
        self.offload = offload if hasattr(offload, "micro_batch_context") else planner_config.offload
        self.offloader_options = dict(offloader_options or {})
        self.zero = resolve_zero_level(zero, zero1)
        self.zero1 = self.zero >= 1  # optimizer state is sharded (ZeRO-1 and ZeRO-2)
        self._grad_owners: dict[int, int] | None = None  # ZeRO-2: id(parameter) -> owning global rank
        self.check_finite = bool(check_finite)
        self.locate_non_finite = bool(locate_non_finite)
        self.check_loss_normalization = bool(check_loss_normalization)
        self.check_parameters_every_n_steps = check_parameters_every_n_steps
        if gradient_sync not in ("bucketed", "flat"):
            raise ConfigError(f"gradient_sync must be 'bucketed' or 'flat', got {gradient_sync!r}")
        if (
            isinstance(bucket_cap_mb, bool)
            or not isinstance(bucket_cap_mb, (int, float))
            or bucket_cap_mb <= 0
        ):
            raise ConfigError(f"bucket_cap_mb must be a positive number of megabytes, got {bucket_cap_mb!r}")
        self.gradient_sync = gradient_sync
        self.bucket_cap_mb = float(bucket_cap_mb)
        if isinstance(watchdog, bool):
            self.watchdog: bool | float = watchdog
        elif isinstance(watchdog, (int, float)) and watchdog > 0:
            self.watchdog = float(watchdog)
        else:
            raise ConfigError(
                f"watchdog must be True, False or a positive number of seconds, got {watchdog!r}"
            )
        self.preemption = preemption
        from lightning_bytescale.lightning.checkpoint import validate_format

        self.checkpoint_format = validate_format(checkpoint_format)
        self.log_loss = bool(log_loss)
        self.loss_name = loss_name
        self.step_stats: dict[str, Any] = {}
        self._optimizer: Optimizer | None = None
        self._stashed_grads: list[Tensor | None] | None = None
        self._pending: dict[str, Any] | None = None
        self._offloader: Any = None
        self._phase = "set-up"
        self._steps_run = 0
        self._loss_probe_done = False
        self._warned_partial_loss = False
        self._watchdog: StepWatchdog | None = None
        self._preemption: PreemptionHandler | None = None
        self._in_micro_batches = False
        self._grad_group: Any = None
        self._grad_sync: BucketedGradSync | None = None

    # ------------------------------------------------------------------ what DDP would provide
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        """Lightning reads this for strategies it does not know: ``sync_dist`` logging and samplers.

        ``ByteScaleDataModule``'s sampler is already distributed (a ``DistributedSampler``), so
        Lightning leaves its loaders alone, and ``self.log(..., sync_dist=True)`` reduces over
        the ranks in hooks every rank runs once per step.  Inside the micro-batch loops it is
        ``False``: ranks run different numbers of micro-batches, so a collective per
        ``self.log`` call there would pair with another rank's next collective and hang; each
        rank logs its own value there instead (docs/strategy.md).
        """
        return not self._in_micro_batches

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def start_method(self) -> str:
        return self._start_method

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Restore weights after the precision plugin converted the module (a 64-true run whose
        # module was built in float32 would otherwise load its float64 checkpoint through float32).
        return True

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            # Lightning's popen launcher, with ranks that die with rank 0 and named causes of death.
            # Under torchrun or SLURM it starts no process but still checks devices x num_nodes
            # against the environment's world size, as DDP does.  (Imported here: those modules
            # import Lightning, which registers this module.)
            from lightning_bytescale.lightning.launcher import ByteScaleScriptLauncher

            self._launcher = ByteScaleScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            from lightning_bytescale.lightning.launcher import ForkCollectingLauncher

            self._launcher = ForkCollectingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the accelerator sets the CUDA device here, before any NCCL call
        self._setup_distributed()

    def _setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or (
            compat._get_default_process_group_backend_for_device(self.root_device)
        )
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        compat._init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise ConfigError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not supported: with "
                "ByteScaleStrategy one batch is one optimizer step and the planner already splits it into "
                "micro-batches. Set accumulate_grad_batches=1 and raise the data module's tokens per step instead."
            )
        module = trainer.lightning_module
        if trainer.state.fn == TrainerFn.FITTING and not module.automatic_optimization:
            raise ConfigError(
                "ByteScaleStrategy runs the micro-batch loop and the gradient all-reduce itself and needs "
                "automatic optimization; remove `self.automatic_optimization = False` from the LightningModule."
            )
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        compat._materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # What DDP does when it wraps a model: every rank starts from rank 0's state.
        self._phase = "the broadcast of rank 0's parameters and buffers"
        broadcast_module_state(self.model)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            compat._optimizers_to_device(self.optimizers, self.root_device)
        self._steps_run = 0
        needs_group = trainer.state.fn == TrainerFn.FITTING and self.gradient_sync == "bucketed"
        if (
            needs_group
            and self._grad_group is None
            and compat._distributed_is_initialized()
            and self.world_size > 1
        ):
            # the bucket all-reduces' own group (created once, here, on every rank): they may be
            # in flight while other ranks' ring exchanges run point-to-point on the global group
            # (each rank issues its own ring transfers before its buckets: docs/engine.md).  It gets the
            # global group's timeout (a new group's default is the backend's, 30 min on gloo), so a
            # peer stuck before its last bucket fails the others as fast as one stuck elsewhere.
            self._grad_group = dist.new_group(backend=self._process_group_backend, timeout=self._timeout)
        self._setup_lifecycle(trainer)

    def _setup_lifecycle(self, trainer: pl.Trainer) -> None:
        """The step watchdog and the preemption handler (its callback installs it at train start)."""
        from lightning_bytescale.engine.watchdog import StepWatchdog
        from lightning_bytescale.lightning.preemption import PreemptionCallback, PreemptionHandler

        if self._watchdog is None and self.watchdog is not False:
            seconds = self.watchdog if self.watchdog is not True else self._pg_seconds()
            if seconds is not None:
                option = (
                    "ByteScaleStrategy(watchdog=...)"
                    if self.watchdog is not True
                    else "ByteScaleStrategy(timeout=...)"
                )
                self._watchdog = StepWatchdog(float(seconds), self.global_rank, timeout_option=option).start()
        if self.preemption is False or trainer.state.fn != TrainerFn.FITTING:
            return
        callback = next((c for c in trainer.callbacks if isinstance(c, PreemptionCallback)), None)
        if callback is None:
            signals = ("SIGTERM",) if self.preemption is True else tuple(self.preemption)
            callback = PreemptionCallback(PreemptionHandler(signals))
            trainer.callbacks.append(callback)
        self._preemption = callback.handler

    def _pg_seconds(self) -> float | None:
        return None if self._timeout is None else self._timeout.total_seconds()

    def _beat(self, phase: str, *, waits_on_peers: bool = False) -> None:
        """Record where this rank is (for errors) and that it progresses (for the watchdog)."""
        self._phase = phase
        dog = self._watchdog
        if dog is None:
            return
        pg = self._pg_seconds()
        if waits_on_peers and pg is not None:
            # bounded by the process-group timeout: a rank waiting on a stuck peer fails with the
            # peer error first, and the stuck rank's own watchdog names where it is
            dog.beat(phase, max(dog.timeout_s, pg + max(30.0, pg / 2)))
        else:
            dog.beat(phase)

    def _idle(self) -> None:
        if self._watchdog is not None:
            self._watchdog.idle()

    def _bucketed_sync(self, params: list[Tensor]) -> BucketedGradSync | None:
        """The bucketed gradient sync for ``params`` (rebuilt if the trained parameters changed)."""
        if self.gradient_sync != "bucketed":
            return None
        sync = self._grad_sync
        owners = self._grad_owners if self.zero == 2 else None
        if sync is None or [id(p) for p in sync.params] != [id(p) for p in params] or sync.owners != owners:
            if sync is not None:
                sync.close()
            sync = BucketedGradSync(
                params, group=self._grad_group, bucket_bytes=int(self.bucket_cap_mb * 2**20), owners=owners
            )
            self._grad_sync = sync
        return sync

    @override
    def teardown(self) -> None:
        try:
            if self._grad_sync is not None:
                self._grad_sync.close()
                self._grad_sync = None
        finally:
            if self._watchdog is not None:
                self._watchdog.stop()
                self._watchdog = None
            # a step that failed part-way leaves its state (and the works it holds) here; the
            # group stays registered with torch.distributed (as DDP's do) but this strategy no
            # longer holds it: once the user destroys the process groups nothing keeps it alive
            self._pending = None
            self._stashed_grads = None
            self._grad_group = None
        super().teardown()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        # empty_init=True (Trainer.init_module(empty_init=True)) builds on the meta device; set-up
        # materialises the model on this rank's device and broadcasts rank 0's values.
        device = torch.device("meta") if empty_init else self.root_device
        with device, self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self.zero >= 1:
            self._wrap_zero()
        self._grad_owners = owner_ranks(self.optimizers) if self.zero == 2 else None
        if self.zero == 2:
            self._clip_by_global_norm()

    def _clip_by_global_norm(self) -> None:
        """ZeRO-2: each rank holds only its shard of the gradients, so clipping by norm needs the global norm.

        ``LightningModule.clip_gradients`` calls the precision plugin, so its ``clip_grad_by_norm``
        is replaced (on this strategy's plugin instance) by one that combines the shards' norms
        with one all-reduce; clipping by value works on each shard as it is.
        """
        plugin = self.precision_plugin
        if getattr(plugin, "scaler", None) is not None:
            raise ConfigError(
                "ByteScaleStrategy(zero=2) cannot run with a float16 GradScaler (precision='16-mixed'): each rank "
                "would decide on its own gradient shard whether to skip a step. Use precision='bf16-mixed' or "
                "'32-true', or zero=1."
            )

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
            inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
            clip_grad_norm_(
                plugin.main_params(optimizer), clip_val, group=getattr(inner, "process_group", None)
            )

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    def _wrap_zero(self) -> None:
        """Each optimizer as a ``ZeroRedundancyOptimizer`` (ZeRO-1 and ZeRO-2 share this state layout)."""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        wrapped = []
        for opt in self.optimizers:
            if isinstance(opt, ZeroRedundancyOptimizer):
                wrapped.append(opt)
                continue
            groups = [dict(g) for g in opt.param_groups]
            accepted = inspect.signature(type(opt).__init__).parameters
            defaults = {k: v for k, v in opt.defaults.items() if k in accepted}
            zero = ZeroRedundancyOptimizer(groups, optimizer_class=type(opt), **defaults)
            _track_step_calls(zero)
            for cfg in self.lr_scheduler_configs:
                if cfg.scheduler.optimizer is opt:
                    cfg.scheduler.optimizer = zero
            wrapped.append(zero)
        self.optimizers = wrapped

    @override
    def barrier(self, name: str | None = None) -> None:
        if not compat._distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not compat._distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Any:
        if isinstance(tensor, Tensor):
            return compat._sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints
    @property
    def sharded_checkpoints(self) -> bool:
        """Whether a save now writes a sharded folder (``checkpoint_format``, ``"auto"`` resolved)."""
        if self.checkpoint_format == "auto":
            from lightning_bytescale.lightning.checkpoint import is_zero

            return any(is_zero(opt) for opt in self.optimizers)
        return self.checkpoint_format == "sharded"

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Sharded: this rank's own state by parameter name (no gather); else Lightning's (ZeRO: gathered on rank 0)."""
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if not self.sharded_checkpoints:
            return super().optimizer_state(inner)
        from lightning_bytescale.lightning.checkpoint import sharded_optimizer_state

        assert self.lightning_module is not None
        return sharded_optimizer_state(inner, self.lightning_module)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        """Sharded: every rank writes its part of the folder ``filepath``; else rank 0 writes one file."""
        from lightning_bytescale.lightning.checkpoint import is_sharded_checkpoint, save_sharded

        if not self.sharded_checkpoints:
            if self.is_global_zero and is_sharded_checkpoint(filepath):
                import shutil

                shutil.rmtree(filepath)  # a file replaces the folder an earlier sharded save wrote there
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if storage_options is not None:
            raise TypeError(
                "ByteScaleStrategy.save_checkpoint(..., storage_options=...) is not supported for sharded "
                "checkpoints (they do not use the CheckpointIO plugin); set checkpoint_format='consolidated'"
            )
        path = self.broadcast(filepath)  # every rank writes into rank 0's folder
        self._phase = f"saving the sharded checkpoint {path}"
        save_sharded(checkpoint, path, rank=self.global_rank, barrier=self.barrier)

    @override
    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """A sharded folder: each rank reads the model and its own optimizer entries; a file: Lightning's load."""
        from lightning_bytescale.lightning.checkpoint import is_sharded_checkpoint, load_sharded

        if not is_sharded_checkpoint(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        module = self.lightning_module
        assert module is not None
        self._phase = f"loading the sharded checkpoint {checkpoint_path}"
        return load_sharded(
            checkpoint_path,
            module,
            self.optimizers,
            strict=module.strict_loading,
            weights_only=weights_only,
        )

    # ------------------------------------------------------------------ options
    def planner_options(self) -> dict[str, Any]:
        """:attr:`planner_config` as flat ``make_plan`` options (a view; the config is the truth)."""
        return self.planner_config.as_options()

    # The planner options as attributes (``strategy.capacity``): views of ``planner_config``.  Setting
    # one (``trainer.strategy.capacity = 512`` after ``Trainer(strategy="bytescale")``) replaces the
    # config with a validated copy, so the config stays the one truth.
    planner = _planner_view("planner")
    capacity = _planner_view("capacity")
    cp_size = _planner_view("cp_size")
    slack = _planner_view("slack")
    seed = _planner_view("seed")
    cost_model = _planner_view("cost_model")
    comm_aware = _planner_view("comm_aware")
    ranks_per_node = _planner_view("ranks_per_node")

    # ------------------------------------------------------------------ the step
    def _named_params(self) -> list[tuple[str, Tensor]]:
        assert self.lightning_module is not None
        return [(n, p) for n, p in self.lightning_module.named_parameters() if p.requires_grad]

    @contextmanager
    def _micro_batch_loop(self) -> Iterator[None]:
        """Ranks run different numbers of micro-batches here: no per-call collectives (``is_distributed``)."""
        self._in_micro_batches = True
        try:
            yield
        finally:
            self._in_micro_batches = False

    def _set_phase(self, text: str) -> None:
        self._beat(text, waits_on_peers="(ring" in text or "(waits on every rank)" in text)

    def _offload_context(self, mb: PackedMicroBatch) -> contextlib.AbstractContextManager:
        if self.offload in (None, False) or mb.offload_ratio <= 0:
            return contextlib.nullcontext()
        return self._get_offloader().micro_batch_context(mb)

    def _get_offloader(self) -> Any:
        """The activation offloader: ``offload`` itself if it is one, else one built from its options."""
        if self._offloader is not None:
            return self._offloader
        if hasattr(self.offload, "micro_batch_context"):
            self._offloader = self.offload
            return self._offloader
        from lightning_bytescale.offload.offloader import ActivationOffloader

        self._offloader = ActivationOffloader(_find_blocks(self.lightning_module), **self.offloader_options)
        return self._offloader

    def _forward_fn(
        self, rest: tuple[Any, ...], kwargs: dict[str, Any], dtypes: list[torch.dtype]
    ) -> Callable:
        module = self.lightning_module
        assert module is not None

        def forward(_model: Module, mb: PackedMicroBatch) -> Tensor:
            with self.precision_plugin.train_step_context():
                out = module.training_step(mb, *rest, **kwargs)
            loss = out.get("loss") if isinstance(out, dict) else out
            if not isinstance(loss, Tensor) or loss.dim() != 0:
                raise TypeError(
                    "With ByteScaleStrategy, training_step(micro_batch, batch_idx) must return the micro-batch "
                    "loss as a scalar tensor (mb.loss(logits), i.e. token_loss(logits, mb.labels, "
                    f"mb.num_global_tokens)) or a dict with that under 'loss'; got {type(out).__name__}."
                )
            dtypes[:] = [loss.dtype]
            return loss

        return forward

    def _backward_fn(self) -> Callable[[Tensor], None]:
        module = self.lightning_module
        scaler = getattr(self.precision_plugin, "scaler", None)

        def backward(loss: Tensor) -> None:
            self.precision_plugin.backward(
                scaler.scale(loss) if scaler is not None else loss, module, self._optimizer
            )

        return backward

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else None
        if not isinstance(batch, StepBatch):
            raise TypeError(
                f"ByteScaleStrategy expects each training batch to be a StepBatch (one optimizer step), got "
                f"{type(batch).__name__}. Use ByteScaleDataModule, or a loader whose items come from "
                "lightning_bytescale.engine.batch.build_step."
            )
        module = self.lightning_module
        assert module is not None
        t_start = time.perf_counter()
        self._beat(f"the plan digest check of step {batch.step}", waits_on_peers=True)
        # an all-gather over all ranks, waited for before this rank's first ring P2P or gradient bucket
        plan_check = check_step(batch, wait=False)
        named = self._named_params()
        for _, p in named:
            p.grad = None
        scaler = getattr(self.precision_plugin, "scaler", None)
        dtypes = [torch.float32]
        forward = self._forward_fn(args[1:], kwargs, dtypes)
        probing = self.check_loss_normalization and not self._loss_probe_done
        if probing:
            plain_forward = forward

            def forward(model: Module, mb: PackedMicroBatch) -> Tensor:
                if torch.is_grad_enabled():
                    return plain_forward(model, mb)
                with compat.discarded_logging(compat.module_trainer(module)):  # the probe's logs do not count
                    return plain_forward(model, mb)

        grad_sync = self._bucketed_sync([p for _, p in named])
        with self._micro_batch_loop():
            local = run_micro_batches(
                module,
                batch.micro_batches,
                forward=forward,
                backward=self._backward_fn(),
                micro_batch_context=self._offload_context,
                sync_timing=self.root_device.type == "cuda",
                check_finite=self.check_finite and scaler is None,
                params=[p for _, p in named],
                check_loss_scaling=probing,
                on_phase=self._set_phase,
                step=batch.step,
                grad_sync=grad_sync,
                plan_check=plan_check,
                locate_non_finite=self.locate_non_finite,
            )
        # Lightning zeroes gradients between training_step and backward: keep ours aside until then.
        self._stashed_grads = [p.grad for _, p in named]
        for _, p in named:
            p.grad = None
        self._pending = {
            "batch": batch,
            "local": local,
            "t_start": t_start,
            "probing": probing,
            "grad_sync": grad_sync,
            "named": named,  # this step's trained parameters, listed once
        }
        return local.loss.to(self.root_device, dtypes[0])

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """The micro-batches were backwarded in ``training_step``: restore their gradients, run the hooks."""
        module = self.lightning_module
        assert module is not None
        if self._stashed_grads is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        trainer = module.trainer
        compat.call_callback_hooks(trainer, "on_before_backward", closure_loss)
        compat.call_module_hook(trainer, "on_before_backward", closure_loss)
        named = self._pending["named"] if self._pending is not None else self._named_params()
        for (_, p), g in zip(named, self._stashed_grads):
            p.grad = g
        self._stashed_grads = None
        compat.call_callback_hooks(trainer, "on_after_backward")
        compat.call_module_hook(trainer, "on_after_backward")
        return closure_loss.detach()

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Closure (all micro-batches), then the ONE all-reduce, then clipping and the optimizer step."""
        self._optimizer = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer

        def closure_then_sync() -> Any:
            out = closure()
            result = self._sync()
            if isinstance(out, Tensor) and result is not None:
                out.copy_(result.loss_tensor.to(out.dtype))  # what Lightning hands to on_train_batch_end
            return out

        try:
            return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)
        finally:
            self._idle()
            self._optimizer = None
            if self._pending is not None and "stats" in self._pending:
                stats = self._pending["stats"]
                stats["step_time_s"] = time.perf_counter() - self._pending["t_start"]
                self.step_stats = stats
            self._pending = None
            self._stashed_grads = None

    def _check_parameters_now(self, step: int) -> bool:
        n = self.check_parameters_every_n_steps
        return n > 0 and (self._steps_run == 0 or step % n == 0)

    def _sync(self) -> StepResult | None:
        pending = self._pending
        if pending is None:  # not a ByteScale step (e.g. the closure skipped training_step)
            return None
        batch: StepBatch = pending["batch"]
        local: LocalResult = pending["local"]
        extra, num_seqs = _sequence_telemetry(batch)
        self._beat(f"the gradient all-reduce of step {batch.step}", waits_on_peers=True)
        preemption = self._preemption
        result = sync_step(
            pending["named"],
            batch,
            local,
            extra=extra,
            check_finite=self.check_finite,
            check_parameters=self._check_parameters_now(batch.step),
            stop_request=preemption is not None and preemption.requested,
            grad_sync=pending["grad_sync"],
        )
        if self._grad_owners is not None and pending["grad_sync"] is None:  # ZeRO-2 after a flat all-reduce
            drop_unowned_gradients([p for _, p in pending["named"]], self._grad_owners, self.global_rank)
        if preemption is not None:  # the preemption callback acts on it after this step
            preemption.record_agreement(result.stop_requested)
        self._steps_run += 1
        if pending["probing"]:
            self._after_probe(result, batch.step)
        sequences = result.extra.tolist() if result.extra is not None else []
        stats = _step_stats(batch, result)
        stats["lengths"] = [int(round(x)) for x in sequences[:num_seqs]]
        stats["cp_degrees"] = [int(round(x)) for x in sequences[num_seqs:]]
        stats["num_sequences"] = num_seqs
        pending["stats"] = stats
        if self.log_loss:
            self._log_loss(result.loss_tensor.to(self.root_device), batch)
        return result

    def _after_probe(self, result: StepResult, step: int) -> None:
        verdicts = result.loss_scaling
        if verdicts.get(LossScaling.PARTLY, 0) and not self._warned_partial_loss:
            self._warned_partial_loss = True
            rank_zero_warn(
                f"At step {step} the loss of training_step did not halve when mb.num_global_tokens doubled (on "
                f"{verdicts[LossScaling.PARTLY]} rank(s)): part of it is not normalised by the global token count, "
                "so those terms are weighted per micro-batch and training differs from one process on the whole "
                "batch. Divide every loss term by mb.num_global_tokens (mb.loss(logits) for the token loss)."
            )
        conclusive = sum(v for k, v in verdicts.items() if k != LossScaling.UNCHECKED)
        if conclusive or self._steps_run >= LOSS_PROBE_STEPS:
            self._loss_probe_done = True

    def _log_loss(self, loss: Tensor, batch: StepBatch) -> None:
        module = self.lightning_module
        if module is None or compat.module_trainer(module) is None:
            return
        module.log(
            self.loss_name,
            loss.to(torch.float32) if loss.device.type == "mps" else loss,
            on_step=True,
            on_epoch=False,
            prog_bar=True,
            batch_size=max(int(batch.num_global_tokens), 1),
            sync_dist=False,
            rank_zero_only=False,
        )

    # ------------------------------------------------------------------ evaluation
    def _eval_loop(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else None
        base = getattr(super(), hook)
        from lightning_bytescale.packed_attention import attention_context

        if not isinstance(batch, StepBatch):
            return base(*args, **kwargs)
        module = self.lightning_module
        assert module is not None
        check_step(batch)
        outputs = []
        context = (
            self.precision_plugin.val_step_context
            if hook == "validation_step"
            else self.precision_plugin.test_step_context
        )
        try:
            with context(), self._micro_batch_loop():
                for mb in batch.micro_batches:
                    self._set_phase(f"{hook} of {describe_micro_batch(mb, batch.step)}")
                    with attention_context(mb.layout), self._offload_context(mb):
                        outputs.append(getattr(module, hook)(mb, *args[1:], **kwargs))
        finally:
            self._idle()
        losses = [o.get("loss") if isinstance(o, dict) else o for o in outputs]
        if not all(isinstance(t, Tensor) and t.dim() == 0 for t in losses):
            return outputs[-1] if outputs else None
        # token CE sum and loss tokens on this rank; Lightning's token-weighted mean with sync_dist
        # turns them into the exact token mean over all ranks and steps of the epoch
        ce_sum = sum(
            (t.detach().double() * batch.num_global_tokens for t in losses),
            torch.zeros((), dtype=torch.float64),
        )
        tokens = sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in batch.micro_batches)
        if self.log_loss and compat.module_trainer(module) is not None:
            stage = "val" if hook == "validation_step" else "test"
            name = (
                self.loss_name.replace("train", stage, 1)
                if "train" in self.loss_name
                else f"{stage}/{self.loss_name}"
            )
            module.log(
                name,
                ce_sum / max(tokens, 1),
                on_step=False,
                on_epoch=True,
                prog_bar=hook == "validation_step",
                batch_size=tokens,
                sync_dist=True,
            )
        return ce_sum / max(int(batch.num_global_tokens), 1)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_loop("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_loop("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """``predict_step(mb, batch_idx)`` once per micro-batch of this rank; returns their outputs in order.

        Each rank returns its own micro-batches' outputs (a list, possibly empty); ``mb.seq_ids``
        and ``mb.layout`` say which sequences (and, for a ring, which zigzag chunks) they hold.
        """
        batch = args[0] if args else None
        if not isinstance(batch, StepBatch):
            return super().predict_step(*args, **kwargs)
        from lightning_bytescale.packed_attention import attention_context

        module = self.lightning_module
        assert module is not None
        check_step(batch)
        outputs = []
        try:
            with self.precision_plugin.predict_step_context(), self._micro_batch_loop():
                for mb in batch.micro_batches:
                    self._set_phase(f"predict_step of {describe_micro_batch(mb, batch.step)}")
                    with attention_context(mb.layout):
                        outputs.append(module.predict_step(mb, *args[1:], **kwargs))
        finally:
            self._idle()
        return outputs

    # ------------------------------------------------------------------ errors
    @override
    def on_exception(self, exception: BaseException) -> None:
        text = str(exception)
        if isinstance(exception, RuntimeError) and is_peer_failure(exception):
            message = peer_failure_message(rank=self.global_rank, timeout=self._timeout, phase=self._phase)
            hint = f"\n[ByteScale] {message}"
            with contextlib.suppress(Exception):
                exception.args = (
                    f"{exception.args[0] if exception.args else text}{hint}",
                    *exception.args[1:],
                )

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: compat._StrategyRegistry) -> None:
        for name, start_method in (
            ("bytescale", "popen"),
            ("bytescale_spawn", "spawn"),
            ("bytescale_fork", "fork"),
        ):
            strategy_registry.register(
                name,
                cls,
                description=f"ByteScale Hybrid Data Parallelism with start_method '{start_method}'",
                override=True,
                start_method=start_method,
            )


def _refuse_unknown_options(unknown: dict[str, Any]) -> None:
    if not unknown:
        return
    ddp_only = sorted(_DDP_ONLY & unknown.keys())
    if ddp_only:
        raise ConfigError(
            f"{ddp_only} are DistributedDataParallel options; ByteScaleStrategy does not wrap the model in DDP "
            "(it all-reduces gradients itself), so remove them."
        )
    valid = [
        p for p in inspect.signature(ByteScaleStrategy.__init__).parameters if p not in ("self", "unknown")
    ]
    parts = []
    for key in sorted(unknown):
        close = difflib.get_close_matches(key, valid, n=1)
        parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ConfigError(
        f"ByteScaleStrategy got unknown option(s) {', '.join(parts)}; valid options: {', '.join(valid)}"
    )


def _sequence_telemetry(batch: StepBatch) -> tuple[Tensor, int]:
    """Per-sequence length and ring size, written by each sequence's first holder (summed over ranks)."""
    num_seqs = max(
        int(batch.num_tokens) - int(batch.num_global_tokens), 0
    )  # each sequence: s - 1 loss tokens
    extra = torch.zeros(2 * num_seqs, dtype=torch.float64)
    for mb in batch.micro_batches:
        if mb.layout.member != 0:
            continue
        for seq, length in zip(mb.seq_ids, mb.layout.seq_lens):
            if 0 <= seq < num_seqs:
                extra[seq] = float(length)
                extra[num_seqs + seq] = float(mb.layout.ring_size)
    return extra, num_seqs


def _step_stats(batch: StepBatch, result: StepResult) -> dict[str, Any]:
    plan = batch.stats if isinstance(batch.stats, dict) else {}
    reports = result.reports
    busy = [r.busy_s for r in reports]
    mean_busy = sum(busy) / len(busy)
    max_busy = max(busy)
    planned = [float(x) for x in plan.get("planned_s", plan.get("rank_time", []))]
    if planned and max(planned) > 0:
        max_over_mean_planned = max(planned) / (sum(planned) / len(planned))
    else:
        max_over_mean_planned = float(plan.get("max_over_mean", float("nan")))
    return {
        "loss": result.loss,
        "tokens": int(batch.num_tokens),
        "loss_tokens": int(batch.num_global_tokens),
        "step_time_s": 0.0,
        "busy_s": busy,
        "planned_s": planned,
        "num_micro_batches": [r.num_micro_batches for r in reports],
        "max_over_mean_planned": max_over_mean_planned,
        "max_over_mean_measured": max_busy / mean_busy if mean_busy > 0 else float("nan"),
        "bubble_fraction": 1.0 - mean_busy / max_busy if max_busy > 0 else 0.0,
        "ring_bytes": sum(r.ring_bytes for r in reports),
        "ring_bytes_per_rank": [r.ring_bytes for r in reports],
        "ring_wait_s": [r.ring_wait_s for r in reports],
        "exposed_ring_planned_s": float(plan.get("exposed_ring_time", float("nan"))),
        "allreduce_s": result.allreduce_s,
        "plan_ms": float(plan.get("plan_ms", float("nan"))),
        "step": int(batch.step),
    }


def _find_blocks(module: Module | None) -> list[Module] | None:
    """The model's transformer blocks in forward order, for per-layer offload (``None``: fall back)."""
    if module is None:
        return None
    custom = getattr(module, "offload_layers", None)
    if callable(custom):
        return list(custom())
    for sub in module.modules():
        for name in ("blocks", "layers"):
            blocks = getattr(sub, name, None)
            if isinstance(blocks, torch.nn.ModuleList) and len(blocks) > 0:
                return list(blocks)
    return None


def _track_step_calls(optimizer: Optimizer) -> None:
    """Mark ``optimizer.step`` the way LR schedulers expect, so they do not warn about call order."""
    step = optimizer.step

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    wrapped._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapped  # type: ignore[method-assign]


ByteScaleStrategy.register_strategies(StrategyRegistry)
