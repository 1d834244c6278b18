"""What a step produced on one rank: each micro-batch, the rank's loop, the step after its sync.

:class:`LocalResult` is one rank's micro-batch loop before the step's all-reduce,
:class:`StepResult` the step after it (the reduced values the same on every rank).  They are
their own module because every runner (:mod:`~lightning_bytescale.engine.runner`) hands them on,
and the step executor (:mod:`~lightning_bytescale.engine.executor`) and the runners on the mesh
fill them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_bytescale.engine.attention_check import AttentionVerdict
from lightning_bytescale.engine.loss_check import LossScaling
from lightning_bytescale.engine.step_checks import RankReport


@dataclass
class MicroBatchResult:
    index: int
    loss: float  # this micro-batch's contribution to the global loss (already / global tokens)
    loss_tokens: int
    seconds: float
    ring_size: int
    seq_ids: tuple[int, ...] = ()
    grads_finite: bool | None = None  # accumulated gradients finite after it (None: not checked)


@dataclass
class LocalResult:
    """What one rank's micro-batch loop produced, before the all-reduce."""

    loss: torch.Tensor  # 0-d, detached: sum of this rank's loss contributions
    loss_tokens: int
    micro_batches: list[MicroBatchResult] = field(default_factory=list)
    ring_bytes: float = 0.0  # bytes this rank sent to ring peers during the loop
    ring_wait_s: float = 0.0  # seconds blocked waiting for ring transfers during the loop
    loss_scaling: LossScaling = LossScaling.UNCHECKED
    loss_dtype: torch.dtype = torch.float32  # the dtype of the losses the forward returned
    attention: AttentionVerdict = field(default_factory=AttentionVerdict)  # the attention check's

    @property
    def busy_seconds(self) -> float:
        return sum(m.seconds for m in self.micro_batches)

    @property
    def first_non_finite_loss(self) -> MicroBatchResult | None:
        return next((m for m in self.micro_batches if not math.isfinite(m.loss)), None)

    @property
    def first_non_finite_gradient(self) -> MicroBatchResult | None:
        """The first checked micro-batch after which the accumulated gradients held a NaN or inf."""
        return next((m for m in self.micro_batches if m.grads_finite is False), None)

    def _non_finite_gradient_span(self) -> list[MicroBatchResult]:
        """The micro-batches the failed gradient check covers: after the last check that passed.

        Gradients accumulate, and a NaN or inf stays in a sum, so the first failed check blames
        one of the micro-batches since the previous passed check (just one when every
        micro-batch is checked).  Empty when no check failed.
        """
        start = 0
        for position, m in enumerate(self.micro_batches):
            if m.grads_finite is True:
                start = position + 1
            elif m.grads_finite is False:
                return self.micro_batches[start : position + 1]
        return []

    def report(self) -> RankReport:
        """This rank's slot of the step buffer: busy time, traffic, the first non-finite micro-batch."""
        rep = RankReport(
            busy_s=self.busy_seconds,
            ring_bytes=self.ring_bytes,
            num_micro_batches=len(self.micro_batches),
            ring_wait_s=self.ring_wait_s,
        )
        bad_loss, span = self.first_non_finite_loss, self._non_finite_gradient_span()
        if bad_loss is not None and (not span or bad_loss.index <= span[-1].index):
            rep.bad_micro_batch, rep.bad_kind, rep.bad_seq_ids = bad_loss.index, 1, bad_loss.seq_ids
        elif span:
            rep.bad_micro_batch, rep.bad_kind = span[-1].index, 2
            rep.bad_seq_ids = tuple(dict.fromkeys(s for m in span for s in m.seq_ids))
            rep.bad_from = span[0].index if len(span) > 1 else None
        return rep


@dataclass
class StepResult:
    """One step's outcome on one rank (the reduced values are identical on every rank)."""

    loss: float  # global token-mean loss
    loss_tensor: torch.Tensor  # 0-d, the same value
    local: LocalResult  # this rank's own part
    reports: list[RankReport]  # every rank's report (index = group rank)
    extra: torch.Tensor | None = None  # the caller's extra values, summed over ranks
    stop_requested: bool = False  # some rank asked to stop at this step boundary (e.g. SIGTERM)
    loss_scaling: dict[LossScaling, int] = field(default_factory=dict)  # probe verdicts: ranks each
    allreduce_s: float = 0.0
    attention: AttentionVerdict = field(default_factory=AttentionVerdict)  # the attention check's, summed
    layout_stats: dict[str, Any] = field(default_factory=dict)  # figures only this layout measures

    @property
    def num_micro_batches(self) -> int:
        return len(self.local.micro_batches)

    @property
    def busy_seconds(self) -> list[float]:
        """Measured forward+backward time of every rank (index = group rank)."""
        return [r.busy_s for r in self.reports]


__all__ = ["LocalResult", "MicroBatchResult", "StepResult"]
