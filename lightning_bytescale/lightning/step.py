"""The step loop of ``ByteScaleStrategy``: one optimizer step as one typed object, and every micro-batch loop.

One Lightning batch is one optimizer step.  :meth:`StepLoop.train` runs this rank's
micro-batches through the engine's loop (:func:`~lightning_bytescale.engine.executor.run_micro_batches`,
the LightningModule's ``training_step`` as the forward, the precision plugin's backward) and
returns a :class:`TrainStep`; :meth:`StepLoop.sync` -- called from the strategy's
``backward``, which every rank runs once per step -- joins the step's gradient sync
(:func:`~lightning_bytescale.engine.executor.sync_step`), so the gradients are final (summed
over the ranks; under ZeRO-2 only the rank's own shard) before ``on_after_backward``.
Validation, test and prediction run the same loop without a backward (:meth:`StepLoop.evaluate`,
:meth:`StepLoop.predict`).

Inside every micro-batch loop ranks run different numbers of micro-batches, so a collective
there would pair with another rank's next collective: :meth:`StepLoop.refuse_collective` (the
strategy's ``all_gather``, ``reduce``, ``barrier`` and ``broadcast`` call it) fails at once,
naming the hook and the one that is safe.  The loss and the statistics a step hands to the
hooks are the step's global ones, the same on every rank; the statistics come from the plan
every rank holds and from the step's one all-reduce (:func:`~lightning_bytescale.lightning.step_stats.step_stats`).
"""

from __future__ import annotations

import contextlib
import re
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module

from lightning_bytescale.engine.attention_check import AttentionCheckWindow
from lightning_bytescale.engine.batch import PackedMicroBatch, StepBatch
from lightning_bytescale.engine.executor import (
    LocalResult,
    StepResult,
    check_step,
    run_micro_batches,
    sync_step,
)
from lightning_bytescale.engine.grad_sync import BucketedGradSync
from lightning_bytescale.engine.loss_check import LossScaling
from lightning_bytescale.engine.zero import drop_unowned_gradients
from lightning_bytescale.errors import CollectiveInMicroBatchError, GradientAccumulationError
from lightning_bytescale.lightning import compat as compat
from lightning_bytescale.lightning import epoch_metrics as epoch_metrics
from lightning_bytescale.lightning import mesh as mesh_
from lightning_bytescale.lightning.step_stats import step_stats
from lightning_bytescale.offload.blocks import find_blocks
from lightning_bytescale.offload.offloader import ActivationOffloader
from lightning_bytescale.parallel import LocalShards, agree_across_lanes, start_step_check

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_bytescale.lightning.strategy import ByteScaleStrategy

LOSS_PROBE_STEPS = 3  # steps in which each rank probes the loss normalisation until one probe is conclusive

#: The hook that every rank runs exactly once per step, for each micro-batch hook.
SAFE_HOOK = {
    "training_step": "on_train_batch_end",
    "validation_step": "on_validation_batch_end",
    "test_step": "on_test_batch_end",
    "predict_step": "on_predict_batch_end",
}


@dataclass
class TrainStep:
    """One optimizer step on this rank, from its micro-batch loop to the optimizer step.

    ``grads`` keeps the loop's gradients over Lightning's ``zero_grad`` (between
    ``training_step`` and ``backward``); ``extras`` holds the other keys of a dict that
    ``training_step`` returned, one list entry per micro-batch of this rank; ``result`` is set
    by the sync, ``stats`` (``strategy.step_stats``) with it.
    """

    batch: StepBatch
    named: list[tuple[str, Tensor]]
    local: LocalResult
    grad_sync: BucketedGradSync | None
    probing: bool
    started: float
    loss_dtype: torch.dtype
    grads: list[Tensor | None] = field(default_factory=list)
    extras: dict[str, list[Any]] = field(default_factory=dict)
    result: StepResult | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    def put_aside(self) -> None:
        """Take the gradients off the parameters (Lightning zeroes them before ``backward``)."""
        self.grads = [p.grad for _, p in self.named]
        for _, p in self.named:
            p.grad = None

    def put_back(self) -> None:
        for (_, p), g in zip(self.named, self.grads):
            p.grad = g

    @property
    def loss(self) -> Tensor:
        """The step's global token-mean loss after the sync, else this rank's share."""
        value = self.result.loss_tensor if self.result is not None else self.local.loss
        return value.detach().to(self.loss_dtype)


