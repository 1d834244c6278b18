"""The execution engine: packed micro-batches, the token-level loss and the HDP step executor."""

from lightning_bytescale.engine.batch import PackedMicroBatch, StepBatch
from lightning_bytescale.engine.executor import (
    HDPRunner,
    LocalResult,
    StepResult,
    allreduce_gradients,
    check_step,
    default_forward,
    move_micro_batch,
    run_micro_batch,
    run_micro_batches,
    run_step,
    sync_step,
)
from lightning_bytescale.engine.loss import token_loss
from lightning_bytescale.engine.micro_batch import (
    EmptyBatchError,
    PackingError,
    build_micro_batch,
    build_step,
    count_loss_tokens,
    plan_digest,
)
from lightning_bytescale.engine.runner import Compute, InFlight, StepRunner, SyncOptions
from lightning_bytescale.engine.state_sync import broadcast_module_state
from lightning_bytescale.engine.step_checks import StepChecks
from lightning_bytescale.errors import DivergentPlanError, NonFiniteError, PlanDivergenceError, StepError

__all__ = [
    "Compute",
    "DivergentPlanError",
    "HDPRunner",
    "InFlight",
    "StepChecks",
    "StepRunner",
    "SyncOptions",
    "EmptyBatchError",
    "LocalResult",
    "PackedMicroBatch",
    "PackingError",
    "StepBatch",
    "NonFiniteError",
    "StepError",
    "StepResult",
    "PlanDivergenceError",
    "allreduce_gradients",
    "broadcast_module_state",
    "check_step",
    "build_micro_batch",
    "build_step",
    "count_loss_tokens",
    "default_forward",
    "move_micro_batch",
    "plan_digest",
    "run_micro_batch",
    "run_micro_batches",
    "run_step",
    "sync_step",
    "token_loss",
]
