"""The execution engine: packed micro-batches, the token-level loss and the HDP step executor."""

from lightning_bytescale.engine.batch import PackedMicroBatch, StepBatch
from lightning_bytescale.engine.executor import (
    DivergentPlanError,
    LocalResult,
    NonFiniteError,
    StepError,
    StepResult,
    allreduce_gradients,
    default_forward,
    move_micro_batch,
    run_micro_batch,
    run_micro_batches,
    run_step,
)
from lightning_bytescale.engine.loss import token_loss
from lightning_bytescale.engine.packing import (
    EmptyBatchError,
    PackingError,
    build_micro_batch,
    build_step,
    count_loss_tokens,
    plan_digest,
)

__all__ = [
    "DivergentPlanError",
    "EmptyBatchError",
    "LocalResult",
    "PackedMicroBatch",
    "PackingError",
    "StepBatch",
    "NonFiniteError",
    "StepError",
    "StepResult",
    "allreduce_gradients",
    "build_micro_batch",
    "build_step",
    "count_loss_tokens",
    "default_forward",
    "move_micro_batch",
    "plan_digest",
    "run_micro_batch",
    "run_micro_batches",
    "run_step",
    "token_loss",
]
