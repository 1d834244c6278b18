"""The step loop of ``ByteScaleStrategy``: one optimizer step as one typed object, the same for every layout.

One Lightning batch is one optimizer step.  :meth:`StepLoop.train` (from the strategy's
``training_step``) hands this rank's part of the step to the layout's step runner
(:class:`~lightning_bytescale.engine.runner.StepRunner`: plain HDP, the tensor-parallel mesh or
pipelines; :func:`~lightning_bytescale.parallel.layout.make_runner` chose it at set-up), with
the LightningModule's ``training_step`` as the forward and the precision plugin's backward, and
returns a :class:`TrainStep`; :meth:`StepLoop.sync` -- called from the strategy's ``backward``,
which every rank runs once per step -- is the runner's ``sync`` (the step's gradient sum and
checks), so the gradients are final (summed over the ranks; under ZeRO-2 only the rank's own
shard) before ``on_after_backward``.  Validation, test and prediction are the runner's
``evaluate`` (:meth:`StepLoop.evaluate`, :meth:`StepLoop.predict`).  Nothing here asks which
layout runs: what differs is the runner's.

The loop depends on the strategy only through :class:`StepHost`, the few things it needs of it
(the module, the precision plugin, the device, the runner, the layout's lane, the watchdog and
the preemption handler), and on :class:`LoopOptions`, the strategy's step options.

Inside every micro-batch loop ranks run different numbers of micro-batches, so a collective
there would pair with another rank's next collective: :meth:`StepLoop.refuse_collective` (the
strategy's ``all_gather``, ``reduce``, ``barrier`` and ``broadcast`` call it) fails at once,
naming the hook and the one that is safe.  The loss and the statistics a step hands to the
hooks are the step's global ones, the same on every rank; the statistics come from the plan
every rank holds and from the step's one all-reduce (:func:`~lightning_bytescale.lightning.step_stats.step_stats`,
plus the layout's own figures, ``StepResult.layout_stats``).
"""

from __future__ import annotations

import contextlib
import re
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module

from lightning_bytescale.engine.attention_check import AttentionCheckWindow
from lightning_bytescale.engine.batch import PackedMicroBatch, StepBatch
from lightning_bytescale.engine.loss_check import LossScaling
from lightning_bytescale.engine.results import LocalResult, StepResult
from lightning_bytescale.engine.runner import Compute, InFlight, StepRunner
from lightning_bytescale.engine.step_checks import StepChecks
from lightning_bytescale.engine.watchdog import StepWatchdog
from lightning_bytescale.errors import CollectiveInMicroBatchError, GradientAccumulationError
from lightning_bytescale.lightning import compat as compat
from lightning_bytescale.lightning import epoch_metrics as epoch_metrics
from lightning_bytescale.lightning.step_stats import step_stats
from lightning_bytescale.offload.blocks import find_blocks
from lightning_bytescale.offload.offloader import ActivationOffloader
from lightning_bytescale.parallel.pipeline_batch import PipelineStepBatch

if TYPE_CHECKING:
    import lightning.pytorch as pl

LOSS_PROBE_STEPS = 3  # steps in which each rank probes the loss normalisation until one probe is conclusive

#: The hook that every rank runs exactly once per step, for each micro-batch hook.
SAFE_HOOK = {
    "training_step": "on_train_batch_end",
    "validation_step": "on_validation_batch_end",
    "test_step": "on_test_batch_end",
    "predict_step": "on_predict_batch_end",
}


class Preemption(Protocol):
    """What the loop needs of the preemption handler: the flag the step's sync carries, and the agreement."""

    @property
    def requested(self) -> bool: ...

    def record_agreement(self, stop: bool) -> None: ...


