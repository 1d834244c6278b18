"""Tensor parallelism for Hugging Face decoders, with transformers' own plan applied to a built model.

transformers 5 ships a tensor-parallel plan with every Llama/Qwen-family model
(``config.base_model_tp_plan``, merged into ``model.tp_plan``: q/k/v and gate/up projections
``"colwise"``, o and down projections ``"rowwise"``, the embedding ``"embedding_rowwise"``, the
head ``"colwise_gather_output"``) and applies it with
``transformers.distributed.tensor_parallel.apply_tensor_parallelism(model, tp_mesh, plan)``.
That function also works on a model that is already built with its weights, the same on every
rank (each rank keeps its own slice, no communication), so :func:`parallelize_hf` uses it
as it is: ``configure_model`` builds or loads the model, the strategy broadcasts rank 0's
weights, then the plan shards it over ``device_mesh["tensor_parallel"]``.  The attention
layers reshape by ``-1`` heads, so ``attn_implementation="bytescale"`` receives this rank's
heads and rings exchange only those.

One style of the library's plan is replaced: ``"replicated_with_grad_allreduce"`` (Qwen3's
per-head ``q_norm`` / ``k_norm``, whose gradient each lane computes from its own heads only)
all-reduces ``param.grad`` in a post-accumulate hook, i.e. the *accumulated* gradient after
every backward: with two micro-batches on a rank the first one's contribution is summed over
the lanes twice.  Here such a module's parameters enter its forward through an identity whose
backward sums that backward's gradient over the lanes before autograd accumulates it, which
is right for any number of micro-batches.

Two styles run differently, so that the communication is Megatron's.  The attention's and the
MLP's input enters as one replicated DTensor (a pre-hook on every module that holds two or more
``"colwise"`` projections, for its first argument, positional or by name): transformers'
``"colwise"`` style takes a DTensor as it is, so the projections' input gradients add up as
partial DTensors and are all-reduced once per module instead of once per projection (2 backward
all-reduces per Llama block instead of 5).  And ``"embedding_rowwise"`` modules keep
transformers' ``Shard(0)`` weight but look up through
:func:`~lightning_bytescale.parallel.vocab_embedding.shard_embedding_lookup`, whose weight
gradient is this lane's rows only (DTensor's lookup builds the whole ``[V, dim]`` gradient on
every lane first).

Styles that have not been checked against the single-process model here (sequence
parallelism, which would split a packed micro-batch's tokens over the lanes, fused and MoE
styles) are refused, naming them.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from lightning_bytescale.errors import ConfigError
from lightning_bytescale.parallel.dims import check_heads
from lightning_bytescale.parallel.vocab_embedding import shard_embedding_lookup

REPLICATED_GRAD_STYLE = "replicated_with_grad_allreduce"
VOCAB_STYLE = "embedding_rowwise"
# The library's styles checked here against one process (float64, gloo); others are refused.
SUPPORTED_STYLES = ("colwise", "rowwise", "embedding_rowwise", "colwise_gather_output", REPLICATED_GRAD_STYLE)


class _SumOverLanes(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the TP group (each lane saw its own heads)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _sum_grads_per_backward(module: nn.Module, group: Any) -> None:
    """Make ``module``'s own parameters' gradients sums over ``group``, one backward at a time."""
    original: Callable[..., Any] = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        own = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
        for name, p in own.items():
            module._parameters[name] = _SumOverLanes.apply(p, group)  # type: ignore[assignment]
        try:
            return original(*args, **kwargs)
        finally:
            module._parameters.update(own)

    module.forward = forward  # type: ignore[method-assign]


def _shared_input_modules(plan: dict[str, str], modules: dict[str, nn.Module]) -> list[nn.Module]:
    """The modules holding two or more ``"colwise"`` projections of ``plan`` (attention, MLP): they read one input."""
    projections: dict[str, int] = defaultdict(int)
    for name, style in plan.items():
        if style == "colwise" and name in modules:
            projections[name.rpartition(".")[0]] += 1
    return [modules[name] for name, count in projections.items() if count >= 2 and name in modules]


def _replicate_first_input(module: nn.Module, tp_mesh: Any) -> None:
    """``module``'s first argument (positional, or by its name) enters as a replicated DTensor."""
    first = next(iter(inspect.signature(module.forward).parameters), None)

    def replicated(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)
        return x

    def hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (replicated(args[0]), *args[1:]), kwargs
        if first in kwargs:
            return args, {**kwargs, first: replicated(kwargs[first])}
        return args, kwargs

    module.register_forward_pre_hook(hook, with_kwargs=True)


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's own plan, one entry per module and parameter (transformers expands the ``*``)."""
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        raise ConfigError(
            f"{type(model).__name__} has no tensor-parallel plan (its config has no base_model_tp_plan); "
            "train it with tensor_parallel_size=1"
        )
    expand = getattr(model, "_expand_parallel_plan", None)  # transformers private (5.x): '*' -> layer numbers
    if not callable(expand):
        raise ConfigError(
            "this transformers release cannot expand a model's tensor-parallel plan "
            "(PreTrainedModel._expand_parallel_plan is missing); use transformers 5.24 or check "
            "lightning_bytescale.hf.tensor_parallel against it"
        )
    unsupported = sorted({s for s in plan.values() if s not in SUPPORTED_STYLES})
    if unsupported:
        raise ConfigError(
            f"the tensor-parallel plan of {type(model).__name__} uses the styles {unsupported}, which this "
            f"strategy has not been checked with (checked: {list(SUPPORTED_STYLES)}); train it with "
            "tensor_parallel_size=1"
        )
    return dict(expand(plan))


