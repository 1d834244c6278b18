"""Fit the planner's cost model to the user's model on the device at hand (``bytescale-profile``).

Every plan is only as good as its cost model.  The profiler measures, at several sequence
lengths, on the current device:

* ``T(s)``: one transformer layer's forward+backward seconds (the layer runs alone on inputs
  captured from a real forward of the whole model, so whatever arguments it takes are real),
  and the share of it that is the forward;
* ``Act(s)``: the bytes one layer saves for backward, counted through
  ``saved_tensors_hooks`` (:class:`~lightning_bytescale.offload.offloader.ActivationOffloader` at ratio
  0), plus the bytes saved outside the layers (embedding, head, loss);
* the host-link bandwidth in both directions (timed pinned copies on CUDA, a memcpy on CPU);
* optionally (``p2p=True``, ``--p2p``) the point-to-point link bandwidth between two gloo
  processes on 127.0.0.1: a timed ``batch_isend_irecv`` exchange in both directions at once,
  as a ring step moves K/V.  It becomes the cost model's ``bandwidth_intra``/``bandwidth_inter``
  and, with K/V bytes per token per layer from the model shape, gives the cost model its
  communication term;

then fits ``T(s) = a s^2 + b s + g`` and ``Act(s) = c s + d`` by least squares
(:meth:`CostModel.fit`), prints the residuals, and computes the token capacity ``C``: the most
tokens one rank can hold in a micro-batch within a device memory budget.  The result is a JSON
file (:class:`Profile`) holding the planner's :class:`CostModel` dict, the
:class:`OffloadConfig` (layers and bandwidths for Eq. 3) and ``C``;
:func:`load_profile` reads it; :func:`~lightning_bytescale.planner.cost_model.load_cost_model` (the planner
floor, so the strategy and the data module need not import this module) reads its cost model
(and plain cost-model dicts).

The model contract is the engine's: ``model(input_ids [T], position_ids [T]) -> logits [T, V]``
inside :func:`~lightning_bytescale.packed_attention.attention_context`, with its transformer blocks
given as ``layers`` (found automatically as ``model.blocks`` / ``model.layers``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import multiprocessing
import queue
import re
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lightning_bytescale.errors import ByteScaleError
from lightning_bytescale.offload.offloader import OUTSIDE, ActivationOffloader
from lightning_bytescale.packed_attention.layout import AttentionLayout
from lightning_bytescale.planner.cost_model import (
    PROFILE_FORMAT,
    CostModel,
    OffloadConfig,
    load_cost_model,  # noqa: F401  (re-exported: it lives in the planner floor now)
)

FORMAT = PROFILE_FORMAT


class ProfileError(ByteScaleError, ValueError):
    """The profiler cannot run as asked (bad lengths, no layers found, budget too small...)."""


@dataclass
class Profile:
    """Everything one profiler run measured and fitted; ``to_json_dict`` is the cost-model file."""

    cost_model: CostModel
    offload: OffloadConfig
    capacity: int | None  # C; None without a memory budget
    device: str
    dtype: str
    lengths: list[int]
    layer_seconds: list[float]  # T(s) measured: one layer forward+backward
    layer_forward_seconds: list[float]
    act_bytes: list[float]  # Act(s) measured: one layer's saved bytes
    outside_act_bytes: list[float]  # saved outside the layers (embedding, head, loss)
    model_seconds: list[float | None]  # the whole model forward+backward (reference; None: not timed)
    time_residuals: list[float]  # measured - fitted seconds
    act_residuals: list[float]  # measured - fitted bytes
    memory_budget_bytes: int | None = None
    static_bytes: int = 0  # parameters, gradients and optimizer states (not activations)
    param_count: int = 0
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def relative_time_residuals(self) -> list[float]:
        return [r / m if m else 0.0 for r, m in zip(self.time_residuals, self.layer_seconds)]

    @property
    def relative_act_residuals(self) -> list[float]:
        return [r / m if m else 0.0 for r, m in zip(self.act_residuals, self.act_bytes)]

    def to_json_dict(self) -> dict:
        d = asdict(self)
        d["cost_model"] = self.cost_model.to_json_dict()
        d["offload"] = self.offload.to_json_dict()
        return {"format": FORMAT, **d}

    @classmethod
    def from_json_dict(cls, data: dict) -> Profile:
        if data.get("format") != FORMAT:
            raise ProfileError(f"not a {FORMAT} file (format={data.get('format')!r})")
        d = {k: v for k, v in data.items() if k != "format"}
        d["cost_model"] = CostModel.from_json_dict(d["cost_model"])
        d["offload"] = OffloadConfig.from_json_dict(d["offload"])
        return cls(**d)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json_dict(), indent=2) + "\n")
        return path

    def _comm_line(self) -> str:
        cm = self.cost_model
        if not cm.models_comm:
            return "ring links: not modelled (no bandwidth or no K/V bytes; the paper's compute-only model)"
        bw = [f"{v / 1e9:.3f} GB/s" if v else "-" for v in (cm.bandwidth_intra, cm.bandwidth_inter)]
        line = (
            f"ring links: intra {bw[0]}, inter {bw[1]}, K/V {cm.kv_bytes_per_token_per_layer:.0f} B/token/layer, "
            f"crossover (ring of 4) {cm.crossover_length(4) / 4:.0f} tokens a rank"
        )
        link = self.notes.get("p2p")
        if link:
            line += f" [gloo P2P measured: {link['nbytes'] / 2**20:.1f} MiB exchange, latency {link['latency_s'] * 1e6:.0f} us]"
        return line

    def summary(self) -> str:
        cm = self.cost_model
        lines = [
            f"device {self.device} ({self.dtype}), {cm.num_layers} layers, {self.param_count:,} parameters",
            f"T(s)   = {cm.a:.4e} s^2 + {cm.b:.4e} s + {cm.g:.4e}   [seconds per layer, fwd+bwd; "
            f"forward share {cm.forward_fraction:.2f}]",
            f"Act(s) = {cm.c:.1f} s + {cm.d:.1f}   [bytes saved per layer]",
            f"host link: d2h {self.offload.bandwidth_d2h / 1e9:.2f} GB/s, h2d {self.offload.bandwidth_h2d / 1e9:.2f} GB/s",
            self._comm_line(),
            f"{'s':>8} {'T meas':>11} {'T fit':>11} {'resid':>8} {'Act meas':>12} {'Act fit':>12} {'resid':>8}",
        ]
        for i, s in enumerate(self.lengths):
            t, a = self.layer_seconds[i], self.act_bytes[i]
            lines.append(
                f"{s:>8} {t:>11.4e} {cm.layer_time(s):>11.4e} {self.relative_time_residuals[i]:>+8.1%} "
                f"{a:>12.0f} {cm.act_bytes(s):>12.0f} {self.relative_act_residuals[i]:>+8.1%}"
            )
        if self.capacity is not None:
            lines.append(
                f"capacity C = {self.capacity} tokens per rank (budget {self.memory_budget_bytes / 2**30:.2f} GiB, "
                f"static {self.static_bytes / 2**30:.2f} GiB)"
            )
        return "\n".join(lines)


# ---------------------------------------------------------------------- loading
def load_profile(path: str | Path) -> Profile:
    """Read a profiler file written by :meth:`Profile.save`."""
    return Profile.from_json_dict(json.loads(Path(path).read_text()))


# ---------------------------------------------------------------------- measurements
def find_layers(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks: ``model.blocks`` or ``model.layers`` (also under ``.model``)."""
    for owner in (model, getattr(model, "model", None)):
        if owner is None:
            continue
        for name in ("blocks", "layers", "h"):
            found = getattr(owner, name, None)
            if isinstance(found, (nn.ModuleList, nn.Sequential)) and len(found) > 0:
                return list(found)
    raise ProfileError(
        f"cannot find the transformer blocks of {type(model).__name__}: pass layers=[...] "
        "(the block list in forward order, e.g. model.layers)"
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    """Fastest of ``repeats`` runs after ``warmup`` (the minimum is the least noisy on shared machines)."""
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(
    device: torch.device | str, nbytes: int = 64 * 2**20, repeats: int = 5
) -> tuple[float, float]:
    """``(device->host, host->device)`` bytes/s: pinned async copies on CUDA, a memcpy on CPU."""
    device = torch.device(device)
    if nbytes <= 0:
        raise ProfileError(f"bandwidth probe size must be > 0 bytes, got {nbytes}")
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        d2h = _timed(lambda: host.copy_(dev, non_blocking=True), device, 1, repeats)
        h2d = _timed(lambda: dev.copy_(host, non_blocking=True), device, 1, repeats)
        return nbytes / d2h, nbytes / h2d
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src), device, 1, repeats)
    return nbytes / t, nbytes / t


