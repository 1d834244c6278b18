"""`ProcessGroupStrategy`: what DDP's strategy does for a run, without wrapping the model in DDP.

``ByteScaleStrategy`` cannot wrap its model in ``DistributedDataParallel`` (DDP needs the same
number of synchronised backwards on every rank; HDP ranks run different numbers of
micro-batches), so, like Lightning's ``ModelParallelStrategy``, it is a ``ParallelStrategy`` that
does itself what DDP's would: the rank's device and ranks, the default process group (NCCL on
CUDA, gloo on CPU, with a timeout), the launchers (popen, spawn, fork), building on the rank's
device or on meta, and the collectives Lightning calls (``barrier``, ``broadcast``,
``all_gather``, ``reduce``).  That plumbing is this base class, so ``lightning/strategy.py`` holds
only what ByteScale adds: the layout, the step and the checkpoints.  A subclass refuses a
collective where it would hang by overriding :meth:`ProcessGroupStrategy.refuse_collective`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_bytescale.engine.comm_device import barrier as comm_barrier

# imported as modules: the first import of Lightning imports the strategy, and so this module,
# maybe while one of them is still being imported
from lightning_bytescale.lightning import compat as compat
from lightning_bytescale.lightning import epoch_metrics as epoch_metrics
from lightning_bytescale.lightning import process_groups as process_groups
from lightning_bytescale.lightning import strategy_options as options_


class ProcessGroupStrategy(ParallelStrategy):
    """A ``ParallelStrategy`` over one default process group whose model is not wrapped.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            as for every Lightning strategy (the Trainer fills them in).
        process_group_backend: ``None`` picks NCCL on CUDA and gloo on CPU.
        timeout: process-group timeout (seconds or ``timedelta``): a dead or stuck peer gives
            an error within it instead of a hang.
        start_method: ``"popen"`` (default: the script is run again for each rank),
            ``"spawn"`` or ``"fork"``.
    """

    def __init__(
        self,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        timeout: float | int | timedelta | None = default_pg_timeout,
        process_group_backend: str | None = None,
        start_method: Literal["popen", "spawn", "fork"] = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = options_.as_timedelta(timeout)
        self._start_method = start_method

    # ------------------------------------------------------------------ devices and ranks
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        """Lightning reads this for strategies it does not know: ``sync_dist`` logging and samplers.

        A data module whose sampler is already distributed (``ByteScaleDataModule``'s) is left
        alone, and ``self.log(..., sync_dist=True)`` reduces over the ranks through
        :meth:`reduce` (which a subclass may refuse where it would hang).
        """
        return True

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
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def start_method(self) -> str:
        return self._start_method

    @property
    def timeout_seconds(self) -> float | None:
        """The process-group timeout in seconds (``None``: the backend's default)."""
        return None if self._timeout is None else self._timeout.total_seconds()

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ launch and process group
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            # Lightning's popen launcher, with ranks that die with rank 0 and named causes of death.
            # Under torchrun or SLURM it starts no process but still checks devices x num_nodes
            # against the environment's world size, as DDP does.  (Imported here: those modules
            # import Lightning, which registers the strategy.)
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
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        self._process_group_backend = process_groups.init_default_group(
            self.cluster_environment, backend=self._process_group_backend, device=self.root_device,
            timeout=self._timeout,
        )  # fmt: skip

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

    # ------------------------------------------------------------------ collectives
    def refuse_collective(self, what: str) -> None:
        """Raise where the collective ``what`` would hang (never, here; a subclass refuses where it must)."""

    @override
    def barrier(self, name: str | None = None) -> None:
        self.refuse_collective("trainer.strategy.barrier()")
        if compat._distributed_is_initialized():
            comm_barrier()  # with the group's device named (NCCL's would guess it)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        self.refuse_collective("trainer.strategy.broadcast()")
        if not compat._distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        self.refuse_collective("self.all_gather() (trainer.strategy.all_gather)")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Any:
        """One all-reduce; a mean is exact (float64 for integer tensors: :func:`~lightning_bytescale.lightning.epoch_metrics.exact_reduce`)."""
        self.refuse_collective("trainer.strategy.reduce() (which self.log(..., sync_dist=True) calls)")
        return epoch_metrics.exact_reduce(tensor, group, reduce_op) if isinstance(tensor, Tensor) else tensor

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: compat._StrategyRegistry) -> None:
        """``strategy_name`` (popen launcher), ``<name>_spawn`` and ``<name>_fork``."""
        name = getattr(cls, "strategy_name", None)
        if name is None:  # the base itself is not a strategy to name
            return
        for suffix, start_method in (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork")):
            strategy_registry.register(
                name + suffix,
                cls,
                description=f"{cls.description} with start_method '{start_method}'",
                override=True,
                start_method=start_method,
            )

    description = "a strategy over one process group"
    """What ``register_strategies`` describes each registered name as."""


__all__ = ["ProcessGroupStrategy"]
