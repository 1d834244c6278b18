"""The progress bar of a run bounded by steps: ``Epoch 0 (to step 200)`` and ``57/200`` steps.

Lightning sets ``max_epochs=-1`` when only ``max_steps`` is given (the ByteScale recipes and
most step-bounded pretraining), and its Rich progress bar then reads ``Epoch 0/-2``
(``max_epochs - 1``), counts the batches of the epoch against the steps left (a resumed run
reads ``200/98``), shows the logger's version (``v_num``) and cuts long metric names
(``perf/tokens_pe…``).  :class:`StepProgressBar` is that bar with the step limit in its place,
the optimizer steps counted from the run's first (a resumed run goes on from its step), and the
loss and tokens/s under short names.  ``bytescale-train`` uses it; ``ByteScaleStrategy`` puts it
in place of Lightning's default bar (:func:`prefer_step_bar`), and your own Trainer gets it with
``callbacks=[StepProgressBar()]`` (it needs ``rich``, as Lightning's own Rich bar does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import RichProgressBar

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["StepProgressBar", "prefer_step_bar"]

#: Logged names shown in the bar under a shorter one (a long name is cut in an 80-column terminal).
SHORT_NAMES = {"train/loss": "loss", "perf/tokens_per_s": "tokens/s", "val/loss": "val loss"}


def _bounded_by_steps(trainer: pl.Trainer) -> bool:
    return (trainer.max_epochs is None or trainer.max_epochs < 0) and bool(
        trainer.max_steps and trainer.max_steps > 0
    )


class StepProgressBar(RichProgressBar):
    """Lightning's ``RichProgressBar`` that counts optimizer steps when epochs are unbounded."""

    def _get_train_description(self, current_epoch: int) -> str:
        trainer = self.trainer
        if trainer.max_epochs is not None and trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        text = f"Epoch {current_epoch}"
        if trainer.max_steps is not None and trainer.max_steps > 0:
            text += f" (to step {trainer.max_steps})"
        if len(self.validation_description) > len(text):
            text = f"{text:{len(self.validation_description)}}"  # as Lightning pads it
        return text

    @property
    def total_train_batches(self) -> int | float:
        """The step limit when the run is bounded by steps (the bar then shows the global step)."""
        if _bounded_by_steps(self.trainer):
            return int(self.trainer.max_steps)
        return super().total_train_batches

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if _bounded_by_steps(trainer):
            batch_idx = int(trainer.global_step) - 1  # Lightning's bar shows batch_idx + 1
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The logged progress-bar metrics under short names, without the logger's version (``v_num``)."""
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the run's folder and W&B run are printed at the end
        shown: dict[str, Any] = {}
        for name, value in items.items():
            short = SHORT_NAMES.get(name, name)
            if short == "tokens/s" and isinstance(value, (int, float)):
                value = f"{value:,.0f}"
            shown[short] = value
        return shown


def prefer_step_bar(trainer: pl.Trainer) -> None:
    """Put a :class:`StepProgressBar` in place of the Trainer's own default Rich bar (same settings).

    Only an instance of Lightning's ``RichProgressBar`` itself is replaced (the one a Trainer
    makes when given none, or one passed as it is); a bar of another class, a subclass, or
    ``enable_progress_bar=False`` is left alone.  Epoch-bounded runs look the same with either.
    """
    callbacks = trainer.callbacks
    for i, callback in enumerate(callbacks):
        if type(callback) is RichProgressBar:
            bar = StepProgressBar.__new__(StepProgressBar)
            bar.__dict__.update(callback.__dict__)  # its refresh rate, theme and console settings
            callbacks[i] = bar
            return
