"""Fit the planner's cost model to a model on the device at hand: :func:`run_profile`.

Every plan is only as good as its cost model.  The profiler measures, at several sequence
lengths, on the current device:

* ``T(s)``: one transformer layer's forward+backward seconds (the layer runs alone on inputs
  captured from a real forward of the whole model, so whatever arguments it takes are real),
  and the share of it that is the forward (:mod:`.layers`);
* ``Act(s)``: the bytes one layer saves for backward, counted through
  ``saved_tensors_hooks`` (:class:`~lightning_bytescale.offload.offloader.ActivationOffloader`
  at ratio 0), plus the bytes saved outside the layers (embedding, head, loss);
* the host-link bandwidth in both directions (timed pinned copies on CUDA, a memcpy on CPU;
  :mod:`.links`);
* optionally (``p2p=True``) the point-to-point link bandwidth between two gloo processes on
  127.0.0.1: a timed ``batch_isend_irecv`` exchange in both directions at once, as a ring step
  moves K/V.  It becomes the cost model's ``bandwidth_intra``/``bandwidth_inter`` and, with K/V
  bytes per token per layer from the model shape, gives the cost model its communication term;

then fits ``T(s) = a s^2 + b s + g`` and ``Act(s) = c s + d`` by least squares
(:meth:`CostModel.fit`) and computes the token capacity ``C``: the most tokens one rank can hold
in a micro-batch within a device memory budget.  The result is a :class:`~.record.Profile`,
whose file holds the planner's :class:`CostModel` dict, the :class:`OffloadConfig` (layers and
bandwidths for Eq. 3) and ``C``.  The cost model records the model's attention heads where its
config names them (:func:`~lightning_bytescale.models.heads.config_heads`), so the planner may
run sequences as Ulysses or hybrid items where that is faster.

With ``tensor_parallel=N`` the unit measured is one HDP rank of ``N`` devices, the model sharded
over them (:mod:`.group`): the group's layer time, one lane's bytes and heads (``heads / N``,
``max(1, kv_heads / N)``), ``C`` per HDP rank.

The model contract is the engine's: ``model(input_ids [T], position_ids [T]) -> logits [T, V]``
inside :func:`~lightning_bytescale.packed_attention.attention_context`, with its transformer
blocks given as ``layers`` or found as the offloader finds them
(:func:`~lightning_bytescale.offload.blocks.find_blocks`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_bytescale.engine.comm_device import barrier
from lightning_bytescale.models.heads import config_heads, lane_heads
from lightning_bytescale.offload.blocks import find_blocks
from lightning_bytescale.planner.cost_model import CostModel, OffloadConfig
from lightning_bytescale.profiler import group
from lightning_bytescale.profiler.errors import ProfileError
from lightning_bytescale.profiler.layers import prepare_length, time_rounds
from lightning_bytescale.profiler.links import measure_bandwidth, measure_p2p_bandwidth
from lightning_bytescale.profiler.record import Profile


def _capacity(cost: CostModel, outside: tuple[float, float], available: float, round_to: int) -> int:
    """Largest ``s`` with ``L * Act(s) + Outside(s) <= available`` (rounded down to ``round_to``)."""
    slope = cost.num_layers * cost.c + outside[0]
    const = cost.num_layers * cost.d + outside[1]
    if slope <= 0:
        raise ProfileError("measured no activation bytes growing with length; cannot derive a capacity")
    s = math.floor((available - const) / slope)
    s -= s % max(1, round_to)
    if s < 2:
        raise ProfileError(
            f"the memory budget leaves room for {max(s, 0)} tokens per rank after {const / 2**30:.2f} GiB "
            "of fixed activations; raise --memory-budget or lower the static/reserve bytes"
        )
    return int(s)


def _fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = slope * x + const`` (both kept >= 0, as memory cannot be negative)."""
    slope, const = np.polyfit(np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64), 1)
    return max(0.0, float(slope)), max(0.0, float(const))


