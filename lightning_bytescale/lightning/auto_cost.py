"""``ByteScaleStrategy(cost_model="auto")``: the cost model measured on the run's device at set-up.

The strategy takes ``"auto"`` in place of a cost model; :class:`PlannerConfig` cannot hold it
(nothing on the planner's floor can measure), so :func:`split_auto` keeps the strategy's config
on the paper preset until :func:`resolve_auto` replaces it, once, in ``setup``: after the model
is on its device and every rank holds rank 0's parameters, before the optimizers and before any
loader is built (the data module plans with the strategy's config, read when its loaders are
made).  The measurement (:func:`lightning_bytescale.profiler.auto.auto_cost_model`) is split over
the ranks and broadcast as float64, so every rank plans with the same model bit for bit, and it
is cached on disk; group rank 0 prints one line saying what was measured or read, and where the
cache is.  A measurement that fails raises :class:`~lightning_bytescale.profiler.ProfileError`
on every rank before the first step, naming the fix.

With tensor or pipeline parallelism a rank holds a shard or a stage, not the model a layer of
which the planner prices: ``"auto"`` is refused there before any rank starts, naming
``bytescale-profile --tensor-parallel``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_bytescale.errors import ConfigError
from lightning_bytescale.models.heads import config_heads
from lightning_bytescale.offload.blocks import find_blocks
from lightning_bytescale.parallel.layout import Layout
from lightning_bytescale.planner.config import PlannerConfig
from lightning_bytescale.planner.cost_spec import is_auto
from lightning_bytescale.profiler.errors import ProfileError


def split_auto(cost_model: Any) -> tuple[Any, bool]:
    """``(what PlannerConfig takes, whether "auto" was asked for)``: ``"auto"`` becomes ``None``
    (the paper preset) until :func:`resolve_auto` measures the model."""
    return (None, True) if is_auto(cost_model) else (cost_model, False)


def check_auto(layout: type[Layout], tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    """Refuse ``"auto"`` where a rank of the run's ``layout`` does not hold whole layers of the model."""
    if not layout.whole_layers:
        raise ConfigError(
            f"cost_model='auto' measures a whole layer on one device, but with tensor_parallel_size="
            f"{tensor_parallel_size} and pipeline_parallel_size={pipeline_parallel_size} a rank holds a shard or a "
            "stage: profile one HDP rank first (bytescale-profile --tensor-parallel N -o cost.json) and pass "
            "cost_model='cost.json', or cost_model='paper'"
        )


def measured_module(module: nn.Module) -> nn.Module:
    """What is measured: the LightningModule itself when it defines ``forward(input_ids,
    position_ids) -> logits`` (the engine's contract, as ``HFCausalLM`` and the recipes' module do),
    else the first module of its tree whose ``config`` names heads and that holds blocks."""
    if type(module).forward is not pl.LightningModule.forward:
        return module
    for m in module.modules():
        if m is not module and config_heads(getattr(m, "config", None)) is not None and find_blocks(m):
            return m
    raise ConfigError(
        f"cost_model='auto' cannot find the model to measure in {type(module).__name__}: define its forward("
        "input_ids, position_ids) -> logits, or hold a model whose config names its heads (the reference Llama, a "
        "Hugging Face model); or profile it (bytescale-profile -o cost.json) and pass cost_model='cost.json'"
    )


def resolve_auto(
    config: PlannerConfig, module: nn.Module, *, device: Any, precision: str | None, world_size: int
) -> PlannerConfig:
    """``config`` with the cost model measured (or read back) for ``module`` on ``device``; call
    it on every rank.  Links are measured between the ranks when there are several (configured
    ones win: give them with a cost-model file)."""
    from lightning_bytescale.profiler.auto import auto_cost_model

    try:
        got = auto_cost_model(
            measured_module(module),
            device=device,
            precision=precision,
            capacity=config.capacity,
            ranks_per_node=config.ranks_per_node,
            measure_links=world_size > 1,
        )
    except ProfileError as err:
        raise ProfileError(
            f"{err}. Fix the cause, or start without measuring: cost_model='paper' (the default) or a "
            "bytescale-profile file"
        ) from err
    rank_zero_info(got.line)
    return config.replace(cost_model=got.cost_model)


__all__ = ["check_auto", "measured_module", "resolve_auto", "split_auto"]
