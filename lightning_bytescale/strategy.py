"""`ByteScaleStrategy`: Hybrid Data Parallelism as a Lightning strategy.

One Lightning batch is one optimizer step: every rank's loader yields one
:class:`~lightning_bytescale.engine.batch.StepBatch` holding *its own* micro-batches (their
number differs between ranks).  The strategy runs them itself, each inside the attention
layout of its micro-batch, backwards each through the precision plugin, and then joins
exactly one gradient all-reduce (sum) before clipping and the optimizer step.  Losses are
token sums divided by the global token count, so the result equals single-process training
on the whole global batch.  The model is never wrapped in ``DistributedDataParallel``: DDP
would require the same number of synchronised backwards on every rank.

``import lightning_bytescale`` registers ``bytescale`` (popen launcher), ``bytescale_spawn``
and ``bytescale_fork``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_bytescale.engine.batch import PackedMicroBatch, StepBatch
from lightning_bytescale.engine.executor import allreduce_gradients
from lightning_bytescale.engine.loss import IGNORE_INDEX
from lightning_bytescale.failures import is_peer_failure
from lightning_bytescale.strategy_sync import (
    SLOT,
    NonFiniteError,
    PlanDivergenceError,
    RankReport,
    check_plan_agreement,
    describe_non_finite,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

PLANNERS = ("balance", "naive", "static")


class ByteScaleConfigError(ValueError):
    """A ByteScaleStrategy option or Trainer setting that HDP cannot run with."""


def _as_timedelta(timeout: float | int | timedelta | None) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if timeout <= 0:
        raise ByteScaleConfigError(f"timeout must be positive seconds, got {timeout}")
    return timedelta(seconds=float(timeout))


class ByteScaleStrategy(DDPStrategy):
    """Hybrid Data Parallelism (ByteScale) over all ranks of one global process group.

    Args:
        planner: ``"balance"`` (HDP with the balance scheduler), ``"naive"`` (HDP, equal
            micro-batch counts) or ``"static"`` (the fixed DP x CP baseline).
        capacity: tokens one rank holds resident in one micro-batch (C).
        cp_size: context-parallel degree of the ``static`` planner (``None``: the planner's default).
        offload: selective activation offload: ``False`` (default, off), ``True``, the planner's
            ``OffloadConfig`` (or its dict), or a ready ``ActivationOffloader``.  The planner gets
            it to choose per-micro-batch offload ratios; micro-batches with a non-zero
            ``offload_ratio`` then run inside the offloader's context.
        offloader_options: keyword arguments for the ``ActivationOffloader`` the strategy builds
            (``keep_last``, ``min_bytes``, ``prefetch``, ...).
        slack: balance-scheduler slack (fraction of the ideal per-rank time it may exceed).
        seed: planning seed, identical on every rank (``None``: the data module's own seed).
        cost_model: cost model for the planner: ``None`` (the planner's default), a
            ``CostModel``, its dict, or the path of a ``bytescale-profile`` JSON file (or of a
            plain cost-model dict), read once here so every rank plans with the same model.
        comm_aware: plan on the communication-aware cost model (ring time that cannot hide behind
            attention counts); ``False`` plans on the paper's compute-only model (the ablation).
        ranks_per_node: ranks per node for ring placement (``None``: the cost model's value).
        zero1: shard optimizer state over all ranks with ``ZeroRedundancyOptimizer``.
        timeout: process-group timeout (seconds or ``timedelta``); a dead or stuck peer gives an
            error within it instead of a hang.
        check_finite: stop with :class:`~lightning_bytescale.strategy_sync.NonFiniteError`
            (naming the micro-batch and sequence ids) when a loss or gradient is not finite.
        log_loss: log the global token-mean loss of the step as ``loss_name`` (progress bar too).
        loss_name: the metric name used by ``log_loss``.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`
            (``start_method``, ``process_group_backend``, ``cluster_environment``, ...).
    """

    strategy_name = "bytescale"

    def __init__(
        self,
        planner: str = "balance",
        capacity: int = 8192,
        cp_size: int | None = None,
        offload: Any = False,
        offloader_options: dict[str, Any] | None = None,
        slack: float = 0.05,
        seed: int | None = None,
        cost_model: Any = None,
        comm_aware: bool = True,
        ranks_per_node: int | None = None,
        zero1: bool = False,
        timeout: float | int | timedelta | None = timedelta(minutes=30),
        check_finite: bool = True,
        log_loss: bool = True,
        loss_name: str = "train/loss",
        **kwargs: Any,
    ) -> None:
        if planner not in PLANNERS:
            raise ByteScaleConfigError(f"planner must be one of {PLANNERS}, got {planner!r}")
        if not isinstance(capacity, int) or capacity < 2:
            raise ByteScaleConfigError(
                f"capacity must be at least 2 tokens (a ring member holds two zigzag chunks), got {capacity!r}"
            )
        if cp_size is not None and (not isinstance(cp_size, int) or cp_size < 1):
            raise ByteScaleConfigError(f"cp_size must be a positive integer or None, got {cp_size!r}")
        if slack < 0:
            raise ByteScaleConfigError(f"slack must be >= 0, got {slack}")
        if not isinstance(comm_aware, bool):
            raise ByteScaleConfigError(f"comm_aware must be True or False, got {comm_aware!r}")
        if ranks_per_node is not None and (
            isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1
        ):
            raise ByteScaleConfigError(
                f"ranks_per_node must be a positive integer or None, got {ranks_per_node!r}"
            )
        cost_model = _resolve_cost_model(cost_model)
        unknown = {"find_unused_parameters", "static_graph", "gradient_as_bucket_view"} & kwargs.keys()
        if unknown:
            raise ByteScaleConfigError(
                f"{sorted(unknown)} are DistributedDataParallel options; ByteScaleStrategy does not wrap "
                "the model in DDP (it all-reduces gradients itself), so remove them."
            )
        super().__init__(timeout=_as_timedelta(timeout), **kwargs)
        self.planner = planner
        self.capacity = capacity
        self.cp_size = cp_size
        if offloader_options is not None and not isinstance(offloader_options, dict):
            raise ByteScaleConfigError(
                f"offloader_options must be a dict, got {type(offloader_options).__name__}"
            )
        self.offload = offload
        self.offloader_options = dict(offloader_options or {})
        self.slack = float(slack)
        self.seed = None if seed is None else int(seed)
        self.cost_model = cost_model
        self.comm_aware = comm_aware
        self.ranks_per_node = ranks_per_node
        self.zero1 = bool(zero1)
        self.check_finite = bool(check_finite)
        self.log_loss = bool(log_loss)
        self.loss_name = loss_name
        self.step_stats: dict[str, Any] = {}
        self._optimizer: Optimizer | None = None
        self._stashed_grads: list[Tensor | None] | None = None
        self._pending: dict[str, Any] | None = None
        self._offloader: Any = None
        self._phase = "set-up"

    # ------------------------------------------------------------------ options
    def planner_options(self) -> dict[str, Any]:
        """The planning options a DataModule needs to build this strategy's plans."""
        offload = self.offload
        if hasattr(offload, "micro_batch_context"):  # an ActivationOffloader: the planner only needs "on"
            offload = True
        return {
            "planner": self.planner,
            "capacity": self.capacity,
            "cp_size": self.cp_size,
            "offload": False if offload is None else offload,
            "slack": self.slack,
            "cost_model": self.cost_model,
            "comm_aware": self.comm_aware,
            "ranks_per_node": self.ranks_per_node,
            "seed": self.seed,
        }

    # ------------------------------------------------------------------ set-up
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise ByteScaleConfigError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not supported: with "
                "ByteScaleStrategy one batch is one optimizer step and the planner already splits it into "
                "micro-batches. Set accumulate_grad_batches=1 and raise the data module's tokens per step instead."
            )
        module = trainer.lightning_module
        if trainer.state.fn == TrainerFn.FITTING and not module.automatic_optimization:
            raise ByteScaleConfigError(
                "ByteScaleStrategy runs the micro-batch loop and the gradient all-reduce itself and needs "
                "automatic optimization; remove `self.automatic_optimization = False` from the LightningModule."
            )
        super().setup(trainer)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Restore weights after the precision plugin converted the module (a 64-true run whose
        # module was built in float32 would otherwise load its float64 checkpoint through float32).
        return True

    @override
    def _setup_model(self, model: Module) -> Module:
        # No DDP wrapper: ranks run different numbers of backwards; gradients are summed once per step.
        return model

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self.zero1:
            self._wrap_zero1()

    def _wrap_zero1(self) -> None:
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

    # ------------------------------------------------------------------ the step
    def _params(self) -> list[Tensor]:
        assert self.lightning_module is not None
        return [p for p in self.lightning_module.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def _micro_batch_context(self, mb: PackedMicroBatch) -> Iterator[None]:
        from lightning_bytescale.attention import attention_context

        with contextlib.ExitStack() as stack:
            stack.enter_context(attention_context(mb.layout))
            if self.offload not in (None, False) and mb.offload_ratio > 0:
                stack.enter_context(self._get_offloader().micro_batch_context(mb))
            yield

    def _get_offloader(self) -> Any:
        """The activation offloader: ``offload`` itself if it is one, else one built from its options."""
        if self._offloader is not None:
            return self._offloader
        if hasattr(self.offload, "micro_batch_context"):
            self._offloader = self.offload
            return self._offloader
        from lightning_bytescale.offload import ActivationOffloader

        self._offloader = ActivationOffloader(_find_blocks(self.lightning_module), **self.offloader_options)
        return self._offloader

    def _check_step_batch(self, batch: StepBatch) -> None:
        stats = batch.stats if isinstance(batch.stats, dict) else {}
        plan_world = stats.get("world_size") or len(stats.get("micro_batch_counts", ())) or None
        check_plan_agreement(batch.digest, batch.step, self.world_size, plan_world)

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
        rest = args[1:]
        t_start = time.perf_counter()
        self._phase = f"the plan digest check of step {batch.step}"
        self._check_step_batch(batch)
        params = self._params()
        for p in params:
            p.grad = None
        ring_before, wait_before = _comm_counters()
        optimizer = self._optimizer
        scaler = getattr(self.precision_plugin, "scaler", None)
        device = self.root_device
        total = torch.zeros((), dtype=torch.float64, device=device)
        loss_tokens = torch.zeros((), dtype=torch.long, device=device)
        finite_flags: list[Tensor] = []
        loss_dtype = torch.float32
        t_busy = time.perf_counter()
        for mb in batch.micro_batches:
            ring = mb.layout.ring
            self._phase = f"micro-batch {mb.index} of step {batch.step}" + (
                f" (ring {list(ring)}, sequences {list(mb.seq_ids)})" if ring is not None else ""
            )
            with self._micro_batch_context(mb):
                with self.precision_plugin.train_step_context():
                    out = module.training_step(mb, *rest, **kwargs)
                loss = out.get("loss") if isinstance(out, dict) else out
                if not isinstance(loss, Tensor) or loss.dim() != 0:
                    raise TypeError(
                        "With ByteScaleStrategy, training_step(micro_batch, batch_idx) must return the micro-batch "
                        "loss as a scalar tensor (token_loss(logits, mb.labels, mb.num_global_tokens)) or a dict "
                        f"with that under 'loss'; got {type(out).__name__}."
                    )
                total = total + loss.detach().double()
                loss_dtype = loss.dtype
                loss_tokens = loss_tokens + (mb.labels != IGNORE_INDEX).sum()
                to_backward = scaler.scale(loss) if scaler is not None else loss
                self.precision_plugin.backward(to_backward, module, optimizer)
            if self.check_finite:
                finite_flags.append(self._finite_flag(loss, params))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        busy = time.perf_counter() - t_busy
        ring_after, wait_after = _comm_counters()
        report = RankReport(
            busy_s=busy,
            ring_bytes=ring_after - ring_before,
            num_micro_batches=len(batch.micro_batches),
            ring_wait_s=wait_after - wait_before,
        )
        if finite_flags:
            codes = torch.stack(finite_flags).tolist()
            for i, code in enumerate(codes):
                if code:
                    mb = batch.micro_batches[i]
                    report.bad_micro_batch, report.bad_kind, report.bad_seq_ids = (
                        i,
                        int(code),
                        tuple(mb.seq_ids),
                    )
                    break
        # Lightning zeroes gradients between training_step and backward: keep ours aside until then.
        self._stashed_grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        self._pending = {
            "batch": batch,
            "report": report,
            "loss": total,
            "loss_tokens": loss_tokens,
            "t_start": t_start,
        }
        return total.to(loss_dtype)

    def _finite_flag(self, loss: Tensor, params: list[Tensor]) -> Tensor:
        """0 if finite, 1 if the loss is not finite, 2 if only the accumulated gradients are not."""
        loss_bad = ~torch.isfinite(loss.detach()).all()
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            norms = torch._foreach_norm(grads, math.inf)
            grad_bad = ~torch.isfinite(torch.stack([n.float() for n in norms])).all()
        else:
            grad_bad = torch.zeros((), dtype=torch.bool, device=loss.device)
        return torch.where(loss_bad, 1, torch.where(grad_bad, 2, 0)).to(torch.long)

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
        from lightning.pytorch.trainer import call

        call._call_callback_hooks(trainer, "on_before_backward", closure_loss)
        call._call_lightning_module_hook(trainer, "on_before_backward", closure_loss)
        for p, g in zip(self._params(), self._stashed_grads):
            p.grad = g
        self._stashed_grads = None
        call._call_callback_hooks(trainer, "on_after_backward")
        call._call_lightning_module_hook(trainer, "on_after_backward")
        return closure_loss.detach()

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Closure (all micro-batches), then ONE all-reduce, then clipping and the optimizer step."""
        self._optimizer = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer

        def closure_then_allreduce() -> Any:
            out = closure()
            global_loss = self._allreduce()
            if isinstance(out, Tensor) and global_loss is not None:
                out.copy_(global_loss.to(out.dtype))  # what Lightning hands to on_train_batch_end
            return out

        try:
            return super().optimizer_step(optimizer, closure_then_allreduce, model, **kwargs)
        finally:
            self._optimizer = None
            if self._pending is not None and "stats" in self._pending:
                stats = self._pending["stats"]
                stats["step_time_s"] = time.perf_counter() - self._pending["t_start"]
                self.step_stats = stats
            self._pending = None
            self._stashed_grads = None

    def _allreduce(self) -> Tensor | None:
        pending = self._pending
        if pending is None:  # not a ByteScale step (e.g. the closure skipped training_step)
            return None
        batch: StepBatch = pending["batch"]
        report: RankReport = pending["report"]
        world, rank = self.world_size, self.global_rank
        params = self._params()
        n = len(params)
        # extra = [has-grad flag per parameter | loss sum | per-rank slots |
        #          per-sequence length and ring size, written by the sequence's first holder]
        num_seqs = max(
            int(batch.num_tokens) - int(batch.num_global_tokens), 0
        )  # each sequence: s - 1 loss tokens
        head = n + 1 + world * SLOT
        extra = torch.zeros(head + 2 * num_seqs, dtype=torch.float64)
        for mb in batch.micro_batches:
            if mb.layout.member != 0:
                continue
            for seq, length in zip(mb.seq_ids, mb.layout.seq_lens):
                if 0 <= seq < num_seqs:
                    extra[head + seq] = float(length)
                    extra[head + num_seqs + seq] = float(mb.layout.ring_size)
        extra[:n] = torch.tensor([p.grad is not None for p in params], dtype=torch.float64)
        extra[n] = float(pending["loss"])
        extra[n + 1 + rank * SLOT : n + 1 + (rank + 1) * SLOT] = torch.tensor(
            report.encode(), dtype=torch.float64
        )
        self._phase = f"the gradient all-reduce of step {batch.step}"
        t0 = time.perf_counter()
        # the loss-token count travels as exact integer limbs (a float32 buffer would round it
        # above 2**24 tokens a step)
        counts = torch.tensor([int(pending["loss_tokens"])], dtype=torch.long)
        reduced = allreduce_gradients(params, extra=extra.to(self.root_device), counts=counts)
        allreduce_s = time.perf_counter() - t0
        assert reduced is not None
        values = reduced.double().tolist()
        for p, count in zip(params, values[:n]):
            if count == 0:  # no rank produced a gradient: leave it None, as a single process would
                p.grad = None
        loss_value, loss_tokens = values[n], values[-1]
        slots = values[n + 1 : head]
        reports = [RankReport.decode(slots[r * SLOT : (r + 1) * SLOT]) for r in range(world)]
        sequences = values[head:-1]
        if any(r.bad_micro_batch is not None for r in reports):
            raise NonFiniteError(describe_non_finite(reports, batch.step))
        expected = int(batch.num_global_tokens)
        if abs(loss_tokens - expected) > 0.5:
            raise PlanDivergenceError(
                f"The ranks' micro-batches hold {loss_tokens:.0f} loss tokens at step {batch.step}, but the global "
                f"batch has {expected}: the ranks ran different plans or dropped tokens. Check that every rank "
                "uses the same data, seed and planner options."
            )
        global_loss = torch.tensor(loss_value, dtype=torch.float64, device=self.root_device)
        pending["stats"] = self._build_stats(batch, reports, loss_value, allreduce_s)
        pending["stats"]["lengths"] = [int(round(x)) for x in sequences[:num_seqs]]
        pending["stats"]["cp_degrees"] = [int(round(x)) for x in sequences[num_seqs:]]
        pending["stats"]["num_sequences"] = num_seqs
        if self.log_loss:
            self._log_loss(global_loss, batch)
        return global_loss

    def _build_stats(
        self, batch: StepBatch, reports: list[RankReport], loss: float, allreduce_s: float
    ) -> dict[str, Any]:
        plan = batch.stats if isinstance(batch.stats, dict) else {}
        busy = [r.busy_s for r in reports]
        mean_busy = sum(busy) / len(busy)
        max_busy = max(busy)
        planned = [float(x) for x in plan.get("planned_s", plan.get("rank_time", []))]
        if planned and max(planned) > 0:
            max_over_mean_planned = max(planned) / (sum(planned) / len(planned))
        else:
            max_over_mean_planned = float(plan.get("max_over_mean", float("nan")))
        return {
            "loss": loss,
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
            "allreduce_s": allreduce_s,
            "plan_ms": float(plan.get("plan_ms", float("nan"))),
            "step": int(batch.step),
        }

    def _log_loss(self, loss: Tensor, batch: StepBatch) -> None:
        module = self.lightning_module
        if module is None or module._trainer is None:
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
        if not isinstance(batch, StepBatch):
            return base(*args, **kwargs)
        module = self.lightning_module
        assert module is not None
        self._check_step_batch(batch)
        outputs = []
        context = (
            self.precision_plugin.val_step_context
            if hook == "validation_step"
            else self.precision_plugin.test_step_context
        )
        with context():
            for mb in batch.micro_batches:
                with self._micro_batch_context(mb):
                    outputs.append(getattr(module, hook)(mb, *args[1:], **kwargs))
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
        if self.log_loss and module._trainer is not None:
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

    # ------------------------------------------------------------------ errors
    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        text = str(exception)
        if isinstance(exception, RuntimeError) and is_peer_failure(exception):
            timeout = self._timeout.total_seconds() if self._timeout is not None else None
            hint = (
                f"\n[ByteScale] rank {self.global_rank}: communication failed during {self._phase} "
                f"(process-group timeout {timeout} s). Another rank has most likely died or is stuck; check the other ranks' "
                "logs for the first error. Set ByteScaleStrategy(timeout=...) to bound how long ranks wait."
            )
            with contextlib.suppress(Exception):
                exception.args = (
                    f"{exception.args[0] if exception.args else text}{hint}",
                    *exception.args[1:],
                )

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
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


def _resolve_cost_model(cost_model: Any) -> Any:
    """``cost_model`` as the planner takes it: a path is read here (a profiler file or a plain dict)."""
    if cost_model is None or isinstance(cost_model, dict):
        return cost_model
    if isinstance(cost_model, (str, os.PathLike)):
        from lightning_bytescale.profiler import load_cost_model

        path = Path(cost_model)
        if not path.is_file():
            raise ByteScaleConfigError(
                f"cost_model file {str(path)!r} does not exist; write one with `bytescale-profile -o {path}` "
                "or pass cost_model=None for the planner's default"
            )
        try:
            return load_cost_model(path)
        except (ValueError, KeyError, TypeError) as err:
            raise ByteScaleConfigError(
                f"cost_model file {str(path)!r} is not a cost-model file ({err}); pass the JSON written by "
                "bytescale-profile or CostModel.to_json_dict()"
            ) from err
    from lightning_bytescale.planner.cost_model import CostModel

    if isinstance(cost_model, CostModel):
        return cost_model
    raise ByteScaleConfigError(
        f"cost_model must be None, a CostModel, its dict or a file path, got {type(cost_model).__name__}"
    )


def _comm_counters() -> tuple[float, float]:
    """``(bytes sent, seconds blocked waiting)`` of this rank's ring exchanges so far (0 without counters)."""
    try:
        from lightning_bytescale.attention import comm_stats
    except ImportError:
        return 0.0, 0.0
    stats = comm_stats()
    if not isinstance(stats, dict):
        stats = vars(stats) if hasattr(stats, "__dict__") else {}
    sent = next((float(stats[k]) for k in ("bytes_sent", "ring_bytes", "bytes") if k in stats), 0.0)
    return sent, float(stats.get("wait_s", 0.0))


def _track_step_calls(optimizer: Optimizer) -> None:
    """Mark ``optimizer.step`` the way LR schedulers expect, so they do not warn about call order."""
    step = optimizer.step

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    wrapped._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapped  # type: ignore[method-assign]


ByteScaleStrategy.register_strategies(StrategyRegistry)
