"""Parallel layouts on the torch floor: the (pipeline, data_parallel, tensor_parallel) mesh, TP models, FSDP2, the steps.

An HDP rank is a tensor-parallel group, or a pipeline of them (:mod:`.dims`); rings run lane by
lane on the global group; :func:`parallelize_llama` shards the reference Llama with DTensor's
parallel styles (an untied embedding with :class:`VocabParallelEmbedding`, whose weight gradient
stays a lane's rows); :class:`FSDPStepDriver` keeps FSDP2's collectives to one per unit per step
whatever a rank's micro-batch count; :func:`run_parallel_step` is the HDP step on the mesh and
:func:`clip_grad_norm_` clips by the global norm over DTensor shards.  With pipelines,
:class:`DecoderStage` is one stage of a decoder (:class:`LlamaStage` of the reference Llama), :func:`build_pipeline_step` a
pipeline's padded micro-batches in the pipeline order, :func:`run_pipeline_step` the step and
:class:`StageSchedules` the stages and schedules it keeps from step to step.
"""

from lightning_bytescale.parallel.clip import clip_grad_norm_, global_grad_norm
from lightning_bytescale.parallel.dims import (
    DATA_PARALLEL,
    MESH_DIM_NAMES,
    PIPELINE,
    PIPELINE_MESH_DIM_NAMES,
    TENSOR_PARALLEL,
    ParallelDims,
    ParallelMesh,
    check_heads,
)
from lightning_bytescale.parallel.errors import (
    EmbeddingShardError,
    FSDPSettingError,
    LaneDivergenceError,
    ParallelDimsError,
    PipelineModelError,
    TensorParallelHeadsError,
)
from lightning_bytescale.parallel.fsdp import FSDPStepDriver, fsdp_units
from lightning_bytescale.parallel.pipeline_batch import (
    PipelineStepBatch,
    build_pipeline_step,
    pad_micro_batch,
    padding_micro_batch,
)
from lightning_bytescale.parallel.pipeline_stage import (
    DecoderStage,
    LlamaStage,
    padded_attention,
    stage_layers,
)
from lightning_bytescale.parallel.pipeline_step import (
    PipelineRunner,
    PipelineStepResult,
    StageClock,
    StageSchedules,
    build_schedule,
    run_pipeline_step,
    stage_bubble,
)
from lightning_bytescale.parallel.shards import LocalShards
from lightning_bytescale.parallel.step import (
    MeshRunner,
    agree_across_lanes,
    run_parallel_step,
    start_step_check,
)
from lightning_bytescale.parallel.tensor_parallel import llama_tp_plan, parallelize_llama
from lightning_bytescale.parallel.vocab_embedding import (
    VocabParallelEmbedding,
    shard_embedding_lookup,
    vocab_parallel_lookup,
)

from lightning_bytescale.parallel.layout import (  # isort: skip  (after the runners it makes)
    Layout,
    LoaderView,
    MeshLayout,
    PipelineLayout,
    RunnerOptions,
    layout_class,
    make_runner,
)
from lightning_bytescale.parallel.zero import LaneZero, ShardedOptimizers, shard_optimizers  # isort: skip

__all__ = [
    "shard_optimizers",
    "make_runner",
    "layout_class",
    "ShardedOptimizers",
    "RunnerOptions",
    "PipelineRunner",
    "PipelineLayout",
    "MeshRunner",
    "MeshLayout",
    "LoaderView",
    "Layout",
    "LaneZero",
    "DATA_PARALLEL",
    "EmbeddingShardError",
    "FSDPSettingError",
    "FSDPStepDriver",
    "LaneDivergenceError",
    "DecoderStage",
    "LlamaStage",
    "LocalShards",
    "MESH_DIM_NAMES",
    "PIPELINE",
    "PIPELINE_MESH_DIM_NAMES",
    "ParallelDims",
    "ParallelDimsError",
    "ParallelMesh",
    "PipelineModelError",
    "PipelineStepBatch",
    "PipelineStepResult",
    "StageClock",
    "StageSchedules",
    "TENSOR_PARALLEL",
    "TensorParallelHeadsError",
    "VocabParallelEmbedding",
    "agree_across_lanes",
    "build_pipeline_step",
    "build_schedule",
    "check_heads",
    "clip_grad_norm_",
    "fsdp_units",
    "global_grad_norm",
    "llama_tp_plan",
    "pad_micro_batch",
    "padded_attention",
    "padding_micro_batch",
    "parallelize_llama",
    "run_parallel_step",
    "run_pipeline_step",
    "shard_embedding_lookup",
    "stage_bubble",
    "stage_layers",
    "start_step_check",
    "vocab_parallel_lookup",
]
