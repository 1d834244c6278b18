"""What ``ByteScaleStrategy`` refuses of a run before its first step: the Trainer, the module and the data module.

A run the strategy cannot train exactly is refused once, naming the cause and the fix, before
any rank starts where the launchers can tell (``ByteScaleStrategy.check_before_launch``) and
again at set-up, after ``configure_model`` built the model (``ByteScaleStrategy.setup``).  Each
check takes the few things it reads, never the strategy; the layout's own refusals are the
layout's (:meth:`~lightning_bytescale.parallel.layout.Layout.check_before_launch`,
:meth:`~lightning_bytescale.parallel.layout.Layout.check_model`).  One finding is a warning, not a
refusal, at the start of training: a fit that holds out validation data it will never reach.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer.states import TrainerFn

from lightning_bytescale.errors import ConfigError
from lightning_bytescale.lightning import compat

# imported as modules: the first import of Lightning imports the strategy, and so this module,
# maybe while one of them is still being imported
from lightning_bytescale.lightning import step as step_loop
from lightning_bytescale.lightning import strategy_options as options_
from lightning_bytescale.planner.config import PlannerConfig

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import nn


def check_trainer(
    trainer: pl.Trainer, *, config: PlannerConfig, module: nn.Module | None, tensor_parallel_size: int
) -> None:
    """Gradient accumulation over Lightning batches, and a cost model whose attention heads are not ``module``'s.

    ``module`` may not hold its model yet before launch (``HFCausalLM`` builds it in
    ``configure_model``): the heads are checked where they can be read, and again at set-up.
    """
    step_loop.refuse_accumulation(trainer)
    options_.check_cost_model_heads(config, module, tensor_parallel_size)


def check_fit(trainer: pl.Trainer) -> bool:
    """Whether the run fits; a fit needs automatic optimization (the strategy runs the micro-batch loop)."""
    fitting = trainer.state.fn == TrainerFn.FITTING
    module = trainer.lightning_module
    if fitting and not module.automatic_optimization:
        raise ConfigError(
            "ByteScaleStrategy runs the micro-batch loop and the gradient all-reduce itself and needs "
            "automatic optimization; remove `self.automatic_optimization = False` from the LightningModule."
        )
    return fitting


def check_data_modules(run_args: Iterable[Any], config: PlannerConfig, *, hdp_ranks: int) -> None:
    """The data modules among a run's arguments (``Trainer.fit(model, datamodule=...)``) against the strategy's planner.

    A data module whose own planner arguments contradict ``config`` is refused
    (``check_planner_config``), and so are options the ``hdp_ranks`` HDP ranks cannot run
    (``ByteScaleDataModule.validate``: a ``context_length`` longer than the planner can place).
    """
    for value in run_args:
        check = getattr(value, "check_planner_config", None)
        if callable(check):
            check(config)
            validate = getattr(value, "validate", None)
            if callable(validate):
                validate(world_size=hdp_ranks, planner_options=config)


def first_validation_batch(trainer: pl.Trainer) -> float | None:
    """How many training batches a fresh fit runs before its first validation, as Lightning schedules it.

    Lightning's epoch loop validates at batch ``val_check_batch`` of every ``check_val_every_n_epoch``-th
    epoch (of the whole run's batches when that is ``None``).  ``None`` where set-up cannot tell: a
    time-based ``val_check_interval``, an epoch of unknown length, a resumed fit.
    """
    every, epochs = trainer.val_check_batch, trainer.check_val_every_n_epoch
    batches = trainer.num_training_batches
    if trainer.global_step or trainer.current_epoch or every is None or math.isinf(every):
        return None
    if epochs is None:
        return every
    return None if math.isinf(batches) else (epochs - 1) * batches + min(every, batches)


def warn_if_fit_never_validates(trainer: pl.Trainer, *, warn: Callable[[str], Any]) -> None:
    """A fit that holds out validation data but reaches ``max_steps`` before Lightning's first validation.

    Lightning trains such a run to its end without a word (under DDP too); the held-out data then
    trains nothing and checks nothing.  A warning, not an error: fitting without validating and
    calling ``trainer.validate`` afterwards is a fair choice.
    """
    if trainer.max_steps < 0 or not compat.fit_validates(trainer):
        return
    first = first_validation_batch(trainer)
    if first is None or first <= trainer.max_steps:
        return
    warn(
        f"this fit holds out validation data but never validates: it ends at max_steps={trainer.max_steps}, "
        f"and Lightning's first validation comes after {first:g} training batches "
        f"(val_check_interval={trainer.val_check_interval!r}, check_val_every_n_epoch={trainer.check_val_every_n_epoch}, "
        f"{trainer.num_training_batches:g} batches an epoch). To validate during the run, set "
        f"Trainer(val_check_interval=N, check_val_every_n_epoch=None) with N <= {trainer.max_steps} (recipes: "
        f"trainer.val_check_interval=N trainer.check_val_every_n_epoch=null); to hold nothing out, val_fraction=0."
    )


__all__ = [
    "check_data_modules",
    "check_fit",
    "check_trainer",
    "first_validation_batch",
    "warn_if_fit_never_validates",
]
