"""`StepLoopHooks`: Lightning's step hooks of a strategy that runs every step through its :class:`StepLoop`.

Lightning calls a strategy's ``training_step``, ``backward`` and ``optimizer_step`` for each
optimizer step, and its ``validation_step``, ``test_step`` and ``predict_step`` for each
evaluation batch.  Under HDP a batch is a :class:`~lightning_bytescale.engine.batch.StepBatch` of
this rank's micro-batches, so each hook hands it to the step loop
(:mod:`~lightning_bytescale.lightning.step`, which holds the bodies); anything else (a batch the
user's own loader made) goes to Lightning's own hook.  The loop also refuses a collective Lightning
would start inside a micro-batch loop (it would hang), and names what this rank was doing when a
peer's failure stops it.  This base class holds those overrides, so the strategy file does not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_bytescale.lightning import step as step_loop

if TYPE_CHECKING:
    import lightning.pytorch as pl


class StepLoopHooks(ParallelStrategy):
    """The step hooks of a ``ParallelStrategy`` that is its loop's :class:`~lightning_bytescale.lightning.step.StepHost`.

    The strategy calls :meth:`init_step_loop` in its ``__init__`` and comes first among the bases
    that define these hooks (Lightning's own are the fallback for batches that are not step batches).
    """

    def init_step_loop(self) -> None:
        """Make this strategy's step loop (the strategy is its ``StepHost``)."""
        self.step_stats: dict[str, Any] = {}
        """The last optimizer step's statistics (:mod:`~lightning_bytescale.lightning.step_stats`)."""
        self._loop = step_loop.StepLoop(self)  # type: ignore[arg-type]  # the subclass completes the StepHost

    @property
    def phase(self) -> str:
        """What this rank is doing (the step loop's phase), named when a peer's failure stops it."""
        return self._loop.phase

    @phase.setter
    def phase(self, phase: str) -> None:
        self._loop.phase = phase

    @property
    def offloader(self) -> Any:
        """The ``ActivationOffloader`` the steps have used (``None`` before the first offloaded micro-batch)."""
        return self._loop.offloader

    def refuse_collective(self, what: str) -> None:
        """Inside a micro-batch loop a collective would hang (:meth:`~lightning_bytescale.lightning.step.StepLoop.refuse_collective`)."""
        self._loop.refuse_collective(what)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """This rank's micro-batches, each forward and backward (:meth:`~lightning_bytescale.lightning.step.StepLoop.training_step`)."""
        return self._loop.training_step(args, kwargs)

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """The step's gradient sync (every rank, once per step), then the backward hooks (:meth:`~lightning_bytescale.lightning.step.StepLoop.backward`)."""
        if self._loop.step is None or self.lightning_module is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        return self._loop.backward(closure_loss)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Lightning's closure (``training_step``, ``backward``: the sync), then clipping and the optimizer step."""
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        try:
            return super().optimizer_step(optimizer, self._loop.closure(inner, closure), model, **kwargs)
        finally:
            self.step_stats = self._loop.end_step() or self.step_stats

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("test_step", args, kwargs)

    def _evaluate(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``hook(mb, ...)`` once per micro-batch of this rank; their outputs, in order (:meth:`~lightning_bytescale.lightning.step.StepLoop.evaluate`)."""
        if not (args and isinstance(args[0], step_loop.STEP_BATCH_TYPES)):
            return getattr(super(), hook)(*args, **kwargs)
        return self._loop.evaluate(hook, args[0], args[1:], kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """``predict_step(mb, batch_idx)`` once per micro-batch of this rank; returns their outputs in order.

        Each rank returns its own micro-batches' outputs (a list, possibly empty); ``mb.seq_ids``
        and ``mb.layout`` say which sequences (and, for a ring, which zigzag chunks) they hold.
        """
        if not (args and isinstance(args[0], step_loop.STEP_BATCH_TYPES)):
            return super().predict_step(*args, **kwargs)
        return self._loop.predict(args[0], args[1:], kwargs)


__all__ = ["StepLoopHooks"]
