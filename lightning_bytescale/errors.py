"""The errors a training run can stop with, one class per condition, under one base class.

Catch :class:`ByteScaleError` for anything this package raises on purpose.  Each subclass is
one condition, and each message names the cause (ranks, step, micro-batch, option) and the
fix.  The classes also derive from the built-in exception a caller would expect
(``ValueError`` for bad configuration, ``RuntimeError`` for a failed step,
``FloatingPointError`` for non-finite values), so generic handlers keep working.

Conditions of one floor's own input have their class beside that floor
(``planner.errors``, ``data.errors``, ``engine.micro_batch``, ``packed_attention``, ``offload``,
``sim``), all under this base; ``docs/troubleshooting.md`` lists the whole tree and
``tests/test_error_tree.py`` keeps it one tree with one class per condition.

This module is pure Python: every floor of the package may import it.
"""

from __future__ import annotations


class ByteScaleError(Exception):
    """Base class of every error lightning-bytescale raises on purpose."""


class ConfigError(ByteScaleError, ValueError):
    """An option, a Trainer setting or a LightningModule contract that HDP cannot run with."""


class LossNormalizationError(ConfigError):
    """``training_step`` returns a loss that is not normalised by the global token count.

    A per-micro-batch mean (``F.cross_entropy(..., reduction="mean")``) weights tokens
    differently on different ranks and micro-batches and breaks the equivalence with
    single-process training; return ``token_loss(logits, mb.labels, mb.num_global_tokens)``.
    """


class MissingPackedAttentionError(ConfigError):
    """The model's forward did not call ``lightning_bytescale.attention`` on a packed micro-batch or a ring member.

    Attention that ignores the micro-batch layout (``F.scaled_dot_product_attention(...,
    is_causal=True)``) attends across packed sequences and, on a ring member, to its own shard
    only; call ``lightning_bytescale.attention(q, k, v)``, or pass
    ``ByteScaleStrategy(check_attention=False)`` for a model that handles packing itself.
    """


class GradientAccumulationError(ConfigError):
    """Gradient accumulation over Lightning batches (``accumulate_grad_batches`` or a
    ``GradientAccumulationScheduler``): one Lightning batch is already one optimizer step."""


class CollectiveInMicroBatchError(ConfigError):
    """A collective (``all_gather``, ``reduce``, ``barrier``, ``broadcast``, ``self.log(...,
    sync_dist=True)`` on step) called inside a micro-batch loop, where ranks run different
    numbers of micro-batches and the call would pair with another rank's next collective."""


class PlannerOptionsConflictError(ConfigError):
    """The data module was given planner options that differ from the strategy's ``planner_config``."""


class CostModelTensorParallelError(ConfigError):
    """The cost model describes HDP ranks of another size (its ``tensor_parallel``, from
    ``bytescale-profile --tensor-parallel``) than the strategy's ``tensor_parallel_size``."""


class CostModelHeadsError(ConfigError):
    """The cost model names other attention heads (one tensor-parallel lane's) than the model being
    trained: its plans could run Ulysses items the model's heads cannot split."""


class CheckpointError(ByteScaleError, ValueError):
    """A checkpoint that cannot be written or read here, or that does not match the model or optimizer."""


class StepError(ByteScaleError, RuntimeError):
    """A distributed step could not be completed consistently on all ranks."""


class PlanDivergenceError(StepError):
    """Ranks hold different plans (or different data) for the same step.

    Raised on every rank before any ring exchange of the step (from the digest check), or
    after the step's all-reduce when the ranks' loss tokens do not add up to the global batch.
    """


class PlanWorldSizeError(PlanDivergenceError, ValueError):
    """A plan was made for a different number of ranks than the run has."""


class ParameterDivergenceError(StepError):
    """Ranks hold different model parameters although they must train one model."""


class NonFiniteError(StepError, FloatingPointError):
    """A micro-batch produced a non-finite loss or gradient; raised on every rank together."""


class PeerFailureError(StepError):
    """Another rank died or stopped answering during a collective or a ring transfer."""


# Backwards-compatible second names of the same classes (documented in docs/troubleshooting.md),
# kept so existing ``except`` clauses keep working.
DivergentPlanError = PlanDivergenceError
ByteScaleConfigError = ConfigError

__all__ = [
    "ByteScaleConfigError",
    "ByteScaleError",
    "CheckpointError",
    "CollectiveInMicroBatchError",
    "ConfigError",
    "CostModelHeadsError",
    "CostModelTensorParallelError",
    "DivergentPlanError",
    "GradientAccumulationError",
    "LossNormalizationError",
    "MissingPackedAttentionError",
    "NonFiniteError",
    "ParameterDivergenceError",
    "PeerFailureError",
    "PlanDivergenceError",
    "PlannerOptionsConflictError",
    "PlanWorldSizeError",
    "StepError",
]
