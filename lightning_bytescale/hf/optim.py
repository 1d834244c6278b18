"""The fine-tuning optimizer of :class:`~lightning_bytescale.hf.HFCausalLM`: AdamW with a warmup.

Plain options, so a recipe sets them as init arguments: ``lr``, ``weight_decay`` (not applied
to biases and norm weights: every parameter with fewer than two dimensions), ``betas``,
``eps``, ``warmup_steps`` (linear from ``lr / warmup_steps`` up to ``lr``) and the decay after
the warmup (``constant``, ``linear`` or ``cosine`` down to ``min_lr_ratio * lr`` at the last
step).  The schedule steps once per optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_bytescale.errors import ConfigError

SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class OptimizerOptions:
    lr: float = 2e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "constant"
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if int(self.warmup_steps) != self.warmup_steps or self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be a non-negative integer, got {self.warmup_steps}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if len(tuple(self.betas)) != 2:
            raise ConfigError(f"betas must be two numbers, got {self.betas!r}")

    def lr_factor(self, step: int, total_steps: int | None) -> float:
        """The multiplier of ``lr`` for optimizer step ``step`` (0-based) of ``total_steps``."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        if total_steps is None:
            raise ConfigError(
                f"schedule={self.schedule!r} decays until the last step, but the run has no known length; "
                "set Trainer(max_steps=...) or use schedule='constant'"
            )
        span = max(int(total_steps) - self.warmup_steps - 1, 1)
        progress = min(max(step - self.warmup_steps, 0) / span, 1.0)
        shape = 1.0 - progress if self.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape

    def param_groups(self, named: Iterable[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
        """Weight decay on matrices and embeddings; none on biases and norm weights (``ndim < 2``)."""
        decay, no_decay = [], []
        for _, p in named:
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
        groups = [
            {"params": decay, "weight_decay": self.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return [g for g in groups if g["params"]]

    def build(self, named: Iterable[tuple[str, nn.Parameter]], total_steps: int | None) -> dict[str, Any]:
        """``configure_optimizers``' answer: AdamW plus a per-step ``LambdaLR``."""
        opt = torch.optim.AdamW(self.param_groups(named), lr=self.lr, betas=tuple(self.betas), eps=self.eps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: self.lr_factor(step, total_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