class StepHost(Protocol):
    """What the step loop needs of its strategy (``ByteScaleStrategy`` is one)."""

    @property
    def lightning_module(self) -> pl.LightningModule | None: ...

    @property
    def precision_plugin(self) -> Precision: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def step_runner(self) -> StepRunner:
        """The layout's runner, made at set-up."""
        ...

    @property
    def counts_tokens(self) -> bool:
        """Whether this rank counts its HDP rank's evaluation tokens (the TP lanes of one hold the same: lane 0 does)."""
        ...

    @property
    def step_watchdog(self) -> StepWatchdog | None: ...

    @property
    def preemption_handler(self) -> Preemption | None: ...

    @property
    def loop_options(self) -> LoopOptions:
        """The step options, read when a step starts."""
        ...

    @property
    def cost_refinement(self) -> Any:
        """The run's cost refinement (its micro-batch times ride in the step's sync), or ``None``."""
        ...

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any: ...


@dataclass(frozen=True)
class LoopOptions:
    """The step loop's options: ``ByteScaleStrategy``'s arguments of the same names, kept as ``strategy.loop_options``."""

    check_finite: bool = True
    """Stop with :class:`~lightning_bytescale.errors.NonFiniteError` (naming ranks, micro-batches and
    sequences) on a non-finite loss (every micro-batch) or accumulated gradient (once a step; not
    while a float16 grad scaler is active)."""

    locate_non_finite: bool = False
    """Check the gradients after every micro-batch instead, to name the first bad one."""

    check_loss_normalization: bool = True
    """In the first steps, probe one micro-batch per rank again with ``num_global_tokens`` doubled
    and stop with :class:`~lightning_bytescale.errors.LossNormalizationError` if the loss did not
    change (a per-micro-batch mean); warn if it did not halve."""

    check_attention: bool = True
    """In the first step, count the ``lightning_bytescale.attention`` calls of every micro-batch's
    forward, and stop with :class:`~lightning_bytescale.errors.MissingPackedAttentionError` where one
    made none (:mod:`~lightning_bytescale.engine.attention_check`); ``False`` for a model that mixes
    no tokens or handles packed sequences and rings itself."""

    check_parameters_every_n_steps: int = 100
    """Every N steps (and the first of each run) compare parameter fingerprints in the step's
    all-reduce (:class:`~lightning_bytescale.errors.ParameterDivergenceError`); ``0``: off."""

    log_loss: bool = True
    """Log the global token-mean loss of the step as :attr:`loss_name` (progress bar too)."""

    loss_name: str = "train/loss"
    """The metric name used by :attr:`log_loss`."""

    offload: Any = False
    """Activation offload: off (``False``/``None``), on (an ``ActivationOffloader`` is built), or the offloader itself
    (the strategy's ``offload`` argument)."""

    offloader_options: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments for the ``ActivationOffloader`` the loop builds."""

    pg_seconds: float | None = None
    """The process-group timeout (the strategy's ``timeout``): a rank waiting on its peers is watched at least that long."""


@dataclass
class TrainStep:
    """One optimizer step on this rank, from its runner's ``run`` to the optimizer step.

    ``step`` is the runner's step in flight (its ``result`` set by the sync); ``grads`` keeps
    the loop's gradients over Lightning's ``zero_grad`` (between ``training_step`` and
    ``backward``); ``extras`` holds the other keys of a dict that ``training_step`` returned,
    one list entry per micro-batch of this rank; ``stats`` (``strategy.step_stats``) are set
    with the sync, ``synced`` then.
    """

    step: InFlight
    probing: bool
    started: float
    grads: list[Tensor | None] = field(default_factory=list)
    extras: dict[str, list[Any]] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    synced: bool = False

    @property
    def result(self) -> StepResult | None:
        return self.step.result

    def put_aside(self) -> None:
        """Take the gradients off the parameters (Lightning zeroes them before ``backward``)."""
        self.grads = [p.grad for _, p in self.step.named]
        for _, p in self.step.named:
            p.grad = None

    def put_back(self) -> None:
        for (_, p), g in zip(self.step.named, self.grads):
            p.grad = g

    @property
    def loss(self) -> Tensor:
        """The step's global token-mean loss after the sync, else this rank's share (in the forward's dtype)."""
        return self.step.loss.detach().to(self.step.loss_dtype)


def _loss_of(out: Any) -> Tensor | None:
    loss = out.get("loss") if isinstance(out, Mapping) else out
    return loss if isinstance(loss, Tensor) and loss.dim() == 0 else None


@dataclass
class EvalLoss:
    """One evaluation epoch's token losses on this rank: summed cross-entropy and loss tokens."""

    ce_sum: float = 0.0
    tokens: int = 0
    other_outputs: bool = False  # some micro-batch returned something else than a scalar loss


def refuse_accumulation(trainer: pl.Trainer) -> None:
    """Gradient accumulation over Lightning batches: refused by name, before any batch runs."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler  # Lightning imports this module

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


class StepLoop:
    """What ``ByteScaleStrategy`` runs in each step and evaluation step (one per strategy)."""

    refuse_accumulation = staticmethod(refuse_accumulation)

    def __init__(self, host: StepHost) -> None:
        self.host = host
        self.in_loop: str | None = None  # the micro-batch hook running now
        self.phase = "set-up"  # where this rank is, for errors
        self.steps_run = 0
        self.loss_probe_done = False
        self.attention_window = AttentionCheckWindow()  # the first steps' attention check
        self.warned_partial_loss = False
        self.offloader: Any = None
        self.eval_loss: dict[tuple[str, int], EvalLoss] = {}
        self.step: TrainStep | None = None  # the optimizer step in flight
        # the optimizer whose closure runs now (the precision plugin's backward gets it)
        self.optimizer: Any = None

    @property
    def options(self) -> LoopOptions:
        return self.host.loop_options

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

    # ------------------------------------------------------------------ watchdog and phases
    def beat(self, phase: str, *, waits_on_peers: bool = False) -> None:
        """Record where this rank is (for errors) and that it progresses (for the watchdog)."""
        self.phase = phase
        dog = self.host.step_watchdog
        if dog is None:
            return
        pg = self.options.pg_seconds
        if waits_on_peers and pg is not None:
            # bounded by the process-group timeout: a rank waiting on a stuck peer fails with the
            # peer error first, and the stuck rank's own watchdog names where it is
            dog.beat(phase, max(dog.timeout_s, pg + max(30.0, pg / 2)))
        else:
            dog.beat(phase)

    def idle(self) -> None:
        dog = self.host.step_watchdog
        if dog is not None:
            dog.idle()

    def _phase(self, text: str) -> None:
        self.beat(text, waits_on_peers="(ring" in text or "(waits on every rank)" in text)

    def _waits(self, text: str) -> None:
        self.beat(text, waits_on_peers=True)

    # ------------------------------------------------------------------ pieces of the loop
    def offload_context(self, mb: PackedMicroBatch) -> contextlib.AbstractContextManager:
        offload = self.options.offload
        if offload in (None, False) or mb.offload_ratio <= 0:
            return contextlib.nullcontext()
        return self._offloader().micro_batch_context(mb)

    def _offloader(self) -> Any:
        """The activation offloader: ``offload`` itself if it is one, else one built from its options."""
        if self.offloader is None:
            offload = self.options.offload
            if hasattr(offload, "micro_batch_context"):
                self.offloader = offload
            else:
                module = self.host.lightning_module
                self.offloader = ActivationOffloader(find_blocks(module), **self.options.offloader_options)
        return self.offloader

    # ------------------------------------------------------------------ Lightning's calls of one optimizer step
    def training_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The strategy's ``training_step``: this rank's part of the step (:meth:`train`), kept as :attr:`step`.

        Returns ``{"loss": ..., **extras}``: the loss becomes the step's global loss in
        :meth:`backward`; the other keys of a dict ``training_step`` returned are lists, one entry per
        micro-batch of this rank (what ``on_train_batch_end`` gets as ``outputs``).
        """
        batch = args[0] if args else None
        if not isinstance(batch, STEP_BATCH_TYPES):
            raise TypeError(
                f"ByteScaleStrategy expects each training batch to be a StepBatch (one optimizer step), got "
                f"{type(batch).__name__}. Use lightning_bytescale.ByteScaleDataModule (docs/data.md), or a "
                "loader whose items are built with lightning_bytescale.engine.build_step from a plan of "
                "lightning_bytescale.planner.make_plan (docs/engine.md)."
            )
        trainer = compat.module_trainer(self.host.lightning_module)
        if trainer is not None:
            refuse_accumulation(trainer)  # a scheduler raising it at an epoch start
        self.step = self.train(batch, args[1:], kwargs)
        return {"loss": self.step.loss.to(self.host.root_device), **self.step.extras}

    def backward(self, closure_loss: Tensor) -> Tensor:
        """The strategy's ``backward`` of the step in flight: its sync, then the precision plugin's backward hooks.

        ``on_before_backward`` gets the step's global loss (the micro-batches' backwards ran in
        ``training_step``; no gradient is visible in the hook, as after DDP's ``zero_grad``),
        ``on_after_backward`` final gradients: summed over the ranks (ZeRO-2: this rank's own shard).
        """
        step, module, plugin = self.step, self.host.lightning_module, self.host.precision_plugin
        assert step is not None and module is not None
        self.sync(step)  # a pipeline's step synced in its schedule already: its result
        closure_loss = closure_loss.detach()
        closure_loss.copy_(step.loss.to(closure_loss.device))
        step.put_aside()
        plugin.pre_backward(closure_loss, module)
        step.put_back()
        return plugin.post_backward(closure_loss, module)

    def closure(self, optimizer: Any, closure: Callable[[], Any]) -> Callable[[], Any]:
        """Lightning's optimizer closure of ``optimizer`` (``training_step``, ``backward``), followed by the step's sync.

        The sync runs even where Lightning skipped ``backward``, and the closure's loss becomes
        the step's global loss (what Lightning hands to ``on_train_batch_end``).
        """
        self.optimizer = optimizer

        def closure_of_the_step() -> Any:
            out = closure()
            step = self.step
            if step is not None and not step.synced:  # Lightning skipped backward: sync all the same
                self.sync(step)
            if isinstance(out, Tensor) and step is not None:
                out.copy_(step.loss.to(out.device, out.dtype))
            return out

        return closure_of_the_step

    def end_step(self) -> dict[str, Any]:
        """After the optimizer step (or its failure): the step's statistics with its time (``{}`` without any)."""
        self.idle()
        self.optimizer = None
        step, self.step = self.step, None
        if step is None or not step.stats:
            return {}
        step.stats["step_time_s"] = time.perf_counter() - step.started
        return step.stats

    # ------------------------------------------------------------------ training
    def train(self, batch: Any, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> TrainStep:
        """This rank's part of one step through the layout's runner, each forward and backward; gradients put aside."""
        host, options = self.host, self.options
        module = host.lightning_module
        assert module is not None
        started = time.perf_counter()
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        for _, p in named:
            p.grad = None
        scaler = getattr(host.precision_plugin, "scaler", None)
        probing = options.check_loss_normalization and not self.loss_probe_done
        extras: dict[str, list[Any]] = {}

        def forward(_model: Module, mb: PackedMicroBatch) -> Tensor:
            if not torch.is_grad_enabled():  # the loss-normalisation probe: its logs do not count
                with compat.discarded_logging(compat.module_trainer(module)):
                    return self._training_forward(module, mb, rest, kwargs, None)
            return self._training_forward(module, mb, rest, kwargs, extras)

        def backward(loss: Tensor) -> None:
            host.precision_plugin.backward(
                scaler.scale(loss) if scaler is not None else loss, module, self.optimizer
            )

        every = options.check_parameters_every_n_steps
        step_number = batch.step_batch.step
        checks = StepChecks(
            finite=options.check_finite,
            finite_gradients=options.check_finite and scaler is None,
            locate_non_finite=options.locate_non_finite,
            loss_scaling=probing,
            parameters=every > 0 and (self.steps_run == 0 or step_number % every == 0),
            attention=options.check_attention and self.attention_window.active,  # the first steps only
        )
        compute = Compute(
            forward=forward,
            backward=backward,
            micro_batch_context=self.offload_context,
            sync_timing=host.root_device.type == "cuda",
            on_phase=self._phase,
            on_wait=self._waits,
        )
        with self.micro_batches("training_step"):
            step = host.step_runner.run(module, batch, compute=compute, checks=checks, params=named)
        train_step = TrainStep(step, probing, started, extras=extras)
        train_step.put_aside()
        return train_step

    def _training_forward(
        self,
        module: pl.LightningModule,
        mb: PackedMicroBatch,
        rest: tuple[Any, ...],
        kwargs: dict[str, Any],
        extras: dict[str, list[Any]] | None,
    ) -> Tensor:
        with self.host.precision_plugin.train_step_context():
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
        return loss

    def sync(self, train_step: TrainStep) -> StepResult:
        """The step's gradient sync (every rank, once per step): afterwards the gradients are final.

        A second call returns the first result (Lightning may skip ``backward``; the optimizer
        closure syncs then).
        """
        step = train_step.step
        train_step.put_back()
        if train_step.synced:
            return step.result  # type: ignore[return-value]
        preemption = self.host.preemption_handler
        # the cost refinement (plain HDP): every rank's micro-batch times travel in the step's all-reduce
        refinement = self.host.cost_refinement
        extra = None if refinement is None else refinement.extra(step.batch, step.local)
        result = self.host.step_runner.sync(step, extra=extra)
        if preemption is not None:  # the preemption callback acts on it after this step
            preemption.record_agreement(result.stop_requested)
        self.steps_run += 1
        if train_step.probing:
            self._after_probe(result, step.batch.step)
        if step.checks.attention:
            self.attention_window.record(result.attention)
        train_step.synced = True
        train_step.stats = {**step_stats(step.batch, result), **result.layout_stats}
        if refinement is not None:
            train_step.stats.update(refinement.observe(step.batch, result))
        if self.options.log_loss:
            self._log(self.options.loss_name, result.loss_tensor, on_step=True, prog_bar=True)
        return result

    def stop_requested(self) -> bool:
        """This rank's stop flag for the step's sync (a SIGTERM caught by the preemption handler)."""
        preemption = self.host.preemption_handler
        return preemption is not None and preemption.requested

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
        module = self.host.lightning_module
        if module is None or compat.module_trainer(module) is None:
            return
        if not on_step:  # Lightning advises sync_dist for epoch values: this one needs none
            warnings.filterwarnings(
                "ignore", message=re.escape(f"It is recommended to use `self.log({name!r}")
            )
        value = value.to(self.host.root_device)
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
        self, hook: str, batch: Any, call: Callable[[PackedMicroBatch], Any], context: Any
    ) -> tuple[LocalResult, list[Any]]:
        """``call(mb)`` for each micro-batch of this rank through the runner's ``evaluate``, without a backward."""
        module = self.host.lightning_module
        assert module is not None
        outputs: list[Any] = []

        def forward(_model: Module, mb: PackedMicroBatch) -> Tensor:
            out = call(mb)
            outputs.append(out)
            loss = _loss_of(out)
            return (
                loss.detach().to(torch.float64) if loss is not None else torch.zeros((), dtype=torch.float64)
            )

        compute = Compute(
            forward=forward,
            micro_batch_context=self.offload_context,
            on_phase=lambda text: self._phase(f"{hook} of {text}"),
            forward_only=True,
        )
        try:
            with context(), self.micro_batches(hook):
                local = self.host.step_runner.evaluate(module, batch, compute=compute, name=hook)
        finally:
            self.idle()
        return local, outputs

    def evaluate(self, hook: str, batch: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """``validation_step`` / ``test_step`` once per micro-batch of this rank; returns their outputs in order.

        The token losses add up over the epoch on each rank; at the epoch's last step of each
        dataloader every rank reduces them (and agrees on the user's epoch-reduced metrics,
        :func:`~lightning_bytescale.lightning.epoch_metrics.agree_on_epoch_metrics`) with one
        collective, and the strategy logs ``val/loss`` (``test/loss``), the exact token mean.
        """
        host = self.host
        module = host.lightning_module
        assert module is not None
        batch_idx = int(args[0]) if args else 0
        loader = int(args[1]) if len(args) > 1 else int(kwargs.get("dataloader_idx", 0) or 0)
        plugin = host.precision_plugin
        context = plugin.val_step_context if hook == "validation_step" else plugin.test_step_context
        local, outputs = self._forward_only(
            hook, batch, lambda mb: getattr(module, hook)(mb, *args, **kwargs), context
        )
        if batch_idx == 0:
            self.eval_loss[(hook, loader)] = EvalLoss()
        totals = self.eval_loss.setdefault((hook, loader), EvalLoss())
        totals.other_outputs |= any(_loss_of(out) is None for out in outputs)
        if host.counts_tokens:  # the TP lanes of an HDP rank hold the same tokens: count them once
            totals.ce_sum += float(local.loss) * int(batch.step_batch.num_global_tokens)
            totals.tokens += int(local.loss_tokens)
        if self._last_eval_batch(batch_idx, loader):
            self._end_eval_epoch(hook, totals)
        return outputs

    def _last_eval_batch(self, batch_idx: int, loader: int) -> bool:
        trainer = compat.module_trainer(self.host.lightning_module)
        if trainer is None:
            return False
        loop = compat.evaluation_loop(trainer)
        limits = loop.max_batches
        limit = limits[loader] if loader < len(limits) else float("inf")
        return batch_idx + 1 >= limit or bool(loop.batch_progress.is_last_batch)

    def _end_eval_epoch(self, hook: str, totals: EvalLoss) -> None:
        """Every rank, at the last step of a dataloader: one collective, then ``val/loss`` (``test/loss``)."""
        module = self.host.lightning_module
        trainer = compat.module_trainer(module)
        assert module is not None and trainer is not None
        self.beat(f"the end of the {hook} epoch (waits on every rank)", waits_on_peers=True)
        mine = (totals.ce_sum, totals.tokens, totals.other_outputs)
        everyone = epoch_metrics.agree_on_epoch_metrics(trainer, module, self.host.reduce, extra=mine)
        self.idle()
        if not self.options.log_loss or any(other for _, _, other in everyone):
            return
        tokens = sum(t for _, t, _ in everyone)
        if tokens <= 0:
            return
        ce = sum(c for c, _, _ in everyone)  # in rank order: the same value on every rank
        stage = "val" if hook == "validation_step" else "test"
        name = self.options.loss_name
        name = name.replace("train", stage, 1) if "train" in name else f"{stage}/{name}"
        self._log(
            name, torch.tensor(ce / tokens, dtype=torch.float64), on_step=False, prog_bar=stage == "val"
        )

    def predict(self, batch: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """``predict_step(mb, batch_idx)`` once per micro-batch of this rank; their outputs in order."""
        module = self.host.lightning_module
        assert module is not None
        context = self.host.precision_plugin.predict_step_context
        _, outputs = self._forward_only(
            "predict_step", batch, lambda mb: module.predict_step(mb, *args, **kwargs), context
        )
        return outputs


#: What a training, evaluation or prediction batch of the strategy is: one optimizer step of one rank
#: (of one HDP rank, or of one pipeline); the layout's runner refuses the other kind by name.
STEP_BATCH_TYPES: tuple[type, ...] = (StepBatch, PipelineStepBatch)


__all__ = [
    "LOSS_PROBE_STEPS",
    "SAFE_HOOK",
    "STEP_BATCH_TYPES",
    "EvalLoss",
    "LoopOptions",
    "Preemption",
    "StepHost",
    "StepLoop",
    "TrainStep",
    "refuse_accumulation",
]
