"""Errors of the parallel layout (pipelines x data parallel x tensor parallel, FSDP2), each naming the cause and the fix."""

from __future__ import annotations

from lightning_bytescale.errors import ConfigError, StepError


class ParallelDimsError(ConfigError):
    """Parallel sizes that do not fit the world or the nodes (TP must divide the world and fit in a node)."""


class TensorParallelHeadsError(ParallelDimsError):
    """A model whose query or key/value heads cannot be split evenly over the tensor-parallel ranks."""


class EmbeddingShardError(ConfigError):
    """An embedding the vocabulary-sharded lookup cannot serve (max_norm, sparse gradients, a weight not Shard(0) on the TP mesh)."""


class FSDPSettingError(ConfigError):
    """An FSDP2 setting that cannot train exactly when ranks run different numbers of micro-batches."""


class PipelineModelError(ConfigError):
    """A model that cannot be split into pipeline stages (fewer blocks than stages, tied embeddings)."""


class LaneDivergenceError(StepError):
    """Another tensor-parallel lane of this HDP rank stopped the step; raised on the lanes that did not."""


__all__ = [
    "EmbeddingShardError",
    "FSDPSettingError",
    "LaneDivergenceError",
    "ParallelDimsError",
    "PipelineModelError",
    "TensorParallelHeadsError",
]