def _loss_of(out: Any) -> Tensor | None:
    loss = out.get("loss") if isinstance(out, Mapping) else out
    return loss if isinstance(loss, Tensor) and loss.dim() == 0 else None


@dataclass
class EvalLoss:
    """One evaluation epoch's token losses on this rank: summed cross-entropy and loss tokens."""

    ce_sum: float = 0.0
    tokens: int = 0
    other_outputs: bool = False  # some micro-batch returned something else than a scalar loss


class StepLoop:
    """What ``ByteScaleStrategy`` runs in each step and evaluation step (one per strategy)."""

    def __init__(self, strategy: ByteScaleStrategy) -> None:
        self.strategy = strategy
        self.in_loop: str | None = None  # the micro-batch hook running now
        self.steps_run = 0
        self.loss_probe_done = False
        self.attention_window = AttentionCheckWindow()  # the first steps' attention check
        self.warned_partial_loss = False
        self.offloader: Any = None
        self.grad_sync: BucketedGradSync | None = None
        self.eval_loss: dict[tuple[str, int], EvalLoss] = {}

    # ------------------------------------------------------------------ guards
    @contextmanager
    def micro_batches(self, hook: str) -> Iterator[None]:
        """The micro-batch loop of ``hook``: collectives are refused here."""
        self.in_loop = hook
        try:
            yield
        finally:
            self.in_loop = None

    def refuse_collective(self, what: str) -> None:
        """Raise :class:`CollectiveInMicroBatchError` inside a micro-batch loop (a collective would hang there)."""
        hook = self.in_loop
        if hook is None:
            return
        safe = SAFE_HOOK.get(hook, "on_train_batch_end")
        raise CollectiveInMicroBatchError(
            f"{what} was called inside {hook}, which ByteScaleStrategy runs once per micro-batch: ranks run "
            f"different numbers of micro-batches, so this collective would pair with another rank's next "
            f"collective and hang. Keep the values of the micro-batches and call it in {safe}, which every rank "
            f"runs exactly once per step (a rank without micro-batches too). For self.log, log in {safe}, or "
            "log with on_step=False, on_epoch=True: the epoch's value is reduced over the ranks once, at the end."
        )

    @staticmethod
    def refuse_accumulation(trainer: pl.Trainer) -> None:
        """Gradient accumulation over Lightning batches: refused by name, before any batch runs."""
        from lightning.pytorch.callbacks import GradientAccumulationScheduler

        scheduler = next((c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)), None)
        if scheduler is not None:
            raise GradientAccumulationError(
                "GradientAccumulationScheduler is not supported by ByteScaleStrategy: it raises "
                "accumulate_grad_batches during training, and one Lightning batch is already one optimizer step "
                "(the planner splits it into micro-batches), so batches would be thrown away. Remove the callback "
                "and raise the data module's tokens_per_step instead (for a schedule, per epoch)."
            )
        if trainer.accumulate_grad_batches != 1:
            raise GradientAccumulationError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not supported: with "
                "ByteScaleStrategy one batch is one optimizer step and the planner already splits it into "
                "micro-batches. Set accumulate_grad_batches=1 and raise the data module's tokens_per_step instead."
            )

    # ------------------------------------------------------------------ watchdog and phases
    def beat(self, phase: str, *, waits_on_peers: bool = False) -> None:
        """Record where this rank is (for errors) and that it progresses (for the watchdog)."""
        strategy = self.strategy
        strategy._phase = phase
        dog = strategy._watchdog
        if dog is None:
            return
        pg = strategy._pg_seconds()
        if waits_on_peers and pg is not None:
            # bounded by the process-group timeout: a rank waiting on a stuck peer fails with the
            # peer error first, and the stuck rank's own watchdog names where it is
            dog.beat(phase, max(dog.timeout_s, pg + max(30.0, pg / 2)))
        else:
            dog.beat(phase)

    def idle(self) -> None:
        if self.strategy._watchdog is not None:
            self.strategy._watchdog.idle()

    def _phase(self, text: str) -> None:
        self.beat(text, waits_on_peers="(ring" in text or "(waits on every rank)" in text)

    # ------------------------------------------------------------------ pieces of the loop
    def _plan_check(self, batch: StepBatch) -> Any:
        """Start the plan-digest all-gather over every rank (on the mesh: a plan for the HDP ranks)."""
        pmesh = self.strategy.parallel_mesh
        return check_step(batch, wait=False) if pmesh is None else start_step_check(batch, pmesh)

    def offload_context(self, mb: PackedMicroBatch) -> contextlib.AbstractContextManager:
        offload = self.strategy.offload
        if offload in (None, False) or mb.offload_ratio <= 0:
            return contextlib.nullcontext()
        return self._offloader().micro_batch_context(mb)

    def _offloader(self) -> Any:
        """The activation offloader: ``offload`` itself if it is one, else one built from its options."""
        if self.offloader is None:
            strategy = self.strategy
            if hasattr(strategy.offload, "micro_batch_context"):
                self.offloader = strategy.offload
            else:
                self.offloader = ActivationOffloader(
                    find_blocks(strategy.lightning_module), **strategy.offloader_options
                )
        return self.offloader

    def _bucketed_sync(self, params: list[Tensor]) -> BucketedGradSync | None:
        """The bucketed gradient sync for ``params`` (rebuilt if the trained parameters changed).

        Its group: the strategy's gradient group without a mesh; on the mesh the lane's (and
        stage's) data-parallel group, where the same shard of every HDP rank is summed.
        """
        strategy = self.strategy
        if strategy.gradient_sync != "bucketed" or not params:  # none: FSDP2 reduces every gradient itself
            return None
        sync = self.grad_sync
        owners = strategy._grad_owners if strategy.zero == 2 else None
        pmesh = strategy.parallel_mesh
        group = strategy._grad_group if pmesh is None else pmesh.dp_group
        if (
            sync is None
            or [id(p) for p in sync.params] != [id(p) for p in params]
            or sync.owners != owners
            or sync.group is not group
        ):
            if sync is not None:
                sync.close()
            sync = BucketedGradSync(
                params,
                group=group,
                bucket_bytes=int(strategy.bucket_cap_mb * 2**20),
                owners=owners,
            )
            self.grad_sync = sync
        return sync

    def close(self) -> None:
        if self.grad_sync is not None:
            self.grad_sync.close()
            self.grad_sync = None

    # ------------------------------------------------------------------ training
    def train(self, batch: StepBatch, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> TrainStep:
        """This rank's micro-batches of one step, each forward and backward; gradients put aside."""
        strategy = self.strategy
        module = strategy.lightning_module
        assert module is not None
        started = time.perf_counter()
        self.beat(f"the plan digest check of step {batch.step}", waits_on_peers=True)
        # an all-gather over all ranks, waited for before this rank's first ring P2P or gradient bucket
        plan_check = self._plan_check(batch)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        for _, p in named:
            p.grad = None
        params = [p for _, p in named]
        scaler = getattr(strategy.precision_plugin, "scaler", None)
        probing = strategy.check_loss_normalization and not self.loss_probe_done
        extras: dict[str, list[Any]] = {}
        dtypes = [torch.float32]

        def forward(_model: Module, mb: PackedMicroBatch) -> Tensor:
            if not torch.is_grad_enabled():  # the loss-normalisation probe: its logs do not count
                with compat.discarded_logging(compat.module_trainer(module)):
                    return self._training_forward(module, mb, rest, kwargs, None, dtypes)
            return self._training_forward(module, mb, rest, kwargs, extras, dtypes)

        fsdp = strategy.fsdp
        # on the mesh: the buckets sum local shards over the lane's HDP ranks; FSDP2 reduces its own
        grad_sync = self._bucketed_sync(params if fsdp is None else [p for _, p in fsdp.unmanaged(named)])
        if fsdp is not None:
            fsdp.begin_step()  # FSDP2: one all-gather per unit, before any ring exchange
        with self.micro_batches("training_step"):
            local = run_micro_batches(
                module,
                batch.micro_batches,
                forward=forward,
                backward=self._backward_fn(module, scaler),
                micro_batch_context=self.offload_context,
                sync_timing=strategy.root_device.type == "cuda",
                check_finite=strategy.check_finite and scaler is None,
                params=params,
                check_loss_scaling=probing,
                on_phase=self._phase,
                step=batch.step,
                grad_sync=grad_sync,
                plan_check=plan_check,
                locate_non_finite=strategy.locate_non_finite,
                check_attention=strategy.check_attention and self.attention_window.active,
            )
        if grad_sync is not None and strategy.parallel_mesh is not None:
            grad_sync.launch()  # every rank's buckets before FSDP's reduce-scatters (all of them without micro-batches)
        if fsdp is not None:
            fsdp.finish_step()  # FSDP2: one reduce-scatter per unit, after the last ring exchange
        step = TrainStep(batch, named, local, grad_sync, probing, started, dtypes[0], extras=extras)
        step.put_aside()
        return step

    def _training_forward(
        self,
        module: pl.LightningModule,
        mb: PackedMicroBatch,
        rest: tuple[Any, ...],
        kwargs: dict[str, Any],
        extras: dict[str, list[Any]] | None,
        dtypes: list[torch.dtype],
    ) -> Tensor:
        with self.strategy.precision_plugin.train_step_context():
            out = module.training_step(mb, *rest, **kwargs)
        loss = _loss_of(out)
        if loss is None:
            raise TypeError(
                "With ByteScaleStrategy, training_step(micro_batch, batch_idx) must return the micro-batch "
                "loss as a scalar tensor (mb.loss(logits), i.e. token_loss(logits, mb.labels, "
                f"mb.num_global_tokens)) or a dict with that under 'loss'; got {type(out).__name__}."
            )
        if extras is not None and isinstance(out, Mapping):
            for key, value in out.items():
                if key != "loss":
                    extras.setdefault(key, []).append(apply_to_collection(value, Tensor, Tensor.detach))
        dtypes[:] = [loss.dtype]
        return loss

    def _backward_fn(self, module: pl.LightningModule, scaler: Any) -> Callable[[Tensor], None]:
        strategy = self.strategy

        def backward(loss: Tensor) -> None:
            strategy.precision_plugin.backward(
                scaler.scale(loss) if scaler is not None else loss, module, strategy._optimizer
            )

        return backward

    def sync(self, step: TrainStep) -> StepResult:
        """The step's gradient sync (every rank, once per step): afterwards the gradients are final."""
        strategy = self.strategy
        batch = step.batch
        step.put_back()
        self.beat(f"the gradient all-reduce of step {batch.step}", waits_on_peers=True)
        preemption = strategy._preemption
        n = strategy.check_parameters_every_n_steps
        pmesh = strategy.parallel_mesh
        fsdp = strategy.fsdp
        named = step.named if fsdp is None else fsdp.unmanaged(step.named)  # FSDP2 reduced its own already
        # the flat sync on the mesh: DTensors as their local shards (the buckets hold local shards themselves)
        shards = None if pmesh is None or step.grad_sync is not None else LocalShards(named)

        owners = strategy._grad_owners
        if shards is not None and owners is not None:  # ZeRO-2 on the mesh: each gradient to its owner
            owners = shards.rekey(owners)

        # the cost refinement: every rank's micro-batch times travel in the step's all-reduce
        refinement = getattr(strategy, "cost_refinement", None) if pmesh is None else None

        def sync() -> StepResult:
            result = sync_step(
                named if shards is None else shards.named,
                batch,
                step.local,
                group=None if pmesh is None else pmesh.dp_group,  # the mesh: this lane's HDP ranks
                check_finite=strategy.check_finite,
                check_parameters=n > 0 and (self.steps_run == 0 or batch.step % n == 0),
                stop_request=preemption is not None and preemption.requested,
                grad_sync=step.grad_sync,
                owners=owners if shards is not None else None,
                extra=None if refinement is None else refinement.extra(batch, step.local),
            )
            if shards is not None:
                shards.write_back()
            return result

        result = sync() if pmesh is None else agree_across_lanes(sync, pmesh, batch.step)
        if owners is not None and shards is None and step.grad_sync is None:  # ZeRO-2 after a flat all-reduce
            drop_unowned_gradients([p for _, p in step.named], strategy._grad_owners, strategy.global_rank)
        if preemption is not None:  # the preemption callback acts on it after this step
            preemption.record_agreement(result.stop_requested)
        self.steps_run += 1
        if step.probing:
            self._after_probe(result, batch.step)
        if strategy.check_attention and self.attention_window.active:
            self.attention_window.record(result.attention)
        step.result = result
        step.stats = step_stats(batch, result)
        if refinement is not None:
            step.stats.update(refinement.observe(batch, result))
        if strategy.log_loss:
            self._log(strategy.loss_name, result.loss_tensor, on_step=True, prog_bar=True)
        return result

    def _after_probe(self, result: StepResult, step: int) -> None:
        verdicts = result.loss_scaling
        if verdicts.get(LossScaling.PARTLY, 0) and not self.warned_partial_loss:
            self.warned_partial_loss = True
            rank_zero_warn(
                f"At step {step} the loss of training_step did not halve when mb.num_global_tokens doubled (on "
                f"{verdicts[LossScaling.PARTLY]} rank(s)): part of it is not normalised by the global token count, "
                "so those terms are weighted per micro-batch and training differs from one process on the whole "
                "batch. Divide every loss term by mb.num_global_tokens (mb.loss(logits) for the token loss)."
            )
        conclusive = sum(v for k, v in verdicts.items() if k != LossScaling.UNCHECKED)
        if conclusive or self.steps_run >= LOSS_PROBE_STEPS:
            self.loss_probe_done = True

    def _log(self, name: str, value: Tensor, *, on_step: bool, prog_bar: bool) -> None:
        """Log a global value (the same on every rank: no reduction) from the strategy."""
        module = self.strategy.lightning_module
        if module is None or compat.module_trainer(module) is None:
            return
        if not on_step:  # Lightning advises sync_dist for epoch values: this one needs none
            warnings.filterwarnings(
                "ignore", message=re.escape(f"It is recommended to use `self.log({name!r}")
            )
        value = value.to(self.strategy.root_device)
        module.log(
            name,
            value.to(torch.float32) if value.device.type == "mps" else value,
            on_step=on_step,
            on_epoch=not on_step,
            prog_bar=prog_bar,
            batch_size=1,
            sync_dist=False,
        )

    # ------------------------------------------------------------------ evaluation and prediction
    def _forward_only(
        self, hook: str, batch: StepBatch, call: Callable[[PackedMicroBatch], Any], context: Any
    ) -> tuple[LocalResult, list[Any]]:
        """``call(mb)`` for each micro-batch of this rank in the engine's micro-batch loop, without a backward."""
        module = self.strategy.lightning_module
        assert module is not None
        outputs: list[Any] = []

        def forward(_model: Module, mb: PackedMicroBatch) -> Tensor:
            out = call(mb)
            outputs.append(out)
            loss = _loss_of(out)
            return (
                loss.detach().to(torch.float64) if loss is not None else torch.zeros((), dtype=torch.float64)
            )

        plan_check = self._plan_check(batch)
        try:
            with context(), mesh_.gathered(self.strategy.fsdp), self.micro_batches(hook):
                local = run_micro_batches(
                    module,
                    batch.micro_batches,
                    forward=forward,
                    micro_batch_context=self.offload_context,
                    on_phase=lambda text: self._phase(f"{hook} of {text}"),
                    step=batch.step,
                    plan_check=plan_check,
                    forward_only=True,
                )
        finally:
            self.idle()
        return local, outputs

    def evaluate(
        self, hook: str, batch: StepBatch, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[Any]:
        """``validation_step`` / ``test_step`` once per micro-batch of this rank; returns their outputs in order.

        The token losses add up over the epoch on each rank; at the epoch's last step of each
        dataloader every rank reduces them (and agrees on the user's epoch-reduced metrics,
        :func:`~lightning_bytescale.lightning.epoch_metrics.agree_on_epoch_metrics`) with one
        collective, and the strategy logs ``val/loss`` (``test/loss``), the exact token mean.
        """
        strategy = self.strategy
        module = strategy.lightning_module
        assert module is not None
        batch_idx = int(args[0]) if args else 0
        loader = int(args[1]) if len(args) > 1 else int(kwargs.get("dataloader_idx", 0) or 0)
        plugin = strategy.precision_plugin
        context = plugin.val_step_context if hook == "validation_step" else plugin.test_step_context
        local, outputs = self._forward_only(
            hook, batch, lambda mb: getattr(module, hook)(mb, *args, **kwargs), context
        )
        if batch_idx == 0:
            self.eval_loss[(hook, loader)] = EvalLoss()
        totals = self.eval_loss.setdefault((hook, loader), EvalLoss())
        totals.other_outputs |= any(_loss_of(out) is None for out in outputs)
        pmesh = strategy.parallel_mesh
        if (
            pmesh is None or pmesh.lane == 0
        ):  # the TP lanes of an HDP rank hold the same tokens: count them once
            totals.ce_sum += float(local.loss) * int(batch.num_global_tokens)
            totals.tokens += int(local.loss_tokens)
        if self._last_eval_batch(batch_idx, loader):
            self._end_eval_epoch(hook, totals)
        return outputs

    def _last_eval_batch(self, batch_idx: int, loader: int) -> bool:
        trainer = compat.module_trainer(self.strategy.lightning_module)
        if trainer is None:
            return False
        loop = compat.evaluation_loop(trainer)
        limits = loop.max_batches
        limit = limits[loader] if loader < len(limits) else float("inf")
        return batch_idx + 1 >= limit or bool(loop.batch_progress.is_last_batch)

    def _end_eval_epoch(self, hook: str, totals: EvalLoss) -> None:
        """Every rank, at the last step of a dataloader: one collective, then ``val/loss`` (``test/loss``)."""
        module = self.strategy.lightning_module
        trainer = compat.module_trainer(module)
        assert module is not None and trainer is not None
        self.beat(f"the end of the {hook} epoch (waits on every rank)", waits_on_peers=True)
        mine = (totals.ce_sum, totals.tokens, totals.other_outputs)
        everyone = epoch_metrics.agree_on_epoch_metrics(trainer, module, self.strategy.reduce, extra=mine)
        self.idle()
        if not self.strategy.log_loss or any(other for _, _, other in everyone):
            return
        tokens = sum(t for _, t, _ in everyone)
        if tokens <= 0:
            return
        ce = sum(c for c, _, _ in everyone)  # in rank order: the same value on every rank
        stage = "val" if hook == "validation_step" else "test"
        name = self.strategy.loss_name
        name = name.replace("train", stage, 1) if "train" in name else f"{stage}/{name}"
        self._log(
            name, torch.tensor(ce / tokens, dtype=torch.float64), on_step=False, prog_bar=stage == "val"
        )

    def predict(self, batch: StepBatch, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """``predict_step(mb, batch_idx)`` once per micro-batch of this rank; their outputs in order."""
        module = self.strategy.lightning_module
        assert module is not None
        context = self.strategy.precision_plugin.predict_step_context
        _, outputs = self._forward_only(
            "predict_step", batch, lambda mb: module.predict_step(mb, *args, **kwargs), context
        )
        return outputs


__all__ = ["LOSS_PROBE_STEPS", "SAFE_HOOK", "EvalLoss", "StepLoop", "TrainStep"]
