"""Consolidated checkpoints of DTensor state: the model and optimizer state whole, and back as each rank's shards.

With tensor parallelism (and FSDP2) the model and AdamW state are DTensors.  A consolidated
checkpoint holds them whole: torch.distributed.checkpoint.state_dict gathers them one tensor at a
time (collectives on the mesh), global rank 0 keeps each on its host and every other rank drops it
at once (its state dicts are empty; rank 0 writes the file), as Lightning's ModelParallelStrategy
saves.  On load it gives each rank its own shards of the whole tensors, so a checkpoint resumes on
any mesh, any data-parallel size included.  The strategy's consolidated checkpoints on the mesh use these (:mod:`lightning_bytescale.lightning.checkpoint`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_bytescale.parallel.zero import lane_zero_of


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every DTensor gathered whole (a collective: call on every rank)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}


def _full_options(strict: bool = True, *, saving: bool = False) -> Any:
    """Whole tensors; for a save (``saving``) on rank 0's host only, one tensor on the device at a time."""
    return StateDictOptions(full_state_dict=True, cpu_offload=saving, strict=strict)


def model_state(module: nn.Module) -> dict[str, Any]:
    """The module's state with every DTensor whole, on global rank 0's host; empty on the other ranks (call on every rank)."""
    return get_model_state_dict(module, options=_full_options(saving=True))


def optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's state by parameter name, every DTensor whole, on global rank 0's host; empty on the others (call on every rank)."""
    zero = lane_zero_of(optimizer)
    if zero is None:
        return get_optimizer_state_dict(module, optimizer, options=_full_options(saving=True))
    with zero.materialized():  # ZeRO-1: every rank of a lane holds the whole state while it is gathered
        return get_optimizer_state_dict(module, optimizer, options=_full_options(saving=True))


def load_model_state(module: nn.Module, state: dict[str, Any], strict: bool) -> None:
    """Whole tensors into the module: each rank keeps its shards."""
    set_model_state_dict(module, state, options=_full_options(strict))


def keyed_by_name(module: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """PyTorch's indexed optimizer state (the one file of a run without TP, an exported sharded folder) keyed
    by parameter name, as torch's full optimizer state dict is; a state keyed by name as it is.

    Index ``i`` is the ``i``-th parameter of ``optimizer``'s groups, the order ``optimizer.state_dict()`` numbers them in.
    """
    indices = [*state["state"], *(i for g in state["param_groups"] for i in g["params"])]
    if not all(isinstance(i, int) for i in indices):
        return state
    names = {id(p): n for n, p in module.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    return {
        "state": {order[i]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def load_optimizer_states(
    module: nn.Module, optimizers: list[Optimizer], states: list[dict[str, Any]]
) -> None:
    """Whole tensors (keyed by name or, as PyTorch saves them, by index) into the optimizers: each rank keeps its shards."""
    for optimizer, state in zip(optimizers, states):
        state = keyed_by_name(module, optimizer, state)
        zero = lane_zero_of(getattr(optimizer, "_optimizer", optimizer))
        if zero is None:
            set_optimizer_state_dict(module, optimizer, state, options=_full_options())
            continue
        # ZeRO-1: torch sets up an empty state with a zero-learning-rate step of every parameter, so
        # the whole state is loaded first; then each rank keeps its own parameters' state only
        zero.split = False
        try:
            set_optimizer_state_dict(module, optimizer, state, options=_full_options())
        finally:
            zero.split = True
        zero.drop_unowned()


__all__ = [
    "full_state_dict",
    "keyed_by_name",
    "load_model_state",
    "load_optimizer_states",
    "model_state",
    "optimizer_state",
]
