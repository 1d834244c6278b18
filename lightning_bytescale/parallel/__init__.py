"""Parallel layouts on the torch floor: the (data_parallel, tensor_parallel) mesh, TP models, FSDP2, the step.

An HDP rank is a tensor-parallel group (:mod:`.dims`); rings run lane by lane on the global
group; :func:`parallelize_llama` shards the reference Llama with DTensor's parallel styles;
:class:`FSDPStepDriver` keeps FSDP2's collectives to one per unit per step whatever a rank's
micro-batch count; :func:`run_parallel_step` is the HDP step on the mesh and
:func:`clip_grad_norm_` clips by the global norm over DTensor shards.
"""

from lightning_bytescale.parallel.clip import clip_grad_norm_, global_grad_norm
from lightning_bytescale.parallel.dims import (
    DATA_PARALLEL,
    MESH_DIM_NAMES,
    TENSOR_PARALLEL,
    ParallelDims,
    ParallelMesh,
    check_heads,
)
from lightning_bytescale.parallel.errors import (
    FSDPSettingError,
    LaneDivergenceError,
    ParallelDimsError,
    TensorParallelHeadsError,
)
from lightning_bytescale.parallel.fsdp import FSDPStepDriver, fsdp_units
from lightning_bytescale.parallel.shards import LocalShards
from lightning_bytescale.parallel.step import agree_across_lanes, run_parallel_step, start_step_check
from lightning_bytescale.parallel.tensor_parallel import llama_tp_plan, parallelize_llama

__all__ = [
    "DATA_PARALLEL",
    "FSDPSettingError",
    "FSDPStepDriver",
    "LaneDivergenceError",
    "LocalShards",
    "MESH_DIM_NAMES",
    "ParallelDims",
    "ParallelDimsError",
    "ParallelMesh",
    "TENSOR_PARALLEL",
    "TensorParallelHeadsError",
    "agree_across_lanes",
    "check_heads",
    "clip_grad_norm_",
    "fsdp_units",
    "global_grad_norm",
    "llama_tp_plan",
    "parallelize_llama",
    "run_parallel_step",
    "start_step_check",
]