def parallelize_hf(model: nn.Module, tp_mesh: Any) -> nn.Module:
    """Shard a built Hugging Face causal LM over the 1-D ``tp_mesh`` with its own plan, in place; returns it.

    Every rank must hold the same weights first (the strategy broadcasts rank 0's).  Heads and
    key/value heads must divide by the TP size
    (:class:`~lightning_bytescale.parallel.errors.TensorParallelHeadsError` otherwise).
    """
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    if getattr(tp_mesh, "ndim", None) != 1:
        raise ConfigError(
            f'parallelize_hf takes the 1-D tensor-parallel mesh (device_mesh["tensor_parallel"]), got {tp_mesh!r}'
        )
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    tp = tp_mesh.size()
    check_heads(heads, kv_heads, tp, model=type(model).__name__)
    if tp == 1:
        return model
    plan = hf_tp_plan(model)
    replicated = [name for name, style in plan.items() if style == REPLICATED_GRAD_STYLE]
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    # a tied weight's second name (lm_head.weight) is no parameter of its own: it is tied again below
    library = {n: s for n, s in plan.items() if s != REPLICATED_GRAD_STYLE and (n in params or n in modules)}
    # the weight is sharded by the library (Shard(0)); the module's lookup is replaced below
    lookups = [name for name, style in library.items() if style == VOCAB_STYLE and name in modules]
    apply_tensor_parallelism(model, tp_mesh, {n: s for n, s in library.items() if n not in lookups})
    for name in lookups:
        shard_embedding_lookup(modules[name])  # type: ignore[arg-type]
    for module in _shared_input_modules(library, modules):
        _replicate_first_input(module, tp_mesh)
    for name in replicated:
        if name in modules:  # the plan names both the module (hooked) and its weight (left replicated)
            _sum_grads_per_backward(modules[name], tp_mesh.get_group())
    tied_in, tied_out = model.get_input_embeddings(), model.get_output_embeddings()
    if getattr(config, "tie_word_embeddings", False) and tied_in is not None and tied_out is not None:
        tied_out.weight = (
            tied_in.weight
        )  # sharding made two parameters of one; both are Shard(0) on the vocabulary
    return model


__all__ = ["REPLICATED_GRAD_STYLE", "SUPPORTED_STYLES", "hf_tp_plan", "parallelize_hf"]
