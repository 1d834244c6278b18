"""Packed (THD) micro-batches and the per-step batch that a rank's loader yields.

One Lightning batch is one optimizer step: every rank's loader yields exactly one
`StepBatch` per step, holding this rank's own micro-batches (their number differs between
ranks).  Plain (non-frozen) dataclasses, so Lightning's ``apply_to_collection`` can move them
to a device, and picklable, so DataLoader workers can build them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightning_bytescale.engine.loss import token_loss
from lightning_bytescale.packed_attention.layout import AttentionLayout


@dataclass
class PackedMicroBatch:
    """One micro-batch on one rank, in the packed THD layout (``T`` slots, no batch dim)."""

    input_ids: torch.Tensor  # long [T]; padding slots hold 0
    labels: torch.Tensor  # long [T]; next token of the same sequence, -100 where ignored
    position_ids: torch.Tensor  # long [T]; real positions in the sequence (RoPE), padding continues
    layout: AttentionLayout
    seq_ids: tuple[int, ...]  # global-batch index of each sequence, in slot order
    num_global_tokens: int  # loss tokens of the whole global batch (all ranks, all micro-batches)
    offload_ratio: float = 0.0
    index: int = 0  # position in this rank's list for the step
    probe_ring: bool = False  # every member of this ring runs the loss-normalisation probe on it

    @property
    def num_slots(self) -> int:
        return int(self.input_ids.numel())

    def loss(self, logits: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the global token-mean loss: what ``training_step`` returns.

        ``token_loss(logits, self.labels, self.num_global_tokens)``: the sum of token
        cross-entropies divided by the loss tokens of the *whole* global batch.
        """
        return token_loss(logits, self.labels, self.num_global_tokens)


@dataclass
class StepBatch:
    """Everything one rank runs in one step."""

    micro_batches: list[PackedMicroBatch]
    num_global_tokens: int  # loss tokens of the global batch
    num_tokens: int  # real tokens of the global batch (for tokens/s)
    digest: str  # plan digest, identical on every rank
    step: int = 0  # global step index in the epoch (sampler position)
    stats: dict = field(default_factory=dict)  # plan statistics for telemetry (planned times, ...)
    data_identity: str = ""  # what the step reads, by content (folded into ``digest``); "" if unknown

    @property
    def step_batch(self) -> StepBatch:
        """The step's :class:`StepBatch`: itself (a pipeline's batch holds one, :class:`~lightning_bytescale.parallel.PipelineStepBatch`)."""
        return self
