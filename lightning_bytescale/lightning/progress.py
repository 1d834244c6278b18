"""The progress bar of a run bounded by steps: ``Epoch 0 (to step 200)``, never ``Epoch 0/-2``.

Lightning sets ``max_epochs=-1`` when only ``max_steps`` is given (the ByteScale recipes and
most step-bounded pretraining), and its Rich progress bar then reads ``Epoch 0/-2``
(``max_epochs - 1``).  :class:`StepProgressBar` is that bar with the step limit in its place;
``bytescale-train`` uses it.  Pass it to your own Trainer as
``callbacks=[StepProgressBar()]`` (it needs ``rich``, as Lightning's own Rich bar does).
"""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar

__all__ = ["StepProgressBar"]


class StepProgressBar(RichProgressBar):
    """Lightning's ``RichProgressBar`` that names the step limit when epochs are unbounded."""

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
