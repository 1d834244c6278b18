"""The LightningModule the recipes train: the reference Llama on packed micro-batches.

``training_step(mb, batch_idx)`` receives one :class:`PackedMicroBatch` (the strategy runs the
rank's micro-batches and installs each one's attention layout) and returns
``token_loss(logits, mb.labels, mb.num_global_tokens)``: the micro-batch's share of the global
token-mean loss.  The model is built in ``configure_model`` so that large presets are created
directly on the device.  ``train_flops(lengths)`` feeds the telemetry's MFU estimate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule

from lightning_bytescale.engine.batch import PackedMicroBatch
from lightning_bytescale.engine.loss import token_loss
from lightning_bytescale.errors import ConfigError
from lightning_bytescale.models.llama import LlamaConfig, LlamaModel

__all__ = ["PretrainModule", "warmup_cosine"]


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """LR multiplier: linear warm-up to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class PretrainModule(LightningModule):
    """Next-token pretraining of :class:`~lightning_bytescale.models.llama.LlamaModel`.

    Args:
        preset: a :meth:`LlamaConfig.preset` name (``tiny`` ... ``70b``).
        vocab: vocabulary size; None keeps the preset's (the recipe sets the tokenizer's).
        overrides: other :class:`LlamaConfig` fields, e.g. ``{"layers": 4}``.
        lr, weight_decay, betas: AdamW; weight decay applies to matrices only.
        warmup_steps, min_lr_ratio: the warm-up + cosine schedule over ``trainer.max_steps``.
    """

    def __init__(
        self,
        preset: str = "tiny",
        vocab: int | None = None,
        overrides: dict[str, Any] | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: Sequence[float] = (0.9, 0.95),
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        if lr <= 0:
            raise ConfigError(f"lr must be positive, got {lr}")
        if len(betas) != 2:
            raise ConfigError(f"betas must be two numbers (beta1, beta2), got {list(betas)}")
        extra = dict(overrides or {})
        if vocab is not None:
            extra["vocab"] = int(vocab)
        self.config = LlamaConfig.preset(preset, **extra)  # validates the shape now, not at fit
        self.save_hyperparameters({"preset": preset, "model_config": vars(self.config).copy()})
        self.lr, self.weight_decay, self.betas = (
            float(lr),
            float(weight_decay),
            tuple(float(b) for b in betas),
        )
        self.warmup_steps, self.min_lr_ratio = int(warmup_steps), float(min_lr_ratio)
        self.model: LlamaModel | None = None

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (rows of its embedding): the data module checks its ids against it."""
        return int(self.config.vocab)

    def configure_model(self) -> None:
        if self.model is None:
            self.model = LlamaModel(self.config)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        self.configure_model()
        assert self.model is not None
        return self.model(input_ids, position_ids)

    def training_step(self, mb: PackedMicroBatch, batch_idx: int) -> torch.Tensor:
        logits = self(mb.input_ids, mb.position_ids)
        return token_loss(logits, mb.labels, mb.num_global_tokens)

    def validation_step(self, mb: PackedMicroBatch, batch_idx: int) -> torch.Tensor:
        return self.training_step(mb, batch_idx)

    def train_flops(self, lengths: Sequence[int]) -> float:
        """Forward+backward model FLOPs for a global batch of sequences with these lengths."""
        return float(sum(s * self.config.flops_per_token(s) for s in lengths))

    def configure_optimizers(self) -> Any:
        self.configure_model()
        decay, no_decay = [], []
        for p in self.parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)
        groups = [
            {"params": decay, "weight_decay": self.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)
        total = int(self.trainer.max_steps) if self.trainer.max_steps and self.trainer.max_steps > 0 else 0
        warmup, floor = self.warmup_steps, self.min_lr_ratio
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, warmup, total, floor)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