def model_from(model_or_factory: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    """``model_or_factory`` itself when it is a module, else what calling it returns (checked)."""
    if isinstance(model_or_factory, nn.Module):
        return model_or_factory
    if callable(model_or_factory):
        model = model_or_factory()
        if not isinstance(model, nn.Module):
            raise ProfileError(f"the model factory returned {type(model).__name__}, not an nn.Module")
        return model
    raise ProfileError(
        f"expected an nn.Module or a factory returning one, got {type(model_or_factory).__name__}"
    )


def run_profile(
    model: nn.Module | Callable[[], nn.Module],
    lengths: Sequence[int],
    device: torch.device | str | None = None,
    *,
    layers: Sequence[nn.Module] | None = None,
    dtype: torch.dtype | None = None,
    vocab: int | None = None,
    num_layers: int | None = None,
    param_count: int | None = None,
    memory_budget: int | None = None,
    state_bytes_per_param: float | None = None,
    reserve_bytes: int = 0,
    round_to: int = 1,
    kv_bytes_per_token_per_layer: float | None = None,
    warmup: int = 1,
    repeats: int = 3,
    bandwidth_probe_bytes: int = 64 * 2**20,
    time_model: bool = True,
    name: str | None = None,
    p2p: bool = False,
    p2p_bytes: int = 4 * 2**20,
    bandwidth_intra: float | None = None,
    bandwidth_inter: float | None = None,
    ranks_per_node: int | None = None,
    tensor_parallel: int = 1,
    parallelize: Callable[[nn.Module, Any], Any] | None = None,
    timeout_s: float = 600.0,
) -> Profile:
    """Measure and fit; see the module docstring.  Returns the full :class:`Profile`.

    ``num_layers`` / ``param_count``: the *real* model's, when a shallower copy is profiled
    (default: what ``model`` has).  ``memory_budget``: device bytes one rank may use; with it
    ``C`` is computed after ``static = param_count * state_bytes_per_param`` (default: 2 x the
    parameter dtype for weights and gradients + 8 for Adam's two fp32 states) and
    ``reserve_bytes``.  ``round_to``: round ``C`` down to a multiple of this.

    Communication: ``p2p=True`` measures the gloo link between two local processes
    (:func:`measure_p2p_bandwidth`, ``p2p_bytes`` per exchange) and uses it for both
    bandwidths unless ``bandwidth_intra`` / ``bandwidth_inter`` (bytes/s) are given; one host
    cannot measure an inter-node link.  ``ranks_per_node`` is stored for ring placement.
    Without a bandwidth the cost model has no communication term (the paper's model).

    ``tensor_parallel=N > 1`` profiles one HDP rank that is a tensor-parallel group
    (:mod:`.group`): ``N`` processes each shard the model on a 1-D mesh (``parallelize(model,
    tp_mesh)``, default :func:`~lightning_bytescale.parallel.parallelize_llama`) and measure;
    ``T`` is the group's time (the slowest rank's), ``Act`` and the bytes outside the layers one
    lane's (the most any rank saves), the K/V bytes one lane's heads, the static bytes one rank's
    shards (those of ``model``; with ``param_count`` given, the real model's: its blocks' shards
    times ``num_layers``, the rest as it is), and ``C`` the tokens of one HDP rank.  A process group of ``N``
    ranks that exists is used as it is (every rank returns the profile); otherwise the ``N``
    processes are started on this host (gloo on 127.0.0.1, forked; NCCL on CUDA, spawned, so
    ``model`` must pickle: pass a factory defined at the top level of a module, which each process
    then calls, rather than a large model; process-group timeout ``timeout_s``) and the profile is
    returned here.  The cost model records ``tensor_parallel``.
    """
    lengths = [int(s) for s in lengths]
    if len(lengths) < 3 or any(s < 2 for s in lengths) or len(set(lengths)) != len(lengths):
        raise ProfileError(
            f"need at least 3 distinct sequence lengths >= 2 to fit T(s) = a s^2 + b s + g, got {lengths}"
        )
    if warmup < 0 or repeats < 1:
        raise ProfileError(f"warmup must be >= 0 and repeats >= 1, got {warmup}, {repeats}")
    tp = group.check_tensor_parallel(tensor_parallel)
    device = (
        torch.device(device)
        if device is not None
        else (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError("device cuda requested but CUDA is not available; use --device cpu")
    notes: dict[str, Any] = {"profiled_layers": 0, "warmup": warmup, "repeats": repeats}
    if p2p:
        if tp > 1 and group.in_group():
            raise ProfileError(
                "p2p=True starts two processes of its own, which a rank of a process group cannot; give "
                "bandwidth_intra / bandwidth_inter instead, or profile without a process group (the profiler "
                "then starts the group's processes itself)"
            )
        link = measure_p2p_bandwidth(p2p_bytes, repeats=max(repeats, 3))
        notes["p2p"] = asdict(link)
        bandwidth_intra = link.bandwidth if bandwidth_intra is None else bandwidth_intra
        if bandwidth_inter is None:
            bandwidth_inter = link.bandwidth
            notes["p2p"]["inter_node"] = "not measurable on one host: the loopback value is used"
    options = dict(
        layers=layers, dtype=dtype, vocab=vocab, num_layers=num_layers, param_count=param_count,
        memory_budget=memory_budget, state_bytes_per_param=state_bytes_per_param,
        reserve_bytes=reserve_bytes, round_to=round_to,
        kv_bytes_per_token_per_layer=kv_bytes_per_token_per_layer, warmup=warmup, repeats=repeats,
        bandwidth_probe_bytes=bandwidth_probe_bytes, time_model=time_model, name=name,
        bandwidth_intra=bandwidth_intra, bandwidth_inter=bandwidth_inter, ranks_per_node=ranks_per_node,
        tensor_parallel=tp, parallelize=parallelize, notes=notes,
    )  # fmt: skip
    if tp > 1 and not group.in_group():
        data = group.run_in_group(
            _measure_to_json, tp, device.type, model, lengths, device, timeout_s=timeout_s, **options
        )
        return Profile.from_json_dict(data)
    return _measure(model, lengths, device, **options)


def _measure_to_json(*args: Any, **kwargs: Any) -> dict:
    """:func:`_measure` in a rank of a started group: the profile as its file's dict (it pickles)."""
    return _measure(*args, **kwargs).to_json_dict()


def _measure(
    model: nn.Module | Callable[[], nn.Module],
    lengths: list[int],
    device: torch.device,
    *,
    layers: Sequence[nn.Module] | None,
    dtype: torch.dtype | None,
    vocab: int | None,
    num_layers: int | None,
    param_count: int | None,
    memory_budget: int | None,
    state_bytes_per_param: float | None,
    reserve_bytes: int,
    round_to: int,
    kv_bytes_per_token_per_layer: float | None,
    warmup: int,
    repeats: int,
    bandwidth_probe_bytes: int,
    time_model: bool,
    name: str | None,
    bandwidth_intra: float | None,
    bandwidth_inter: float | None,
    ranks_per_node: int | None,
    tensor_parallel: int,
    parallelize: Callable[[nn.Module, Any], Any] | None,
    notes: dict[str, Any],
) -> Profile:
    """The measurements and the fit of :func:`run_profile`, on this device or as a rank of a TP group."""
    tp = tensor_parallel
    if tp > 1:
        device = group.group_device(device)
        mesh = group.tp_mesh(tp, device)
    net = model_from(model).to(device=device, dtype=dtype)
    if tp > 1:
        net = group.shard_model(net, mesh, parallelize)
    net.train()
    blocks = list(layers) if layers is not None else find_blocks(net)
    if not blocks:
        raise ProfileError(
            f"cannot find the transformer blocks of {type(net).__name__}: pass layers=[...] (the block "
            "list in forward order, e.g. model.layers), or give the model an offload_layers() method "
            "returning them"
        )
    config = getattr(net, "config", None)
    if vocab is None:
        vocab = getattr(config, "vocab", None) or getattr(config, "vocab_size", None)
        if vocab is None:
            raise ProfileError("cannot tell the vocabulary size; pass vocab=")
    param_dtype = next(net.parameters()).dtype
    # the group's figures: its slowest rank's time, its largest lane's bytes, its slowest host link
    most = (lambda v: group.group_reduce(v, "max")) if tp > 1 else list
    least = (lambda v: group.group_reduce(v, "min")) if tp > 1 else list
    together = barrier if tp > 1 else None
    runners = [prepare_length(net, blocks, s, int(vocab), device) for s in lengths]
    fwd = most(time_rounds(runners, "forward", device, warmup, repeats, together))
    t = most(time_rounds(runners, "forward_backward", device, warmup, repeats, together))
    fwd = [min(f, b) for f, b in zip(fwd, t)]
    whole = (
        most(time_rounds(runners, "model_step", device, min(warmup, 1), max(1, repeats // 2), together))
        if time_model
        else [None] * len(runners)
    )
    net.zero_grad(set_to_none=True)
    fwd_share = statistics.fmean(f / b for f, b in zip(fwd, t))
    acts = most([r.layer_bytes for r in runners])
    outside_acts = most([r.outside_bytes for r in runners])
    d2h, h2d = least(measure_bandwidth(device, bandwidth_probe_bytes))
    # the heads of one lane (what Ulysses splits over an item's members), when the config names them
    heads = config_heads(config)
    lane = lane_heads(*heads, tp) if heads is not None else None
    if kv_bytes_per_token_per_layer is None:
        kv = getattr(config, "kv_heads", None)
        hd = getattr(config, "head_dim", None)
        elem = torch.tensor([], dtype=param_dtype).element_size()
        # a lane's ring moves its own key/value heads
        kv_bytes_per_token_per_layer = float(2 * (kv // tp) * hd * elem) if kv and hd else 0.0
    n_layers = int(num_layers) if num_layers is not None else len(blocks)
    notes = {**notes, "profiled_layers": len(blocks)}
    cost = CostModel.fit(
        lengths,
        t,
        act_lengths=lengths,
        act_bytes=acts,
        num_layers=n_layers,
        kv_bytes_per_token_per_layer=kv_bytes_per_token_per_layer,
        forward_fraction=min(1.0, max(1e-6, fwd_share)),
        bandwidth_intra=bandwidth_intra,
        bandwidth_inter=bandwidth_inter,
        ranks_per_node=ranks_per_node,
        name=name or f"profiled-{type(net).__name__}-{device.type}" + (f"-tp{tp}" if tp > 1 else ""),
        tensor_parallel=tp,
        attention_heads=None if lane is None else lane[0],
        kv_heads=None if lane is None else lane[1],
    )
    if tp > 1:
        whole_params = sum(p.numel() for p in net.parameters())  # a DTensor's numel is its global size
        params = int(param_count) if param_count is not None else whole_params
        shards = group.local_numel(net)
        if param_count is not None:  # the real model: the blocks' shards times its layers, the rest as is
            blocks_shards = sum(group.local_numel(b) for b in blocks)
            shards = shards - blocks_shards + n_layers * blocks_shards / len(blocks)
        rank_params = int(most([shards])[0])
        notes["params_per_rank"] = rank_params
    else:
        params = int(param_count) if param_count is not None else sum(p.numel() for p in net.parameters())
        rank_params = params
    if state_bytes_per_param is None:
        state_bytes_per_param = 2 * torch.tensor([], dtype=param_dtype).element_size() + 8
    static = int(rank_params * state_bytes_per_param)
    capacity = None
    if memory_budget is not None:
        outside = _fit_line(lengths, outside_acts)
        capacity = _capacity(cost, outside, memory_budget - static - reserve_bytes, round_to)
    offload = OffloadConfig(layers_per_rank=n_layers, bandwidth_d2h=d2h, bandwidth_h2d=h2d)
    return Profile(
        cost_model=cost,
        offload=offload,
        capacity=capacity,
        device=str(device),
        dtype=str(param_dtype).replace("torch.", ""),
        lengths=lengths,
        layer_seconds=t,
        layer_forward_seconds=fwd,
        act_bytes=acts,
        outside_act_bytes=outside_acts,
        model_seconds=whole,
        time_residuals=[m - cost.layer_time(s) for m, s in zip(t, lengths)],
        act_residuals=[m - cost.act_bytes(s) for m, s in zip(acts, lengths)],
        memory_budget_bytes=memory_budget,
        static_bytes=static,
        param_count=params,
        notes=notes,
    )


def profile_model(
    model: nn.Module | Callable[[], nn.Module],
    lengths: Sequence[int],
    device: torch.device | str | None = None,
    **kwargs: Any,
) -> CostModel:
    """The fitted :class:`CostModel` of ``model`` (see :func:`run_profile` for the options)."""
    return run_profile(model, lengths, device, **kwargs).cost_model