@dataclass(frozen=True)
class P2PBandwidth:
    """A measured point-to-point link: bytes/s per rank and direction, and one exchange's latency."""

    bandwidth: float  # bytes/s, each rank sending and receiving ``nbytes`` at once
    latency_s: float  # seconds for a one-element exchange (the fixed cost of one ring step)
    nbytes: int
    backend: str = "gloo"
    host: str = "127.0.0.1"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _p2p_worker(rank: int, port: int, nbytes: int, repeats: int, timeout_s: float, out: Any) -> None:
    """One side of the exchange: both ranks send ``nbytes`` to and receive from the other at once."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        peer = 1 - rank

        def best_of(n: int, reps: int) -> float:
            send = torch.ones(n, dtype=torch.uint8)
            recv = torch.empty_like(send)
            best = math.inf
            for i in range(reps + 1):  # the first exchange warms the connection up
                dist.barrier()
                start = time.perf_counter()
                ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
                took = time.perf_counter() - start
                if i > 0:
                    best = min(best, took)
            return best

        latency = best_of(1, max(repeats, 5))
        took = best_of(nbytes, repeats)
        if rank == 0:
            out.put(("ok", took, latency))
        dist.destroy_process_group()
    except Exception as err:  # report, never hang the parent
        out.put(("error", f"rank {rank}: {type(err).__name__}: {err}", 0.0))


def measure_p2p_bandwidth(nbytes: int = 4 * 2**20, repeats: int = 5, timeout_s: float = 60.0) -> P2PBandwidth:
    """Point-to-point bandwidth between two gloo processes on 127.0.0.1 (a few seconds).

    Both processes post a ``batch_isend_irecv`` of one send of ``nbytes`` to the other and one
    receive from it (the pattern of a ring step); the fastest of ``repeats`` exchanges gives
    ``nbytes / seconds``, bytes/s per rank and direction, as the cost model counts it.  The
    latency is the same exchange with one byte.  Forked processes where that is safe (no CUDA
    initialised), spawned ones otherwise.
    """
    if nbytes < 1 or repeats < 1:
        raise ProfileError(f"P2P probe needs nbytes >= 1 and repeats >= 1, got {nbytes}, {repeats}")
    methods = multiprocessing.get_all_start_methods()
    fork = "fork" in methods and not (torch.cuda.is_available() and torch.cuda.is_initialized())
    ctx = multiprocessing.get_context("fork" if fork else "spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_p2p_worker, args=(r, port, nbytes, repeats, timeout_s, out), daemon=True)
        for r in range(2)
    ]
    for proc in procs:
        proc.start()
    try:
        status, took, latency = out.get(timeout=timeout_s + 30)
    except queue.Empty:
        status, took, latency = "error", f"no result within {timeout_s + 30:.0f} s", 0.0
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if status != "ok":
        raise ProfileError(
            f"the gloo P2P bandwidth probe on 127.0.0.1 failed ({took}); run without --p2p and give "
            "--bandwidth-intra/--bandwidth-inter instead"
        )
    return P2PBandwidth(bandwidth=nbytes / took, latency_s=latency, nbytes=nbytes)


def _layout(s: int) -> AttentionLayout:
    return AttentionLayout(cu_seqlens=(0, s), seq_lens=(s,))


def _model_loss(model: nn.Module, ids: torch.Tensor, pos: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(ids, pos)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _detach_args(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[torch.Tensor]]:
    grads_for: list[torch.Tensor] = []

    def fix(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            y = x.detach()
            if x.requires_grad and x.is_floating_point():
                y.requires_grad_(True)
                grads_for.append(y)
            return y
        return x

    return tuple(fix(a) for a in args), {k: fix(v) for k, v in kwargs.items()}, grads_for


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise ProfileError(
        f"a layer returned {type(out).__name__}; expected a tensor (or a tuple starting with one)"
    )


@dataclass
class _Runner:
    """One sequence length, ready to time: the layer alone (forward, forward+backward) and the model."""

    length: int
    layout: AttentionLayout
    forward: Callable[[], None]
    forward_backward: Callable[[], None]
    model_step: Callable[[], None]
    layer_bytes: float
    outside_bytes: float


def _prepare_length(
    model: nn.Module, layers: list[nn.Module], s: int, vocab: int, device: torch.device
) -> _Runner:
    from lightning_bytescale.packed_attention import attention_context

    gen = torch.Generator().manual_seed(s)
    ids = torch.randint(0, vocab, (s,), generator=gen).to(device)
    labels = torch.randint(0, vocab, (s,), generator=gen).to(device)
    pos = torch.arange(s, device=device)
    layout = _layout(s)
    captured: dict[str, Any] = {}

    def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if "args" not in captured:
            captured["args"], captured["kwargs"] = args, kwargs

    handle = layers[0].register_forward_pre_hook(capture, with_kwargs=True)
    counter = ActivationOffloader(layers, min_bytes=0)
    try:
        with attention_context(layout), counter.context(0, 0.0) as stats:
            _model_loss(model, ids, pos, labels)
    finally:
        handle.remove()
        counter.remove()
    if "args" not in captured:
        raise ProfileError("the first layer never ran in the model's forward; check the layers you passed")
    per_layer = [b for layer, b in stats.layer_bytes.items() if layer != OUTSIDE]
    args, kwargs, leaves = _detach_args(captured["args"], captured["kwargs"])
    layer = layers[0]
    params = [p for p in layer.parameters() if p.requires_grad]
    with attention_context(layout), torch.no_grad():
        gout = torch.randn_like(_first_tensor(layer(*args, **kwargs)))

    def forward() -> None:
        _first_tensor(layer(*args, **kwargs))

    def forward_backward() -> None:
        out = _first_tensor(layer(*args, **kwargs))
        torch.autograd.backward(out, gout, inputs=leaves + params)

    def model_step() -> None:
        _model_loss(model, ids, pos, labels).backward()

    return _Runner(
        s,
        layout,
        forward,
        forward_backward,
        model_step,
        statistics.fmean(per_layer) if per_layer else 0.0,
        float(stats.layer_bytes.get(OUTSIDE, 0)),
    )


def _time_rounds(
    runners: list[_Runner], what: str, device: torch.device, warmup: int, repeats: int
) -> list[float]:
    """Fastest of ``repeats`` runs per length, the lengths interleaved round by round so that a burst
    of load on a shared machine spreads over all lengths instead of bending one point."""
    from lightning_bytescale.packed_attention import attention_context

    best = [math.inf] * len(runners)
    for rnd in range(warmup + repeats):
        for i, r in enumerate(runners):
            fn = getattr(r, what)
            with attention_context(r.layout):
                _sync(device)
                start = time.perf_counter()
                fn()
                _sync(device)
                took = time.perf_counter() - start
            if rnd >= warmup:
                best[i] = min(best[i], took)
    return best


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


def _model_from(model_or_factory: nn.Module | Callable[[], nn.Module]) -> nn.Module:
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
    """
    lengths = [int(s) for s in lengths]
    if len(lengths) < 3 or any(s < 2 for s in lengths) or len(set(lengths)) != len(lengths):
        raise ProfileError(
            f"need at least 3 distinct sequence lengths >= 2 to fit T(s) = a s^2 + b s + g, got {lengths}"
        )
    if warmup < 0 or repeats < 1:
        raise ProfileError(f"warmup must be >= 0 and repeats >= 1, got {warmup}, {repeats}")
    device = (
        torch.device(device)
        if device is not None
        else (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError("device cuda requested but CUDA is not available; use --device cpu")
    net = _model_from(model).to(device=device, dtype=dtype)
    net.train()
    blocks = list(layers) if layers is not None else find_layers(net)
    config = getattr(net, "config", None)
    if vocab is None:
        vocab = getattr(config, "vocab", None) or getattr(config, "vocab_size", None)
        if vocab is None:
            raise ProfileError("cannot tell the vocabulary size; pass vocab=")
    param_dtype = next(net.parameters()).dtype
    runners = [_prepare_length(net, blocks, s, int(vocab), device) for s in lengths]
    fwd = _time_rounds(runners, "forward", device, warmup, repeats)
    t = _time_rounds(runners, "forward_backward", device, warmup, repeats)
    fwd = [min(f, b) for f, b in zip(fwd, t)]
    whole = (
        _time_rounds(runners, "model_step", device, min(warmup, 1), max(1, repeats // 2))
        if time_model
        else [None] * len(runners)
    )
    net.zero_grad(set_to_none=True)
    fwd_share = statistics.fmean(f / b for f, b in zip(fwd, t))
    acts = [r.layer_bytes for r in runners]
    d2h, h2d = measure_bandwidth(device, bandwidth_probe_bytes)
    if kv_bytes_per_token_per_layer is None:
        kv = getattr(config, "kv_heads", None)
        hd = getattr(config, "head_dim", None)
        elem = torch.tensor([], dtype=param_dtype).element_size()
        kv_bytes_per_token_per_layer = float(2 * kv * hd * elem) if kv and hd else 0.0
    n_layers = int(num_layers) if num_layers is not None else len(blocks)
    notes: dict[str, Any] = {"profiled_layers": len(blocks), "warmup": warmup, "repeats": repeats}
    if p2p:
        link = measure_p2p_bandwidth(p2p_bytes, repeats=max(repeats, 3))
        notes["p2p"] = asdict(link)
        bandwidth_intra = link.bandwidth if bandwidth_intra is None else bandwidth_intra
        if bandwidth_inter is None:
            bandwidth_inter = link.bandwidth
            notes["p2p"]["inter_node"] = "not measurable on one host: the loopback value is used"
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
        name=name or f"profiled-{type(net).__name__}-{device.type}",
    )
    params = int(param_count) if param_count is not None else sum(p.numel() for p in net.parameters())
    if state_bytes_per_param is None:
        state_bytes_per_param = 2 * torch.tensor([], dtype=param_dtype).element_size() + 8
    static = int(params * state_bytes_per_param)
    capacity = None
    if memory_budget is not None:
        outside = _fit_line(lengths, [r.outside_bytes for r in runners])
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
        outside_act_bytes=[r.outside_bytes for r in runners],
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


# ---------------------------------------------------------------------- command line
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"80e9"``, ``"512 MB"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 80GiB, 512MB, 8e9)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _parse_lengths(text: str) -> list[int]:
    try:
        return [int(x) for x in re.split(r"[,\s]+", text.strip()) if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"lengths must be integers separated by commas, got {text!r}"
        ) from None


def _build_model(spec: str, profile_layers: int | None) -> tuple[nn.Module, int | None, int | None]:
    """``spec`` is a Llama preset name or ``package.module:factory``; returns (model, real layers, real params)."""
    if ":" in spec:
        module, _, attr = spec.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        return _model_from(factory), None, None
    from lightning_bytescale.models import LlamaConfig, LlamaModel

    full = LlamaConfig.preset(spec)
    cfg = LlamaConfig.preset(spec, layers=profile_layers) if profile_layers else full
    return LlamaModel(cfg), full.layers, full.num_params()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bytescale-profile",
        description="Fit T(s), Act(s), the host-link bandwidth (and, with --p2p, the ring link) and the "
        "token capacity C of a model "
        "on this device, and write the cost-model file the planner, strategy and simulator load.",
    )
    p.add_argument(
        "--model", default="small", help="Llama preset (tiny, small, 125m, 1b, 7b, ...) or module:factory"
    )
    p.add_argument(
        "--lengths",
        type=_parse_lengths,
        default=[256, 512, 1024, 2048],
        help="comma-separated sequence lengths",
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument(
        "--profile-layers",
        type=int,
        default=None,
        help="instantiate only this many layers of a preset (the file keeps the real count)",
    )
    p.add_argument(
        "--memory-budget", type=parse_bytes, default=None, help="device bytes per rank, e.g. 80GiB"
    )
    p.add_argument("--reserve", type=parse_bytes, default=0, help="bytes kept free (allocator, workspace)")
    p.add_argument(
        "--state-bytes-per-param",
        type=float,
        default=None,
        help="static bytes per parameter (default 2 x dtype size + 8 for Adam)",
    )
    p.add_argument("--round-to", type=int, default=1, help="round C down to a multiple of this")
    p.add_argument(
        "--p2p",
        action="store_true",
        help="measure the P2P link between two gloo processes on 127.0.0.1 and use it as the ring bandwidth",
    )
    p.add_argument(
        "--p2p-bytes", type=parse_bytes, default=4 * 2**20, help="bytes per P2P exchange (default 4MiB)"
    )
    p.add_argument(
        "--bandwidth-intra", type=parse_bytes, default=None, help="ring bytes/s inside a node, e.g. 150GB"
    )
    p.add_argument(
        "--bandwidth-inter", type=parse_bytes, default=None, help="ring bytes/s between nodes, e.g. 25GB"
    )
    p.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node (ring placement)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", "-o", default="cost_model.json", help="where to write the cost-model file")
    return p  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        model, real_layers, real_params = _build_model(args.model, args.profile_layers)
        profile = run_profile(
            model,
            args.lengths,
            args.device,
            dtype=getattr(torch, args.dtype) if args.dtype else None,
            num_layers=real_layers,
            param_count=real_params,
            memory_budget=args.memory_budget,
            state_bytes_per_param=args.state_bytes_per_param,
            reserve_bytes=args.reserve,
            round_to=args.round_to,
            warmup=args.warmup,
            repeats=args.repeats,
            name=f"profiled-{args.model}",
            p2p=args.p2p,
            p2p_bytes=args.p2p_bytes,
            bandwidth_intra=args.bandwidth_intra,
            bandwidth_inter=args.bandwidth_inter,
            ranks_per_node=args.ranks_per_node,
        )
    except (ProfileError, ValueError) as err:
        print(f"bytescale-profile: error: {err}", file=sys.stderr)
        return 2
    print(profile.summary())
    path = profile.save(args.output)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
